"""The resume battery's pieces that need no ranks: the bitwise comparison, its options, the trainer loader, and the one
discovery of the newest valid checkpoint with its label check and the run directory's fsync."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from harness.resume import checkpoint
from harness.resume.checkpoint import (
    MANIFEST,
    CorruptCheckpoint,
    check_step_dir,
    latest_checkpoint,
    newest_valid_checkpoint,
    save_checkpoint,
)
from harness.resume.compare import first_difference
from harness.resume.contract import TrainerError, resolve_factory
from harness.resume.options import ResumeOptions


def _write(run_dir: Path, step: int, position: int | None = None) -> Path:
    """A one-rank checkpoint of the harness's format, written outside any process group."""
    state = {"rank": 0, "world_size": 1, "position": step if position is None else position}
    return save_checkpoint(run_dir, step, shared={"step": step}, rank_state=state, rank=0, world_size=1)


def test_equal_states_have_no_difference_and_nan_equals_nan() -> None:
    """Bitwise equal nested states (a NaN loss included) compare equal."""
    state = {"model": {"w": torch.tensor([1.0, float("nan")])}, "losses": [math.nan, 2.0], "step": 3}
    assert first_difference(state, {"model": {"w": torch.tensor([1.0, float("nan")])}, "losses": [math.nan, 2.0],
                                    "step": 3}) is None


def test_the_first_difference_is_named_by_its_path_into_the_state() -> None:
    """A momentum buffer one ulp off is found and named, with its size."""
    a = {"optimizer": {"state": {0: {"momentum_buffer": torch.ones(3)}}}}
    b = {"optimizer": {"state": {0: {"momentum_buffer": torch.ones(3).nextafter(torch.full((3,), 2.0))}}}}
    path, what = first_difference(a, b)  # type: ignore[misc]
    assert "['optimizer']['state'][0]['momentum_buffer']" == path
    assert what.startswith("max abs difference 1.192e-07")


def test_a_dtype_change_and_a_missing_key_are_differences() -> None:
    """Same values in float64 instead of float32 differ; so does a key only one side has."""
    assert first_difference(torch.ones(2), torch.ones(2, dtype=torch.float64)) is not None
    assert "only in this run ['extra']" in first_difference({"a": 1}, {"a": 1, "extra": 2})[1]  # type: ignore[index]


def test_resume_options_refuse_too_few_steps_naming_the_fix() -> None:
    """S must leave room for stops and kills after the first checkpoint."""
    with pytest.raises(ValueError, match=r"steps=10 must be at least 3 \* every \+ 1 = 16.*--resume-steps"):
        ResumeOptions(steps=10, every=5)
    with pytest.raises(ValueError, match="world_size=0 must be a positive integer"):
        ResumeOptions(world_size=0)


def test_a_trainer_path_without_a_colon_or_module_is_a_trainer_error() -> None:
    """Bad --trainer values name the value and the expected form; a good one resolves without building."""
    with pytest.raises(TrainerError, match=r"must look like 'package\.module:factory'"):
        resolve_factory("harness.resume.examples.plain.build")
    with pytest.raises(TrainerError, match="importing 'no_such_pkg' failed"):
        resolve_factory("no_such_pkg:build")
    assert callable(resolve_factory("harness.resume.examples.plain:build"))


def test_a_step_directory_whose_labels_agree_is_valid(tmp_path: Path) -> None:
    """The control of the label check: name, manifest step and data position all 10."""
    folder = _write(tmp_path, 10)
    assert 10 == check_step_dir(folder)["step"]
    assert [10] == json.loads((folder / MANIFEST).read_text())["positions"]


def test_a_step_directory_whose_data_position_disagrees_is_refused_and_skipped(tmp_path: Path) -> None:
    """step-0020 holding a rank saved at position 19: named; discovery skips it or refuses, never uses it."""
    older = _write(tmp_path, 10)
    bad = _write(tmp_path, 20, position=19)
    with pytest.raises(ValueError, match=r"labels disagree: the directory names step 20, manifest.json says step 20, "
                                         r"the ranks' data positions are \[19\]"):
        check_step_dir(bad)
    assert older == latest_checkpoint(tmp_path)
    with pytest.raises(CorruptCheckpoint, match="step-0020"):
        newest_valid_checkpoint(tmp_path, allow_older=False)


def test_a_step_directory_renamed_to_another_step_is_refused(tmp_path: Path) -> None:
    """A complete checkpoint of step 10 under the name step-0030 is not step 30."""
    _write(tmp_path, 10).rename(tmp_path / "step-0030")
    with pytest.raises(ValueError, match=r"the directory names step 30, manifest\.json says step 10"):
        check_step_dir(tmp_path / "step-0030")
    found = newest_valid_checkpoint(tmp_path)
    assert found.folder is None and "corrupt" == found.skipped[0][1]


def test_making_a_step_directory_fsyncs_the_run_directory_above_it(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The new entry itself is made durable before files are written into it."""
    synced: list[Path] = []
    monkeypatch.setattr(checkpoint, "fsync_dir", lambda p: synced.append(Path(p)))
    folder = checkpoint.begin_step_dir(tmp_path / "run", 5, rank=0)
    assert tmp_path / "run" == synced[0]
    assert folder in synced
