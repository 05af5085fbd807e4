"""The resume battery: every way a real job stops, each compared with one run that never stopped.

Cases, for a trainer stepped to ``S`` with a checkpoint every ``every`` steps (and at each stop):

* ``repeatable``: a second continuous run equals the first, bit for bit. If not, the trainer is not deterministic
  under :data:`~harness.resume.generators.DETERMINISTIC_SETTINGS`: every case is reported ``not-bitwise`` with the
  reason, never passed.
* ``stop-resume``: a stop at a step drawn from the run (not a multiple of ``every``), then a resume into the same
  directory to a second drawn step; compared with the continuous run there.
* ``resume-of-resume``: that resumed run resumed again, into the same directory, to ``S``.
* ``kill-<point>``: SIGKILL of one rank at each of :data:`~harness.resume.runner.KILL_POINTS`, then a resume into the
  killed run's own directory (how restarted jobs run) from its newest complete checkpoint, which must be the one the
  kill left, to ``S``.

Compared on every rank, bitwise: everything ``state()`` returns (weights, optimizer, scheduler, data position, the
trainer's own generators, ``step``), the global generators (Python, numpy, torch CPU and CUDA) after the battery's
draws, and the loss of every step the leg ran. Every committed step directory's name, manifest step and the ranks'
data positions must agree (:func:`harness.resume.checkpoint.check_step_dir`).
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.distributed.launcher import Expected, LaunchError, launch
from harness.resume.checkpoint import MANIFEST, check_step_dir, step_dir_name, step_dirs
from harness.resume.compare import first_difference
from harness.resume.faults import FAULT_RECORD, Fault
from harness.resume.generators import CUBLAS_ENV, DETERMINISTIC_SETTINGS
from harness.resume.options import CASES, ResumeOptions
from harness.resume.runner import Leg, ResumeMismatch, run_leg

PASSED, FAILED, NOT_BITWISE = "pass", "fail", "not-bitwise"


@dataclass(frozen=True)
class Plan:
    """The steps drawn for one battery: where the planned stops and each kill fall."""

    stop: int
    second_stop: int
    kills: dict[str, Fault] = field(default_factory=dict)

    @staticmethod
    def draw(o: ResumeOptions) -> Plan:
        rng = random.Random(o.seed)
        between = [s for s in range(o.every + 1, o.steps) if s % o.every]
        stop = rng.choice([s for s in between if s < o.steps - o.every])
        second = rng.choice([s for s in between if s > stop])
        checkpoints = list(range(2 * o.every, o.steps, o.every))  # each has a complete checkpoint before it
        last = o.world_size - 1
        kills = {
            "in-step": Fault(last, rng.choice(between), "in-step"),
            "in-save": Fault(last, rng.choice(checkpoints), "in-save"),
            "before-commit": Fault(0, rng.choice(checkpoints), "before-commit"),
            "after-commit": Fault(last, rng.choice(checkpoints), "after-commit"),
        }
        return Plan(stop, second, kills)


def resumes_at(fault: Fault, every: int) -> int:
    """The newest complete checkpoint a kill leaves: the kill's own step once its manifest is in, else the last
    multiple of ``every`` before it."""
    if fault.point == "after-commit":
        return fault.step
    return (fault.step - 1) // every * every


@dataclass(frozen=True)
class CaseResult:
    """One case's verdict: ``pass``, ``fail`` (``message`` names the rank and the state that differs) or
    ``not-bitwise`` (the trainer cannot be compared bitwise; ``message`` says why)."""

    case: str
    status: str
    message: str
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    def to_dict(self) -> dict[str, Any]:
        return {"case": self.case, "status": self.status, "message": self.message, "seconds": round(self.seconds, 3)}


@dataclass
class Report:
    """Every case of one battery, with what it ran under."""

    trainer: str
    options: ResumeOptions
    plan: Plan
    results: list[CaseResult]
    settings: tuple[str, ...] = DETERMINISTIC_SETTINGS
    seconds: float = 0.0
    usage_error: str | None = None
    """Set when the trainer refused to run at all under these options (its first run raised an expected error: a
    world size it does not support, a ``state()`` outside the contract): one usage error, and no case was run."""

    @property
    def passed(self) -> bool:
        return self.usage_error is None and all(r.passed for r in self.results)

    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if not r.passed]

    def table(self) -> str:
        head = (f"resume battery of {self.trainer}: S={self.options.steps}, checkpoint every {self.options.every}, "
                f"W={self.options.world_size}, stops at {self.plan.stop} and {self.plan.second_stop}, kills "
                + ", ".join(f"{p} rank {f.rank} step {f.step}" for p, f in self.plan.kills.items())
                + "\nunder: " + "; ".join(self.settings))
        rows = [f"  {r.status:<11} {r.case:<20} {r.message}" for r in self.results]
        if self.usage_error is not None:
            rows = [f"  usage error: no case was run: {self.usage_error}"]
        return "\n".join([head, *rows])

    def to_dict(self) -> dict[str, Any]:
        return {"trainer": self.trainer, "passed": self.passed, "seconds": round(self.seconds, 3),
                "settings": list(self.settings), "steps": self.options.steps, "every": self.options.every,
                "world_size": self.options.world_size, "stops": [self.plan.stop, self.plan.second_stop],
                "kills": {p: [f.rank, f.step] for p, f in self.plan.kills.items()},
                "usage_error": self.usage_error, "cases": [r.to_dict() for r in self.results]}


# ------------------------------------------------------------------------------------------------- comparing


def differences(expected: Sequence[dict[str, Any]], got: Sequence[dict[str, Any]]) -> str | None:
    """Every top-level entry that differs between two legs' summaries, per rank (rank order), each named with its
    first differing leaf; None when every rank matches.

    Within a rank: the global generators first (a generator not restored is a cause), then each entry of
    ``state()`` (the weights differing is often the effect of another entry: the scheduler, the data position, a
    generator), then the losses. Naming only the first would name the symptom as often as the cause."""
    ranks = []
    for rank, (e, g) in enumerate(zip(expected, got)):
        found = [f"the global generator {path} differs: {what}" for path, what in _entries(e["rng"], g["rng"])]
        found += [f"state(){path} differs: {what}" for path, what in _entries(e["state"], g["state"])]
        steps = [step for step, loss in g["losses"].items()
                 if step in e["losses"] and first_difference(e["losses"][step], loss) is not None]
        if steps:
            first = steps[0]
            found.append(f"the loss of step {first} differs: {e['losses'][first]!r} vs {g['losses'][first]!r}"
                         + (f" (and of {len(steps) - 1} later step(s))" if len(steps) > 1 else ""))
        if found:
            ranks.append(f"rank {rank}: " + "; ".join(found))
    return " | ".join(ranks) if ranks else None


def _entries(expected: Any, got: Any) -> list[tuple[str, str]]:
    """``(path, what)`` for each top-level entry of two mappings that differs (its first differing leaf), keys only
    one side has included; the whole value as one entry when either is no mapping."""
    if not (isinstance(expected, Mapping) and isinstance(got, Mapping)):
        found = first_difference(expected, got)
        return [] if found is None else [found]
    out = []
    if set(expected) != set(got):
        out.append(("", f"keys differ: only in the continuous run {sorted(map(str, set(expected) - set(got)))}, "
                        f"only in this run {sorted(map(str, set(got) - set(expected)))}"))
    for key in expected:
        if key in got:
            found = first_difference(expected[key], got[key], f"[{key!r}]")
            if found is not None:
                out.append(found)
    return out


def label_problems(run_dir: Path) -> list[str]:
    """Every committed step directory of ``run_dir`` whose name, manifest step and data positions disagree (or which
    is otherwise not a valid checkpoint)."""
    problems = []
    for folder in step_dirs(run_dir):
        if (folder / MANIFEST).is_file():
            try:
                check_step_dir(folder)
            except ValueError as exc:
                problems.append(str(exc))
    return problems


def _at(snapshot: Sequence[dict[str, Any]], step: int) -> list[dict[str, Any]]:
    """The continuous run's summaries as they were after ``step``."""
    return [{**s["snapshots"][step], "losses": s["losses"]} for s in snapshot]


# ---------------------------------------------------------------------------------------------------- running


class _Battery:
    def __init__(self, trainer: str, options: ResumeOptions, work: Path, progress: Callable[[str], None],
                 commit_bug: str | None = None) -> None:
        self.trainer, self.o, self.work, self.say, self.commit_bug = trainer, options, work, progress, commit_bug
        self.plan = Plan.draw(options)
        self.usage_error: str | None = None

    def leg(self, run_dir: Path, end: int, *, resume: bool = False, fault: Fault | None = None,
            snapshots: tuple[int, ...] = ()) -> list[Any]:
        leg = Leg(self.trainer, str(run_dir), end, self.o.every, self.o.seed, resume, fault, snapshots,
                  self.commit_bug)
        return launch(run_leg, self.o.world_size, leg, deadline=self.o.deadline, env=CUBLAS_ENV,
                      expect=(ResumeMismatch, ValueError))

    def run(self) -> list[CaseResult]:
        """Every case asked for, each once, ``repeatable`` first. A case whose runs crash fails with the exception
        named; the others still run. A refusal of the first run is the report's one usage error, and no case."""
        o, plan = self.o, self.plan
        rest = [c for c in CASES if c in o.cases and c != "repeatable"]
        t = time.monotonic()
        control, again = None, None
        try:
            control = self.leg(self.work / "continuous", o.steps, snapshots=(plan.stop, plan.second_stop))
            refused = _refusal(control)
            if refused is not None and not refused.startswith("not bitwise"):
                self.usage_error = f"the trainer refused to run: {refused}"
                return []
            if refused is None:
                again = self.leg(self.work / "repeat", o.steps)
                refused = _refusal(again)
        except Exception as exc:  # a crash of a continuous run: nothing can be judged, but the report survives
            which = "first" if control is None else "second"
            return [CaseResult("repeatable", FAILED, f"the {which} continuous run crashed: {_crash(exc)}",
                               time.monotonic() - t),
                    *(CaseResult(c, FAILED, "not run: the continuous run it is compared with crashed") for c in rest)]
        if refused is not None:
            status = NOT_BITWISE if refused.startswith("not bitwise") else FAILED
            return [CaseResult("repeatable", status, refused, time.monotonic() - t),
                    *(CaseResult(c, status, f"not judged: {refused}") for c in rest)]
        assert control is not None and again is not None
        diff = differences(control, again)
        results = [CaseResult("repeatable", PASSED if diff is None else NOT_BITWISE,
                              "two continuous runs are bitwise equal" if diff is None else
                              f"two continuous runs differ, so no resume can be judged bitwise: {diff}",
                              time.monotonic() - t)]
        if diff is not None:
            return results + [CaseResult(c, NOT_BITWISE, "not judged: the trainer is not repeatable") for c in rest]
        if "stop-resume" in o.cases or "resume-of-resume" in o.cases:
            results += self._stops(control)
        for point, fault in plan.kills.items():
            if f"kill-{point}" in o.cases:
                began = time.monotonic()
                try:
                    results.append(self._kill(control, point, fault))
                except Exception as exc:
                    results.append(CaseResult(f"kill-{point}", FAILED, f"crashed: {_crash(exc)}",
                                              time.monotonic() - began))
        return results

    def _judge(self, case: str, expected: list[dict[str, Any]], got: list[Any], run_dir: Path, start: int,
               began: float, what: str) -> CaseResult:
        seconds = time.monotonic() - began
        refused = _refusal(got)
        if refused is not None:
            return CaseResult(case, FAILED, f"{what}: {refused}", seconds)
        if [g["start"] for g in got] != [start] * len(got):
            return CaseResult(case, FAILED, f"{what}: resumed at step {got[0]['start']} "
                              f"({got[0]['resumed_from']}), expected the newest complete checkpoint "
                              f"{step_dir_name(start)}", seconds)
        labels = label_problems(run_dir)
        if labels:
            return CaseResult(case, FAILED, f"{what}: {labels[0]}", seconds)
        diff = differences(expected, got)
        if diff is not None:
            return CaseResult(case, FAILED, f"{what}: {diff}", seconds)
        skipped = got[0].get("skipped") or []
        via = f" (resumed from {got[0]['resumed_from']}" + (f", skipping {', '.join(skipped)})" if skipped else ")")
        return CaseResult(case, PASSED, f"{what}: every state bitwise equal on every rank{via}", seconds)

    def _stops(self, control: list[Any]) -> list[CaseResult]:
        o, plan = self.o, self.plan
        run_dir = self.work / "stopped"
        wanted = [c for c in ("stop-resume", "resume-of-resume") if c in o.cases]
        out: list[CaseResult] = []
        t = time.monotonic()
        what = f"stop at {plan.stop}, resume to {plan.second_stop}"
        try:
            first = self.leg(run_dir, plan.stop)
            refused = _refusal(first)
            if refused is not None:
                return [CaseResult(c, FAILED, f"stop at {plan.stop}: {refused}") for c in wanted]
            second = self.leg(run_dir, plan.second_stop, resume=True)
        except Exception as exc:
            return [CaseResult(c, FAILED, f"{what}: crashed: {_crash(exc)}", time.monotonic() - t) for c in wanted]
        stop_result = self._judge("stop-resume", _at(control, plan.second_stop), second, run_dir, plan.stop, t, what)
        if "stop-resume" in o.cases:
            out.append(stop_result)
        if "resume-of-resume" in o.cases:
            t = time.monotonic()
            what = f"resume of that resumed run from {plan.second_stop} to {o.steps}, same directory"
            if not stop_result.passed:
                out.append(CaseResult("resume-of-resume", FAILED, f"{what}: not run, its first resume failed"))
                return out
            try:
                third = self.leg(run_dir, o.steps, resume=True)
            except Exception as exc:
                out.append(CaseResult("resume-of-resume", FAILED, f"{what}: crashed: {_crash(exc)}",
                                      time.monotonic() - t))
                return out
            out.append(self._judge("resume-of-resume", control, third, run_dir, plan.second_stop, t, what))
        return out

    def _kill(self, control: list[Any], point: str, fault: Fault) -> CaseResult:
        case = f"kill-{point}"
        run_dir = self.work / case
        t = time.monotonic()
        what = f"SIGKILL of rank {fault.rank} {point} of step {fault.step}, resume in the same directory"
        try:
            self.leg(run_dir, self.o.steps, fault=fault)
        except LaunchError as exc:
            fired = (run_dir / FAULT_RECORD).is_file()
            if exc.kind != "died" or not fired:
                return CaseResult(case, FAILED, f"{what}: the killed run failed otherwise: {_crash(exc)}",
                                  time.monotonic() - t)
        else:
            return CaseResult(case, FAILED, f"{what}: the kill never fired (no step {fault.step} {point}?)",
                              time.monotonic() - t)
        try:
            resumed = self.leg(run_dir, self.o.steps, resume=True)
        except Exception as exc:
            return CaseResult(case, FAILED, f"{what}: the resumed run crashed: {_crash(exc)}", time.monotonic() - t)
        return self._judge(case, control, resumed, run_dir, resumes_at(fault, self.o.every), t, what)


def _crash(exc: BaseException) -> str:
    """A crashed leg in one line: which rank raised which exception (the line that ends its traceback), or how it
    ended; any other exception by its type and message."""
    if isinstance(exc, LaunchError):
        for rank in exc.ranks:
            raised = _raised(exc.details.get(rank, "")) if exc.kind == "raised" else None
            if raised is not None:
                return f"rank {rank} raised {raised}"
        return str(exc).splitlines()[0]
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _raised(traceback_text: str) -> str | None:
    """The exception line of the last traceback in ``traceback_text``: the first line after its header that is not
    an indented frame (``FileExistsError: [Errno 17] File exists: ...``); None without a traceback."""
    lines = traceback_text.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if not heads:
        return None
    for line in lines[heads[-1] + 1:]:
        if line and not line[0].isspace():
            return line[:500]
    return None


def _refusal(results: Sequence[Any]) -> str | None:
    """What a leg's ranks said instead of a summary (an expected refusal, or a non-deterministic kernel)."""
    for rank, r in enumerate(results):
        if isinstance(r, Expected):
            return f"rank {rank} refused: {r.type}: {r.message}"
        if isinstance(r, dict) and "not_bitwise" in r:
            return f"not bitwise: rank {rank}: {r['not_bitwise']} (a kernel without a deterministic implementation)"
    return None


def run_battery(trainer: str, options: ResumeOptions | None = None,
                progress: Callable[[str], None] | None = None, *, commit_bug: str | None = None) -> Report:
    """Every case of the battery for ``trainer`` (``pkg.module:factory``); the report says which passed.
    ``commit_bug``: one of :data:`harness.resume.commit_controls.COMMIT_BUGS`, installed in every rank (negative
    controls of the harness's own commit; tests only)."""
    from harness.resume.contract import resolve_factory

    o = options or ResumeOptions()
    resolve_factory(trainer)  # a bad path is a TrainerError here, in the caller, before any rank starts
    t = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="resume-battery-"))
    battery = _Battery(trainer, o, work, progress or (lambda _m: None), commit_bug)
    try:
        results = battery.run()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return Report(trainer, o, battery.plan, results, seconds=time.monotonic() - t, usage_error=battery.usage_error)


__all__ = ["CASES", "FAILED", "NOT_BITWISE", "PASSED", "CaseResult", "Plan", "Report", "ResumeOptions",
           "differences", "label_problems", "resumes_at", "run_battery"]
