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
from collections.abc import Callable, Sequence
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

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if not r.passed]

    def table(self) -> str:
        head = (f"resume battery of {self.trainer}: S={self.options.steps}, checkpoint every {self.options.every}, "
                f"W={self.options.world_size}, stops at {self.plan.stop} and {self.plan.second_stop}, kills "
                + ", ".join(f"{p} rank {f.rank} step {f.step}" for p, f in self.plan.kills.items())
                + "\nunder: " + "; ".join(self.settings))
        rows = [f"  {r.status:<11} {r.case:<20} {r.message}" for r in self.results]
        return "\n".join([head, *rows])

    def to_dict(self) -> dict[str, Any]:
        return {"trainer": self.trainer, "passed": self.passed, "seconds": round(self.seconds, 3),
                "settings": list(self.settings), "steps": self.options.steps, "every": self.options.every,
                "world_size": self.options.world_size, "stops": [self.plan.stop, self.plan.second_stop],
                "kills": {p: [f.rank, f.step] for p, f in self.plan.kills.items()},
                "cases": [r.to_dict() for r in self.results]}


# ------------------------------------------------------------------------------------------------- comparing


def differences(expected: Sequence[dict[str, Any]], got: Sequence[dict[str, Any]]) -> str | None:
    """The first state that differs between two legs' summaries (rank order), named; None when every rank matches."""
    for rank, (e, g) in enumerate(zip(expected, got)):
        for part in ("rng", "state"):  # a generator not restored is a cause; a state differing, often its effect
            found = first_difference(e[part], g[part])
            if found is not None:
                path, what = found
                label = f"state(){path}" if part == "state" else f"the global generator {path}"
                return f"rank {rank}: {label} differs: {what}"
        for step, loss in g["losses"].items():
            want = e["losses"].get(step)
            if want is not None and first_difference(want, loss) is not None:
                return f"rank {rank}: the loss of step {step} differs: {want!r} vs {loss!r}"
    return None


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
    def __init__(self, trainer: str, options: ResumeOptions, work: Path, progress: Callable[[str], None]) -> None:
        self.trainer, self.o, self.work, self.say = trainer, options, work, progress
        self.plan = Plan.draw(options)

    def leg(self, run_dir: Path, end: int, *, resume: bool = False, fault: Fault | None = None,
            snapshots: tuple[int, ...] = ()) -> list[Any]:
        leg = Leg(self.trainer, str(run_dir), end, self.o.every, self.o.seed, resume, fault, snapshots)
        return launch(run_leg, self.o.world_size, leg, deadline=self.o.deadline, env=CUBLAS_ENV,
                      expect=(ResumeMismatch, ValueError))

    def run(self) -> tuple[list[CaseResult], Plan]:
        o, plan = self.o, self.plan
        t = time.monotonic()
        wanted = (plan.stop, plan.second_stop)
        control = self.leg(self.work / "continuous", o.steps, snapshots=wanted)
        again = self.leg(self.work / "repeat", o.steps)
        refused = _refusal(control) or _refusal(again)
        if refused is not None:
            status = NOT_BITWISE if refused.startswith("not bitwise") else FAILED
            return [CaseResult(c, status, refused) for c in ("repeatable", *o.cases) if c in CASES], plan
        diff = differences(control, again)
        results = [CaseResult("repeatable", PASSED if diff is None else NOT_BITWISE,
                              "two continuous runs are bitwise equal" if diff is None else
                              f"two continuous runs differ, so no resume can be judged bitwise: {diff}",
                              time.monotonic() - t)]
        if diff is not None:
            return results + [CaseResult(c, NOT_BITWISE, "not judged: the trainer is not repeatable")
                              for c in o.cases if c != "repeatable"], plan
        if "stop-resume" in o.cases or "resume-of-resume" in o.cases:
            results += self._stops(control)
        for point, fault in plan.kills.items():
            if f"kill-{point}" in o.cases:
                results.append(self._kill(control, point, fault))
        return results, plan

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
        return CaseResult(case, PASSED, f"{what}: every state bitwise equal on every rank", seconds)

    def _stops(self, control: list[Any]) -> list[CaseResult]:
        o, plan = self.o, self.plan
        run_dir = self.work / "stopped"
        out = []
        t = time.monotonic()
        first = self.leg(run_dir, plan.stop)
        refused = _refusal(first)
        if refused is not None:
            both = ("stop-resume", "resume-of-resume")
            return [CaseResult(c, FAILED, f"stop at {plan.stop}: {refused}") for c in both if c in o.cases]
        second = self.leg(run_dir, plan.second_stop, resume=True)
        what = f"stop at {plan.stop}, resume to {plan.second_stop}"
        stop_result = self._judge("stop-resume", _at(control, plan.second_stop), second, run_dir, plan.stop, t, what)
        if "stop-resume" in o.cases:
            out.append(stop_result)
        if "resume-of-resume" in o.cases:
            t = time.monotonic()
            what = f"resume of that resumed run from {plan.second_stop} to {o.steps}, same directory"
            if not stop_result.passed:
                out.append(CaseResult("resume-of-resume", FAILED, f"{what}: not run, its first resume failed"))
                return out
            third = self.leg(run_dir, o.steps, resume=True)
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
                return CaseResult(case, FAILED, f"{what}: the killed run failed otherwise: {str(exc).splitlines()[0]}",
                                  time.monotonic() - t)
        else:
            return CaseResult(case, FAILED, f"{what}: the kill never fired (no step {fault.step} {point}?)",
                              time.monotonic() - t)
        resumed = self.leg(run_dir, self.o.steps, resume=True)
        return self._judge(case, control, resumed, run_dir, resumes_at(fault, self.o.every), t, what)


def _refusal(results: Sequence[Any]) -> str | None:
    """What a leg's ranks said instead of a summary (an expected refusal, or a non-deterministic kernel)."""
    for rank, r in enumerate(results):
        if isinstance(r, Expected):
            return f"rank {rank} refused: {r.type}: {r.message}"
        if isinstance(r, dict) and "not_bitwise" in r:
            return f"not bitwise: rank {rank}: {r['not_bitwise']} (a kernel without a deterministic implementation)"
    return None


def run_battery(trainer: str, options: ResumeOptions | None = None,
                progress: Callable[[str], None] | None = None) -> Report:
    """Every case of the battery for ``trainer`` (``pkg.module:factory``); the report says which passed."""
    from harness.resume.contract import resolve_factory

    o = options or ResumeOptions()
    resolve_factory(trainer)  # a bad path is a TrainerError here, in the caller, before any rank starts
    t = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="resume-battery-"))
    try:
        results, plan = _Battery(trainer, o, work, progress or (lambda _m: None)).run()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return Report(trainer, o, plan, results, seconds=time.monotonic() - t)


__all__ = ["CASES", "FAILED", "NOT_BITWISE", "PASSED", "CaseResult", "Plan", "Report", "ResumeOptions",
           "differences", "label_problems", "resumes_at", "run_battery"]
