"""The commit machinery's own mistakes, in one process: each control put in place of the right piece
(:mod:`harness.resume.commit_controls`) lets through what the right piece refuses. The battery cases that reject the
first and the last on real ranks are in tests/distributed/test_resume_verdicts.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.resume import atomic, checkpoint, commit_controls, manifest
from harness.resume.checkpoint import (
    MANIFEST,
    CorruptCheckpoint,
    begin_step_dir,
    commit_step_dir,
    newest_valid_checkpoint,
    step_dir_name,
)


class _Killed(Exception):
    """Stands for the SIGKILL that a fault point sends (the test stays alive to look at what it left)."""


def _checkpoint(run_dir: Path, step: int) -> Path:
    folder = begin_step_dir(run_dir, step, rank=0)
    (folder / "rank0.pt").write_bytes(bytes(range(64)))
    commit_step_dir(folder, step, world_size=1, positions=[step], layout="trainer")
    return folder


def _kill_inside_the_manifest_write(run_dir: Path, step: int) -> None:
    folder = begin_step_dir(run_dir, step, rank=0)
    (folder / "rank0.pt").write_bytes(b"x")

    def killed() -> None:
        raise _Killed

    with pytest.raises(_Killed):
        commit_step_dir(folder, step, world_size=1, positions=[step], layout="trainer", midway=killed)


def test_a_kill_inside_the_manifest_write_leaves_the_newest_folder_incomplete_and_skipped(tmp_path: Path) -> None:
    """The control's control: half the manifest sits under its temporary name; discovery resumes from the older
    checkpoint, also when an older one may not be used silently."""
    older = _checkpoint(tmp_path, 10)
    _kill_inside_the_manifest_write(tmp_path, 15)
    assert not (tmp_path / step_dir_name(15) / MANIFEST).exists()
    assert older == newest_valid_checkpoint(tmp_path, allow_older=False).folder


def test_a_write_in_place_leaves_half_a_manifest_that_makes_the_resume_refuse(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: written under its final name, the half manifest reads as a corrupt newest checkpoint."""
    monkeypatch.setattr(atomic, "write_temp", commit_controls._write_in_place)
    monkeypatch.setattr(checkpoint, "write_temp", commit_controls._write_in_place)
    _checkpoint(tmp_path, 10)
    _kill_inside_the_manifest_write(tmp_path, 15)
    assert (tmp_path / step_dir_name(15) / MANIFEST).exists()
    with pytest.raises(CorruptCheckpoint, match="step-0015"):
        newest_valid_checkpoint(tmp_path, allow_older=False)


@pytest.mark.parametrize("control", [False, True], ids=["sha256", "sizes-only"])
def test_a_flipped_byte_at_the_same_size_is_refused_only_by_the_checksum(
    control: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The newest checkpoint's file rots one bit: the real check refuses it; a check of sizes only (the negative
    control) hands it to the resume."""
    if control:
        monkeypatch.setattr(manifest, "_check_file", commit_controls._check_size_only)
    _checkpoint(tmp_path, 10)
    newest = _checkpoint(tmp_path, 15)
    data = bytearray((newest / "rank0.pt").read_bytes())
    data[7] ^= 0x01
    (newest / "rank0.pt").write_bytes(bytes(data))
    if control:
        assert newest == newest_valid_checkpoint(tmp_path, allow_older=False).folder
    else:
        with pytest.raises(CorruptCheckpoint, match="checksum mismatch"):
            newest_valid_checkpoint(tmp_path, allow_older=False)


@pytest.mark.parametrize("control", [False, True], ids=["checked", "trust-newest"])
def test_a_half_written_newest_folder_is_skipped_only_by_a_discovery_that_checks_it(
    control: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kill inside a save leaves step-0015 with a rank file and no manifest: the one discovery resumes from
    step-0010; one that trusts the newest folder (the negative control) picks step-0015."""
    if control:
        monkeypatch.setattr(checkpoint, "newest_valid_checkpoint", commit_controls._trust_newest)
    older = _checkpoint(tmp_path, 10)
    half = begin_step_dir(tmp_path, 15, rank=0)
    (half / "rank0.pt").write_bytes(b"half")
    found = checkpoint.newest_valid_checkpoint(tmp_path, allow_older=False).folder
    assert (half if control else older) == found


def test_an_unknown_commit_control_is_refused_naming_the_controls() -> None:
    """Only the documented controls can be installed."""
    with pytest.raises(ValueError, match=r"commit_bug='nope' must be one of \('write_in_place', 'sizes_only'"):
        commit_controls.install("nope")
