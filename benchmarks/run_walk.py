"""How a battery run walks the package before its first rank starts: the modules of ``harness.battery`` the parent's
code passes through, call by call, from the options to the first launch, and how often it comes back to a module it
had already left.

    python benchmarks/run_walk.py [--out benchmarks/results/run_walk.json]

Two walks, each in a fresh process of its own (no cache or import of one walk helps the other), each the command line's
entry function (``harness.workflow.cli.main``) called in that process under ``sys.setprofile``:

* ``case``: ``python -m harness battery --recipe harness.recipes:global_token_mean --battery-world-sizes 2 --precision
  fp32 --strategy ddp --battery-examples 0``, whose first launch is its pre-flight, on ``uneven`` at W=2 in fp32 under
  DDP (the one case ``preparation`` timed in the earlier version of this file);
* ``battery``: the whole default battery of the same recipe (no option), whose first launch is its pre-flight too.

Every Python ``call`` event is attributed to a *room*: the module of the innermost frame on the stack that belongs to
``harness.battery`` and is a function of that module's own. Two kinds of frame are corridors, whose calls count in the
room that called them: a function elsewhere (``harness.core``, ``harness.distributed``, torch, ...), and a method of a
value the stages hand each other (a dataclass instance: ``RunSpec``, ``ModelSpec``, ``Prepared``, ``Run``,
``CheckInfo``; its properties, the methods a dataclass generates), which is the value, carried by whoever holds it.
Code that runs while a module is imported (a module's or a class's body) is not counted, so that when a module is first
imported changes nothing. The walk stops at the first call of ``harness.distributed.launcher.launch`` or of
``multiprocessing``'s ``Process.start``, before any rank exists, and the run is abandoned there.

Counted over the walk: ``modules`` (distinct rooms entered), ``stays`` (maximal runs of consecutive events in one room),
``returns`` (stays in a room already left before: stays - modules) and ``most_entered`` (the rooms with the most stays);
the same under ``stages``, where a room is the stage it belongs to (a sub-folder of ``harness/battery/``; before the
folders existed, the stage docs/layout.md's table gave the module, :data:`FLAT_STAGES`) and the modules beside the
stages (``spec``, ``scenarios``, ``mesh_scenarios``, ``layouts``: the shared model spec and windows) are corridors too;
and under ``preparation``, the stays and returns of the preparation stage, with the modules it entered. The
``sequence`` lists the stages in the order the walk stayed in them.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from _common import RESULTS, ROOT, command, machine, now, write_result

PACKAGE = "harness.battery"
RECIPE = "harness.recipes:global_token_mean"
WALKS: dict[str, list[str]] = {
    "case": ["battery", "--recipe", RECIPE, "--battery-world-sizes", "2", "--precision", "fp32", "--strategy", "ddp",
             "--battery-examples", "0"],
    "battery": ["battery", "--recipe", RECIPE],
}
"""The walks, by name: the command line's arguments after ``python -m harness``."""
CASE = f"{RECIPE}, uneven, W=2, fp32, ddp"
FLAT_STAGES = {f"{PACKAGE}.{m}": f"{PACKAGE}.{stage}" for stage, modules in {
    "plan": ("options", "mesh_options", "plan", "selection", "skips"),
    "prepare": ("prepare", "objective", "start", "chain", "bf16", "facts", "backward_check", "finite_difference",
                "module_check", "gradless", "model_limits", "packing_probe"),
    "rank": ("rank_program", "rank_watch", "rng_watch", "window_report"),
    "launch": ("runner", "run", "preflight", "printed"),
    "judge": ("checks", "registry", "verdict", "failed_runs", "crash_report", "crash_hints", "empty_window", "witness",
              "run_fixes"),
    "diagnose": ("diagnose", "diagnosis_result", "objective_diagnosis", "clipping_diagnosis", "pipeline_diagnosis",
                 "packed_diagnosis", "run_readings"),
    "report": ("table", "junit", "summary"),
}.items() for m in modules}
"""Each module's stage while ``harness/battery/`` was one flat folder (docs/layout.md's table of that time)."""
BESIDE = frozenset(f"{PACKAGE}.{m}" for m in ("spec", "scenarios", "mesh_scenarios", "layouts", "dist"))
"""The modules beside the stages: the shared model spec and windows, carried at the stage level."""
PREPARATION = f"{PACKAGE}.prepare"
SHOWN = 5
"""Rooms listed under ``most_entered``."""


class FirstRank(BaseException):
    """Raised from the profile function at the first launch: a BaseException, so that no ``except Exception`` of the
    harness takes it for a failed run."""


def _in_package(module: str) -> bool:
    return module == PACKAGE or module.startswith(PACKAGE + ".")


def walk(argv: Sequence[str]) -> dict[str, Any]:
    """Call the command line's entry function on ``argv`` in this process and record the room of every call event up
    to the first launch; the rooms, in order, and where the walk stopped."""
    import multiprocessing.process

    from harness.distributed import launcher
    from harness.workflow.cli import main as cli_main

    launch_code = launcher.launch.__code__
    start_code = multiprocessing.process.BaseProcess.start.__code__
    rooms: list[str] = []
    stages: list[str] = []
    stop: dict[str, Any] = {}

    def rooms_of(frame: FrameType | None) -> tuple[str | None, str | None]:
        """The frame's room and its stage's (None: not counted)."""
        module_room = None
        while frame is not None:
            if not frame.f_code.co_flags & inspect.CO_OPTIMIZED:
                return None, None  # a module's or a class's body: an import, not counted
            module = frame.f_globals.get("__name__", "")
            value = dataclasses.is_dataclass(frame.f_locals.get("self"))
            generated = frame.f_code.co_filename.startswith("<")  # a dataclass's __init__, made by exec
            if _in_package(module) and not value and not generated:
                module_room = module_room or str(module)
                where = stage(module)
                if where is not None:
                    return module_room, where
            frame = frame.f_back
        return module_room, None

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code is launch_code or code is start_code:
            sys.setprofile(None)
            stop["at"] = "harness.distributed.launcher.launch" if code is launch_code else "Process.start"
            stop["from"] = rooms_of(frame.f_back)[0]
            spec = (frame.f_locals.get("args") or (None,))[0] if code is launch_code else None
            stop["launch"] = {k: getattr(spec, k, None) for k in ("recipe", "scenario", "world_size", "precision",
                                                                 "strategy")} if spec is not None else None
            raise FirstRank
        room, where = rooms_of(frame)
        if room is not None:
            rooms.append(room)
        if where is not None:
            stages.append(where)

    status: int | None = None
    sys.setprofile(profile)
    try:
        status = cli_main(list(argv))
    except FirstRank:
        pass
    finally:
        sys.setprofile(None)
    return {"rooms": rooms, "stages": stages, "stop": stop, "exit_status": status}


def _stays(seq: Sequence[str]) -> list[str]:
    """``seq`` with each run of equal consecutive items kept once."""
    return [x for i, x in enumerate(seq) if i == 0 or seq[i - 1] != x]


def tally(rooms: Sequence[str]) -> dict[str, Any]:
    """Distinct rooms, stays, returns and the most-entered rooms of a sequence of rooms."""
    stays = _stays(rooms)
    entered = Counter(stays)
    return {"modules": len(entered), "stays": len(stays), "returns": len(stays) - len(entered),
            "most_entered": [[m, n] for m, n in entered.most_common(SHOWN)]}


def stage(module: str) -> str | None:
    """A module's stage: ``harness.battery.<folder>`` for a module in a sub-folder of ``harness/battery/``, the stage
    :data:`FLAT_STAGES` gives a module of the flat folder; None beside the stages (:data:`BESIDE`, the package)."""
    parts = module.split(".")
    if module in BESIDE or len(parts) < 3 or parts[2].startswith("test_"):
        return None
    if len(parts) >= 4:
        return ".".join(parts[:3])
    return FLAT_STAGES.get(module, module)


def summarize(found: dict[str, Any]) -> dict[str, Any]:
    """The figures of a walk: events, rooms, stages and the preparation."""
    rooms: list[str] = found["rooms"]
    stages: list[str] = found["stages"]
    staged = tally(stages)
    inside = [s == PREPARATION for s in stages]
    prep_stays = sum(1 for i, x in enumerate(inside) if x and (i == 0 or not inside[i - 1]))
    entered = sorted({m for m in rooms if stage(m) == PREPARATION})
    return {
        "events": len(rooms),
        "stopped_at": found["stop"],
        **tally(rooms),
        "stages": {"stages": staged.pop("modules"), **staged,
                   "sequence": [s.rsplit(".", 1)[-1] for s in _stays(stages)]},
        "preparation": {"modules": len(entered), "stays": prep_stays, "returns": max(prep_stays - 1, 0),
                        "entered": entered},
    }


def _child(name: str, out: str) -> int:
    """In a fresh process: walk ``WALKS[name]`` and write its summary as JSON to ``out``."""
    found = walk(WALKS[name])
    if not found["stop"]:
        print(f"{name}: the run ended (exit {found['exit_status']}) without starting a rank", file=sys.stderr)
    result = summarize(found)
    Path(out).write_text(json.dumps(result))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(RESULTS / "run_walk.json"))
    p.add_argument("--only", choices=sorted(WALKS), help="walk only this one")
    p.add_argument("--child", choices=sorted(WALKS), help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return _child(args.child, args.child_out)
    names = [args.only] if args.only else list(WALKS)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="run-walk-") as tmp:
        for name in names:
            out = Path(tmp) / f"{name}.json"
            done = subprocess.run([sys.executable, __file__, "--child", name, "--child-out", str(out)], cwd=ROOT,
                                  capture_output=True, text=True, timeout=1800, check=False)
            if done.returncode != 0 or not out.is_file():
                raise SystemExit(f"the {name} walk exited {done.returncode}:\n{done.stdout[-2000:]}\n"
                                 f"{done.stderr[-3000:]}")
            results[name] = {"command": "python -m harness " + " ".join(WALKS[name]), **json.loads(out.read_text())}
            r = results[name]
            print(f"{name}: {r['events']} events; {r['modules']} modules, {r['stays']} stays, {r['returns']} returns; "
                  f"stages {r['stages']['stages']}, {r['stages']['stays']} stays, {r['stages']['returns']} returns; "
                  f"preparation {r['preparation']['stays']} stays, {r['preparation']['returns']} returns "
                  f"(stopped at {r['stopped_at'].get('at')})", flush=True)
    write_result(args.out, {
        "command": command("benchmarks/run_walk.py"),
        "what": "How a battery run walks the package before its first rank starts: the modules of harness.battery the "
                "parent's code passes through, call by call, from the options to the first launch, and how often it "
                "comes back to a module it had already left (each call counted in the innermost harness.battery "
                "module on the stack; the values the stages hand each other and imports not counted), and the same "
                "by stage.",
        "date": now(),
        "machine": machine(),
        "case": CASE,
        **results,
    })
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
