"""The resume battery's verdicts without ranks: every differing entry named per rank, a crashing case named while the
others survive, a refusal of the first run as one usage error, numpy values compared, values outside the contract
refused by key, and a step directory begun again left empty. The legs are faked here (what each rank would return);
tests/distributed/test_resume_verdicts.py runs the same paths on real ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from harness.distributed.launcher import Expected, LaunchError
from harness.resume import battery as battery_module
from harness.resume.battery import FAILED, NOT_BITWISE, PASSED, _Battery, _raised, differences, resumes_at
from harness.resume.checkpoint import MANIFEST, begin_step_dir, check_step_dir, commit_step_dir, step_dir_name
from harness.resume.compare import first_difference
from harness.resume.contract import TrainerError, check_state
from harness.resume.faults import FAULT_RECORD, Fault
from harness.resume.options import CASES, ResumeOptions

SMALL = ResumeOptions(steps=16, every=5)


def _summary(rank: int, start: int, end: int, state: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"rank": rank, "start": start, "resumed_from": step_dir_name(start) if start else None, "skipped": [],
            "losses": {s: float(s) for s in range(start + 1, end + 1)}, "state": state or {"step": end},
            "rng": {"python": [3, [1, 2], None]}, "snapshots": {s: {"state": {"step": s}, "rng":
                                                                   {"python": [3, [1, 2], None]}} for s in (1, 99)}}


class _FakeLegs:
    """What correct ranks return for each leg: the state is the step reached; a kill dies where it should. ``crash``
    and ``refuse`` name run directories whose leg raises or refuses instead."""

    def __init__(self, world: int = 2, crash: str = "", refuse: str = "") -> None:
        self.world, self.crash, self.refuse = world, crash, refuse
        self.ended: dict[Path, int] = {}

    def __call__(self, battery: _Battery, run_dir: Path, end: int, *, resume: bool = False,
                 fault: Fault | None = None, snapshots: tuple[int, ...] = ()) -> list[Any]:
        if run_dir.name == self.refuse:
            return [Expected("ValueError", "world_size=2 (ranks started) differs from config world_size=3")] * 2
        if run_dir.name == self.crash and resume:
            details = {1: "Traceback (most recent call last):\n  File \"loop.py\", line 9, in save\n    own.mkdir()\n"
                          "FileExistsError: [Errno 17] File exists: 'step-0010/rank1'\n"}
            raise LaunchError("raised", [1], details, "rank 1 of 2 raised")
        if fault is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / FAULT_RECORD).write_text("fired\n")
            self.ended[run_dir] = resumes_at(fault, battery.o.every)
            raise LaunchError("died", [fault.rank], {fault.rank: "died from SIGKILL"}, "died")
        start = self.ended.get(run_dir, 0) if resume else 0
        self.ended[run_dir] = end
        out = [_summary(r, start, end) for r in range(self.world)]
        for s in out:
            s["snapshots"] = {k: {"state": {"step": k}, "rng": s["rng"]} for k in snapshots}
        return out


def _run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, legs: _FakeLegs,
         options: ResumeOptions = SMALL) -> battery_module.Report:
    monkeypatch.setattr(_Battery, "leg", lambda self, *a, **k: legs(self, *a, **k))
    b = _Battery("loop:build", options, tmp_path, lambda _m: None)
    results = b.run()
    return battery_module.Report("loop:build", options, b.plan, results, usage_error=b.usage_error)


def test_correct_legs_pass_every_case_each_named_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The control of the tests below: equal summaries pass every case, and each case appears once."""
    report = _run(monkeypatch, tmp_path, _FakeLegs())
    assert list(CASES) == [r.case for r in report.results]
    assert report.passed, report.table()


def test_a_crashing_case_fails_naming_its_exception_and_every_other_case_survives(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A resumed leg that raises FileExistsError on rank 1: that case fails naming both, the table and the JSON hold
    every case, and the kills still pass."""
    report = _run(monkeypatch, tmp_path, _FakeLegs(crash="stopped"))
    status = {r.case: r for r in report.results}
    assert FAILED == status["stop-resume"].status
    assert "crashed: rank 1 raised FileExistsError: [Errno 17] File exists" in status["stop-resume"].message
    assert PASSED == status["kill-in-save"].status
    assert list(CASES) == [c["case"] for c in json.loads(json.dumps(report.to_dict()))["cases"]]


def test_a_refusal_of_the_first_run_is_one_usage_error_and_no_case(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """A trainer that refuses the world size: one usage error, in the table once, no case failures."""
    report = _run(monkeypatch, tmp_path, _FakeLegs(refuse="continuous"))
    assert [] == report.results
    assert not report.passed
    assert "world_size=2 (ranks started) differs" in (report.usage_error or "")
    assert 1 == report.table().count("usage error")


def test_repeatable_appears_once_when_the_first_run_is_not_bitwise(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """A kernel without a deterministic implementation: every case once, each not-bitwise, never passed."""
    def not_bitwise(self: _Battery, *args: Any, **kwargs: Any) -> list[Any]:
        return [{"not_bitwise": "RuntimeError: index_add_ does not have a deterministic implementation"}] * 2

    monkeypatch.setattr(_Battery, "leg", not_bitwise)
    b = _Battery("loop:build", SMALL, tmp_path, lambda _m: None)
    results = b.run()
    assert list(CASES) == [r.case for r in results]
    assert {NOT_BITWISE} == {r.status for r in results}


def test_every_differing_top_level_entry_is_named_per_rank() -> None:
    """Scheduler, data position and weights on rank 0, a generator on rank 1: each is named, not only the first."""
    base = {"step": 9, "model": {"w": torch.ones(2)}, "scheduler": {"last_epoch": 9}, "position": 9}
    expected = [_summary(r, 0, 9, base) for r in range(2)]
    got = [_summary(r, 0, 9, dict(base)) for r in range(2)]
    got[0]["state"] = {**base, "model": {"w": torch.zeros(2)}, "scheduler": {"last_epoch": 10}, "position": 8}
    got[1]["rng"] = {"python": [3, [1, 5], None]}
    said = differences(expected, got)
    assert said is not None
    rank0, rank1 = said.split(" | ")
    for entry in ("state()['model']['w']", "state()['scheduler']['last_epoch']", "state()['position']"):
        assert entry in rank0, said
    assert rank1.startswith("rank 1: the global generator ['python'][1][1] differs: 2 vs 5"), said
    assert differences(expected, [_summary(r, 0, 9, dict(base)) for r in range(2)]) is None


def test_numpy_arrays_in_the_state_compare_bitwise() -> None:
    """Equal arrays (NaN included) match; one changed element, another dtype or a list in its place differ."""
    a = {"numpy": np.random.RandomState(0).get_state(), "v": np.array([1.0, np.nan])}
    b = {"numpy": np.random.RandomState(0).get_state(), "v": np.array([1.0, np.nan])}
    assert first_difference(a, b) is None
    b["v"] = np.array([1.5, np.nan])
    assert ("['v']", "max abs difference 5.000e-01 over 2 elements (numpy)") == first_difference(a, b)
    assert first_difference(np.zeros(2), np.zeros(2, dtype=np.float32)) is not None
    assert first_difference(np.zeros(2), [0.0, 0.0]) is not None


def test_a_value_outside_the_contract_is_refused_naming_its_key() -> None:
    """An object in state() is a TrainerError naming the path, the type and the fix; numpy's state is admitted."""
    check_state({"numpy": np.random.get_state(), "dtype": torch.float32, "step": 3})
    with pytest.raises(TrainerError, match=r"state\(\)\['loader'\]\['sampler'\] is a builtins\.object, .*contract "
                                           r"admits tensors, numpy arrays"):
        check_state({"step": 3, "loader": {"sampler": object()}})
    with pytest.raises(TrainerError, match=r"state\(\)\['tags'\] is a numpy\.ndarray of objects"):
        check_state({"tags": np.array([object()])})


def test_the_line_that_ends_a_traceback_names_the_exception() -> None:
    """The last traceback's exception line, a chained one included; None without a traceback."""
    text = ("Traceback (most recent call last):\n  File \"a.py\", line 1\nKeyError: 'x'\n\nDuring handling of the "
            "above exception, another exception occurred:\n\nTraceback (most recent call last):\n  File \"b.py\"\n"
            "torch.distributed.checkpoint.api.CheckpointException: CheckpointException ranks:{0: ...}\n")
    assert _raised(text) == "torch.distributed.checkpoint.api.CheckpointException: CheckpointException ranks:{0: ...}"
    assert _raised("died from SIGKILL") is None


def test_a_step_directory_begun_again_is_empty_and_its_old_files_reach_no_manifest(tmp_path: Path) -> None:
    """A killed attempt's folder (a rank file, a DCP subfolder, no manifest) is emptied; the manifest lists the new
    file alone."""
    old = tmp_path / step_dir_name(15)
    (old / "dcp").mkdir(parents=True)
    (old / "dcp" / ".metadata").write_bytes(b"old")
    (old / "rank1.pt").write_bytes(b"old")
    folder = begin_step_dir(tmp_path, 15, rank=0)
    assert [] == list(folder.iterdir())
    (folder / "rank0.pt").write_bytes(b"new")
    commit_step_dir(folder, 15, world_size=1, positions=[15], layout="trainer")
    assert ["rank0.pt"] == sorted(json.loads((folder / MANIFEST).read_text())["files"])
    assert 15 == check_step_dir(folder)["step"]
    assert [folder] == [p for p in tmp_path.iterdir()], "no stale copy is left beside it"


def test_the_resume_command_exits_2_with_one_usage_error_and_still_writes_its_json(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A trainer that refuses the options: exit 2 (bad input, not a failed case), the usage error said once, and the
    JSON written with it."""
    from harness.workflow.cli import main

    def refused(trainer: str, options: Any = None, progress: Any = None) -> battery_module.Report:
        o = options or ResumeOptions()
        return battery_module.Report(trainer, o, battery_module.Plan.draw(o), [],
                                     usage_error="the trainer refused to run: rank 0 refused: ValueError: world_size")

    monkeypatch.setattr(battery_module, "run_battery", refused)
    out = tmp_path / "resume.json"
    code = main(["resume", "--trainer", "harness.resume.examples.plain:build", "--json", str(out)])
    said = capsys.readouterr()
    assert 2 == code
    assert 1 == said.out.count("usage error"), said.out  # the table's one row; no case rows
    assert "fail " not in said.out
    assert said.err.startswith("resume: usage error: the trainer refused to run"), said.err
    assert "world_size" in json.loads(out.read_text())["usage_error"]
