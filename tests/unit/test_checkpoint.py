"""Checkpoint files in one process: atomic layout, manifest, discovery, and every documented refusal.

A two-rank checkpoint is written here without a process group, in the order ``save_checkpoint``'s barriers give on
W ranks: rank 0 makes the step directory empty, rank 1 then rank 0 write their files, rank 0 writes the manifest last.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.data.config import Config
from harness.resume.checkpoint import (
    MANIFEST,
    SHARED,
    begin_step_dir,
    commit_step_dir,
    latest_checkpoint,
    load_checkpoint,
    rank_file,
    read_manifest,
    trajectory_mismatch,
    write_checkpoint_files,
)
from harness.resume.faults import FAULT_ENV, Fault, parse_fault
from harness.resume.state import state_difference
from harness.training.rng import rank_seed
from harness.training.schedule import WarmupLinearDecay

CONFIG = Config()
LOCK = "a" * 64


def _write(run_dir: Path, step: int, *, world: int = 2, config: Config = CONFIG, lock: str = LOCK) -> Path:
    # As save_checkpoint runs on W ranks, in one process: rank 0 empties the folder before any rank writes
    # (the barrier orders that), every rank writes its file, rank 0 commits last.
    folder = begin_step_dir(run_dir, step, rank=0)
    for rank in reversed(range(world)):
        shared = None
        if rank == 0:
            shared = {
                "step": step,
                "model": {"w": torch.arange(6.0)},
                "optimizer": {"state": {}, "param_groups": []},
                "scheduler": {"last_epoch": step},
                "config": config.to_dict(),
                "data_lock": lock,
            }
        state = {"rank": rank, "world_size": world, "position": step, "losses": [3.0, 2.5], "rng": {"python": None}}
        write_checkpoint_files(folder, shared=shared, rank_state=state, rank=rank)
    names = [SHARED, *(rank_file(r) for r in range(world))]
    commit_step_dir(folder, step, world_size=world, positions=[step] * world, names=names)
    return folder


def _load(folder: Path, *, config: Config = CONFIG, lock: str = LOCK, rank: int = 1, world: int = 2) -> tuple:
    return load_checkpoint(folder, config=config, data_lock=lock, rank=rank, world_size=world)


def test_a_complete_checkpoint_loads_back_what_was_saved(tmp_path: Path) -> None:
    """Shared and per-rank contents come back unchanged, for the rank that asks."""
    folder = _write(tmp_path, 10)
    shared, state = _load(folder)
    assert state_difference({"w": torch.arange(6.0)}, shared["model"]) == 0.0
    assert (state["rank"], state["world_size"], state["position"], state["losses"]) == (1, 2, 10, [3.0, 2.5])


def test_a_step_directory_holds_the_shared_file_one_file_per_rank_and_the_manifest(tmp_path: Path) -> None:
    """The layout is step-NNNN/{shared.pt, rank-R.pt, manifest.json}, with no temporary file left on success."""
    folder = _write(tmp_path, 7)
    assert folder.name == "step-0007"
    assert {SHARED, "rank-0.pt", "rank-1.pt", MANIFEST} == {p.name for p in folder.iterdir()}


def test_the_manifest_records_size_and_sha256_of_every_file(tmp_path: Path) -> None:
    """Each file's entry matches the bytes on disk."""
    import hashlib

    folder = _write(tmp_path, 10)
    manifest = json.loads((folder / MANIFEST).read_text())
    assert (manifest["step"], manifest["world_size"]) == (10, 2)
    for name, entry in manifest["files"].items():
        data = (folder / name).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (entry["size"], entry["sha256"])


def test_latest_checkpoint_skips_a_step_directory_without_manifest(tmp_path: Path) -> None:
    """A step directory whose manifest never got written is incomplete: discovery falls back to the step before."""
    _write(tmp_path, 10)
    (_write(tmp_path, 20) / MANIFEST).unlink()
    assert latest_checkpoint(tmp_path).name == "step-0010"  # type: ignore[union-attr]


def test_latest_checkpoint_skips_a_corrupted_step_and_finds_none_in_an_empty_run(tmp_path: Path) -> None:
    """A checksum failure disqualifies a step like a missing manifest; no complete step gives None."""
    assert latest_checkpoint(tmp_path) is None
    folder = _write(tmp_path, 10)
    _flip_last_byte(folder / "rank-0.pt")
    assert latest_checkpoint(tmp_path) is None


def test_rewriting_a_step_replaces_it_whole(tmp_path: Path) -> None:
    """A second save of the same step (a run restarted over its own folder) yields a valid manifest again."""
    _write(tmp_path, 10, lock="b" * 64)
    folder = _write(tmp_path, 10)
    assert read_manifest(folder)["step"] == 10
    assert _load(folder)[0]["data_lock"] == LOCK


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_changed_byte_is_refused_as_a_checksum_mismatch(tmp_path: Path) -> None:
    """Same size, other bytes: the SHA-256 catches it and the error names the file."""
    folder = _write(tmp_path, 10)
    _flip_last_byte(folder / "rank-1.pt")
    with pytest.raises(ValueError, match=r"rank-1\.pt: checksum mismatch"):
        _load(folder)


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    """A file shorter than the manifest says is reported as truncated, with both sizes."""
    folder = _write(tmp_path, 10)
    path = folder / SHARED
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[: size // 2])
    with pytest.raises(ValueError, match=rf"shared\.pt: truncated: {size // 2} bytes, manifest\.json says {size}"):
        _load(folder)


def test_a_missing_rank_file_is_refused(tmp_path: Path) -> None:
    """A rank file listed by the manifest but absent names that file."""
    folder = _write(tmp_path, 10)
    (folder / "rank-1.pt").unlink()
    with pytest.raises(ValueError, match=r"rank-1\.pt: missing rank file"):
        _load(folder, rank=0)


def test_a_step_directory_without_manifest_is_refused_as_incomplete(tmp_path: Path) -> None:
    """Resuming from an incomplete step directory says so instead of loading half a checkpoint."""
    folder = _write(tmp_path, 10)
    (folder / MANIFEST).unlink()
    with pytest.raises(ValueError, match=r"has no manifest\.json: it is incomplete"):
        _load(folder)


def test_another_data_lock_is_refused(tmp_path: Path) -> None:
    """A checkpoint made from other data is refused, naming the shared file."""
    folder = _write(tmp_path, 10)
    with pytest.raises(ValueError, match=r"shared\.pt: other data lock"):
        _load(folder, lock="c" * 64)


def test_a_config_change_that_alters_the_trajectory_names_the_key_and_both_values(tmp_path: Path) -> None:
    """Changing the learning rate between stop and resume is refused with the key and both values."""
    folder = _write(tmp_path, 10)
    with pytest.raises(ValueError, match=r"config key 'lr' differs: checkpoint has 0\.05, this run has 0\.1"):
        _load(folder, config=CONFIG.replace(lr=0.1))


def test_every_trajectory_field_is_compared_but_stop_and_checkpoint_cadence_may_change() -> None:
    """Any field but stop_at and checkpoint_every is a mismatch, the schedule's length included."""
    saved = CONFIG.to_dict()
    assert trajectory_mismatch(saved, CONFIG.replace(stop_at=30, checkpoint_every=5)) is None
    assert trajectory_mismatch(saved, CONFIG.replace(updates=200)) == ("updates", 100, 200)
    assert trajectory_mismatch(saved, CONFIG.replace(dropout=0.2)) == ("dropout", 0.1, 0.2)


def test_another_world_size_is_refused(tmp_path: Path) -> None:
    """A checkpoint of two ranks does not resume on three: per-rank state cannot be mapped."""
    folder = _write(tmp_path, 10)
    with pytest.raises(ValueError, match="written by world size 2, this run has 3"):
        _load(folder, world=3)


def test_a_rank_file_copied_from_another_rank_is_refused(tmp_path: Path) -> None:
    """rank-1.pt holding rank 0's state (with a manifest to match) is caught by the rank recorded inside."""
    folder = _write(tmp_path, 10)
    (folder / "rank-1.pt").write_bytes((folder / "rank-0.pt").read_bytes())
    (folder / MANIFEST).unlink()
    _rewrite_manifest(folder)
    with pytest.raises(ValueError, match="holds rank 0 of 2, expected rank 1 of 2"):
        _load(folder)


def _rewrite_manifest(folder: Path) -> None:
    import hashlib

    files = {
        p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in folder.iterdir()
    }
    (folder / MANIFEST).write_text(json.dumps({"format": 1, "step": 10, "world_size": 2, "files": files}))


# ------------------------------------------------------------------------------------------ fault injection


def test_a_fault_specification_is_parsed() -> None:
    """rank, step and point come back as a Fault."""
    assert Fault(1, 37, "in-window") == parse_fault("rank=1,step=37,point=in-window")
    assert parse_fault("") is None
    assert parse_fault(None) is None


def test_an_unknown_fault_point_names_the_variable_the_value_and_the_allowed_points() -> None:
    """A typo in the point is an error, never a silently ignored fault."""
    with pytest.raises(ValueError, match=rf"{FAULT_ENV}='rank=1,step=3,point=midwindow'.*in-window, after-rank-temp"):
        parse_fault("rank=1,step=3,point=midwindow")


@pytest.mark.parametrize(
    "value",
    [
        "rank=1,step=3",
        "rank=x,step=3,point=in-window",
        "rank=1,step=0,point=in-window",
        "garbage",
        "rank=1,step=40,point=before-manifest",
    ],
    ids=["missing-point", "rank-not-int", "step-zero", "no-fields", "manifest-not-rank0"],
)
def test_an_invalid_fault_specification_is_refused(value: str) -> None:
    """Malformed fields, impossible steps and a manifest fault on a rank that writes no manifest."""
    with pytest.raises(ValueError, match=FAULT_ENV):
        parse_fault(value)


# ------------------------------------------------------------------------------------- schedule and RNG streams


def test_the_schedule_warms_up_then_decays_to_zero_at_the_last_update() -> None:
    """Warm-up reaches the peak at its last step; the factor is 0 at ``updates`` (100), whatever the stop."""
    f = WarmupLinearDecay(warmup=10, updates=100)
    assert [f(0), f(9), f(10), f(55), f(100)] == [0.1, 1.0, 1.0, 0.5, 0.0]


def test_each_rank_gets_its_own_rng_stream() -> None:
    """Rank seeds differ, so dropout masks differ and restoring rank 0's state everywhere is detectable."""
    assert len({rank_seed(1234, r) for r in range(8)}) == 8


def test_state_difference_is_zero_only_for_equal_states() -> None:
    """Tensors compare by value, other leaves by equality, structure changes are infinite."""
    a = {"w": torch.tensor([1.0, 2.0]), "step": 3, "lrs": [0.5]}
    assert state_difference(a, {"w": torch.tensor([1.0, 2.0]), "step": 3, "lrs": [0.5]}) == 0.0
    assert state_difference(a, {"w": torch.tensor([1.0, 2.5]), "step": 3, "lrs": [0.5]}) == 0.5
    assert float("inf") == state_difference(a, {"w": torch.tensor([1.0, 2.0])})


def test_the_names_that_moved_out_of_the_trainer_are_still_importable_from_it() -> None:
    """The workflow, the benchmarks and the GPU tests import these from ``harness.training.trainer``."""
    from harness.resume import faults, state
    from harness.training import rng, schedule, trainer

    for module, names in [
        (faults, ["FAULT_ENV", "FAULT_POINTS", "FAULT_RECORD", "Fault", "parse_fault"]),
        (schedule, ["WarmupLinearDecay"]),
        (rng, ["rank_seed"]),
        (state, ["state_difference"]),
    ]:
        for name in names:
            assert getattr(trainer, name) is getattr(module, name), name
            assert name in trainer.__all__
