"""A run directory after a crash: malformed manifests refused by name, the audit of what a kill left behind, and
``--resume RUN_DIR`` choosing (or refusing) its newest checkpoint. One process, no process group.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.data.config import Config
from harness.resume.checkpoint import (
    MANIFEST,
    SHARED,
    audit_run_dir,
    begin_step_dir,
    commit_step_dir,
    latest_checkpoint,
    rank_file,
    read_manifest,
    step_dir_name,
    step_dirs,
    step_of,
    write_atomic,
    write_checkpoint_files,
)
from harness.training.torchrun import parse_args, resolve_resume

NO_SUCH_PID = 2**22 + 12345  # above Linux's largest pid_max: no process ever has it


def _write(run_dir: Path, step: int, world: int = 2) -> Path:
    # As save_checkpoint runs on W ranks, in one process: rank 0 empties the folder before any rank writes
    # (the barrier orders that), every rank writes its file, rank 0 commits last.
    folder = begin_step_dir(run_dir, step, rank=0)
    for rank in reversed(range(world)):
        shared = None
        if rank == 0:
            shared = {"step": step, "model": {"w": torch.arange(3.0)}, "optimizer": {}, "scheduler": {},
                      "config": Config().to_dict(), "data_lock": "a" * 64}
        state = {"rank": rank, "world_size": world, "position": step, "losses": [], "rng": {}}
        write_checkpoint_files(folder, shared=shared, rank_state=state, rank=rank)
    names = [SHARED, *(rank_file(r) for r in range(world))]
    commit_step_dir(folder, step, world_size=world, positions=[step] * world, names=names)
    return folder


def _edit_manifest(folder: Path, change: Callable[[Any], Any]) -> None:
    path = folder / MANIFEST
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


def _drop(key: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda m: {k: v for k, v in m.items() if k != key}


def _drop_file(name: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda m: {**m, "files": {k: v for k, v in m["files"].items() if k != name}}


def _set_entry(name: str, key: str, value: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda m: {**m, "files": {**m["files"], name: {**m["files"][name], key: value}}}


MALFORMED = {
    "no-shared": (_drop_file(SHARED), r"lists no shared\.pt"),
    "no-rank-file": (_drop_file("rank-1.pt"), r"lists no rank-1\.pt"),
    "no-files-key": (_drop("files"), r"no 'files' key"),
    "no-world-size": (_drop("world_size"), r"no 'world_size' key"),
    "world-size-str": (lambda m: {**m, "world_size": "2"}, r"'world_size' is '2', not a positive integer"),
    "world-size-bool": (lambda m: {**m, "world_size": True}, r"'world_size' is True"),
    "step-float": (lambda m: {**m, "step": 10.5}, r"'step' is 10\.5"),
    "files-list": (lambda m: {**m, "files": [SHARED]}, r"'files' is a list"),
    "entry-str": (_set_entry(SHARED, "size", "12"), r"entry of 'shared\.pt' has size '12'"),
    "entry-no-sha": (lambda m: {**m, "files": {**m["files"], SHARED: {"size": 1}}}, r"has sha256 None"),
    "entry-not-object": (lambda m: {**m, "files": {**m["files"], SHARED: 7}}, r"entry of 'shared\.pt' is a int"),
    "path-escape": (lambda m: {**m, "files": {**m["files"], "../x.pt": m["files"][SHARED]}}, r"not a plain name"),
    "json-array": (lambda m: [m], r"holds a JSON list"),
}


@pytest.mark.parametrize(("change", "match"), MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_manifest_is_a_value_error_naming_the_file_and_the_fault(
    tmp_path: Path, change: Callable[[Any], Any], match: str
) -> None:
    """Never a KeyError or AttributeError: latest_checkpoint and check-checkpoints catch ValueError only."""
    folder = _write(tmp_path, 10)
    _edit_manifest(folder, change)
    with pytest.raises(ValueError, match=rf"{folder / MANIFEST}: malformed manifest: .*{match}"):
        read_manifest(folder)
    assert latest_checkpoint(tmp_path) is None


def test_a_manifest_that_is_not_json_is_a_value_error_naming_it(tmp_path: Path) -> None:
    """Undecodable bytes are a ValueError with the manifest's path, like any other malformed manifest."""
    folder = _write(tmp_path, 10)
    (folder / MANIFEST).write_bytes(b"\xff{not json")
    with pytest.raises(ValueError, match=rf"{folder / MANIFEST}: not a valid manifest"):
        read_manifest(folder)


def test_step_directory_names_are_made_and_read_in_one_place(tmp_path: Path) -> None:
    """step_dir_name makes the name, step_of reads it back, step_dirs lists them newest first."""
    assert (step_dir_name(7), step_of("step-0007"), step_of("step-12345")) == ("step-0007", 7, 12345)
    assert [step_of(n) for n in ("step-7", "steps-0007", "step-0007.old")] == [None, None, None]
    for step in (5, 20, 100):
        (tmp_path / step_dir_name(step)).mkdir()
    (tmp_path / "step-xx").mkdir()
    assert ["step-0100", "step-0020", "step-0005"] == [p.name for p in step_dirs(tmp_path)]
    assert [] == step_dirs(tmp_path / "absent")


# ----------------------------------------------------------------------------------------------------- audit


def test_the_audit_of_a_sound_run_directory_is_empty(tmp_path: Path) -> None:
    """Complete checkpoints and an atomically written eval.json give no problem."""
    _write(tmp_path, 10)
    _write(tmp_path, 20)
    write_atomic(tmp_path / "eval.json", b"{}")
    assert [] == audit_run_dir(tmp_path)


def test_the_audit_names_a_stale_temporary_a_corrupt_step_and_an_incomplete_one(tmp_path: Path) -> None:
    """What a killed run leaves: a temporary never renamed, a checkpoint without manifest; and a flipped byte."""
    _write(tmp_path, 10)
    corrupt = _write(tmp_path, 20)
    data = bytearray((corrupt / "rank-1.pt").read_bytes())
    data[-1] ^= 0xFF
    (corrupt / "rank-1.pt").write_bytes(bytes(data))
    incomplete = _write(tmp_path, 30)
    (incomplete / MANIFEST).unlink()
    stale = incomplete / f".rank-0.pt.tmp-{NO_SUCH_PID}"
    stale.write_bytes(b"half")
    live = incomplete / f".rank-1.pt.tmp-{os.getpid()}"  # a writer still running: not a leftover
    live.write_bytes(b"being written")

    problems = audit_run_dir(tmp_path)

    assert 3 == len(problems), problems
    assert problems[0].startswith(f"{corrupt}: corrupt checkpoint: ")
    assert "rank-1.pt: checksum mismatch" in problems[0]
    assert problems[1].startswith(f"{incomplete}: incomplete checkpoint: ")
    assert problems[2].startswith(f"{stale}: stale temporary file of rank-0.pt, left by process {NO_SUCH_PID}")


def test_the_audit_names_the_temporary_of_a_writer_that_ended_but_was_not_reaped(
    tmp_path: Path, zombie_pid: int
) -> None:
    """A zombie writer has ended (its pid still answers signal 0): its temporary is a leftover, as a dead one's is."""
    stale = tmp_path / f".shared.pt.tmp-{zombie_pid}"
    stale.write_bytes(b"half")
    assert [f"{stale}: stale temporary file of shared.pt, left by process {zombie_pid}"] == [
        p.split(" (no longer")[0] for p in audit_run_dir(tmp_path)
    ]


def test_the_audit_reports_a_malformed_manifest_and_a_missing_run_directory(tmp_path: Path) -> None:
    """A manifest without shared.pt is a corrupt step; an absent run directory is one problem."""
    folder = _write(tmp_path, 10)
    _edit_manifest(folder, _drop_file(SHARED))
    assert [f"{folder}: corrupt checkpoint: {folder / MANIFEST}: malformed manifest: lists no shared.pt"] == [
        p.split(" (world size")[0] for p in audit_run_dir(tmp_path)
    ]
    assert [f"{tmp_path / 'absent'}: not a directory"] == audit_run_dir(tmp_path / "absent")


# --------------------------------------------------------------------------------------------- --resume RUN_DIR


def _resolve(path: Path, **kwargs: Any) -> tuple[Path, list[str]]:
    said: list[str] = []
    return resolve_resume(str(path), say=said.append, **kwargs), said


def test_resume_from_a_run_directory_uses_and_names_its_newest_complete_checkpoint(tmp_path: Path) -> None:
    """An incomplete newest step is skipped and said; the checkpoint used is named."""
    _write(tmp_path, 10)
    newest = _write(tmp_path, 20)
    incomplete = _write(tmp_path, 30)
    (incomplete / MANIFEST).unlink()  # a kill while writing step 30: skipped without --allow-older
    folder, said = _resolve(tmp_path)
    assert newest == folder
    assert said[0].startswith(f"--resume: skipped {incomplete} (incomplete: no {MANIFEST})")
    assert said[-1] == f"--resume: using {newest}, the newest complete checkpoint of {tmp_path}"


def test_resume_refuses_a_run_directory_whose_newest_checkpoint_is_corrupt(tmp_path: Path) -> None:
    """A corrupt newest checkpoint is never silently replaced by an older one."""
    _write(tmp_path, 10)
    corrupt = _write(tmp_path, 20)
    _edit_manifest(corrupt, _set_entry("rank-0.pt", "size", -1))
    with pytest.raises(SystemExit, match=rf"(?s)newest checkpoint {corrupt} is corrupt: .*--allow-older"):
        _resolve(tmp_path)


def test_resume_with_allow_older_skips_the_corrupt_checkpoint_and_says_so(tmp_path: Path) -> None:
    """--allow-older falls back to the newest valid step and names the one it skipped."""
    older = _write(tmp_path, 10)
    corrupt = _write(tmp_path, 20)
    (corrupt / SHARED).write_bytes(b"")
    folder, said = _resolve(tmp_path, allow_older=True)
    assert older == folder
    assert said[0].startswith(f"--resume: skipped {corrupt} (corrupt: {corrupt / SHARED}: truncated")
    assert said[-1] == f"--resume: using {older}, the newest complete checkpoint of {tmp_path}"


def test_resume_with_allow_older_and_no_valid_checkpoint_names_every_skipped_one(tmp_path: Path) -> None:
    """Nothing valid left is a refusal that lists what was skipped."""
    corrupt = _write(tmp_path, 10)
    (corrupt / SHARED).write_bytes(b"")
    with pytest.raises(SystemExit, match=rf"no complete checkpoint .*skipped: {corrupt} \(corrupt"):
        _resolve(tmp_path, allow_older=True)


def test_resume_from_a_step_directory_is_passed_through_unchanged(tmp_path: Path) -> None:
    """A step directory is used as given, even a corrupt or absent one: load_checkpoint refuses it."""
    """load_checkpoint then says precisely what is wrong with it, as before."""
    corrupt = _write(tmp_path, 20)
    (corrupt / SHARED).write_bytes(b"")
    assert (corrupt, []) == _resolve(corrupt)
    assert (tmp_path / "step-0030", []) == _resolve(tmp_path / "step-0030")
    with pytest.raises(SystemExit, match="neither a step directory nor a run directory"):
        _resolve(tmp_path / "nothing")


def test_allow_older_needs_resume(capsys: pytest.CaptureFixture[str]) -> None:
    """--allow-older without --resume is a usage error."""
    assert parse_args(["--config", "c.yaml", "--resume", "runs/x", "--allow-older"]).allow_older
    with pytest.raises(SystemExit):
        parse_args(["--config", "c.yaml", "--allow-older"])
    assert "--allow-older only applies to --resume RUN_DIR" in capsys.readouterr().err
