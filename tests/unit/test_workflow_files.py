"""Files the workflow writes survive a crash: a failure in the middle of a write, or between the two renames of the
runs-folder swap, leaves the previous file or folder whole; bad input found after files were written says which.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import harness.workflow.outputs as outputs
import harness.workflow.protocol as protocol
import harness.workflow.report as report
from harness.data.config import load_config
from harness.workflow.cli import main
from harness.workflow.figures import write_figure

ROOT = Path(__file__).resolve().parents[2]
SMALL = str(ROOT / "configs" / "small.yaml")


def _runs(folder: Path, content: str) -> Path:
    for name in ("stopped", "continuous", "resumed"):
        (folder / name).mkdir(parents=True)
        (folder / name / "step-0001").write_text(content)
    return folder


def _contents(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_swap_dir_replaces_the_runs_folder_and_leaves_no_temporary_name(tmp_path: Path) -> None:
    """The new folder takes the final name; the old one and the temporary name are gone."""
    final = _runs(tmp_path / "runs", "old")
    new = _runs(tmp_path / ".tmp-runs-1", "new")
    outputs.swap_dir(new, final)
    assert {"stopped/step-0001": "new", "continuous/step-0001": "new", "resumed/step-0001": "new"} == _contents(final)
    assert ["runs"] == sorted(p.name for p in tmp_path.iterdir())


def test_a_failure_between_the_two_renames_leaves_the_previous_runs_folder_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where no atomic exchange exists, the second rename failing puts the old folder back before the error goes on."""
    final = _runs(tmp_path / "runs", "old")
    before = _contents(final)
    new = _runs(tmp_path / ".tmp-runs-1", "new")
    monkeypatch.setattr(outputs, "exchange", lambda a, b: False)
    real_replace = os.replace
    calls: list[tuple[object, object]] = []

    def second_rename_fails(src: object, dst: object) -> None:
        calls.append((src, dst))
        if len(calls) == 2:
            raise OSError("simulated crash between the renames")
        real_replace(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(outputs.os, "replace", second_rename_fails)
    with pytest.raises(OSError, match="between the renames"):
        outputs.swap_dir(new, final)
    monkeypatch.setattr(outputs.os, "replace", real_replace)
    assert before == _contents(final)


def test_a_process_killed_between_the_two_renames_gets_its_runs_folder_back(tmp_path: Path) -> None:
    """A kill leaves runs/ as .old-runs-PID and no runs/: restore_dir (run before every report) renames it back."""
    _runs(tmp_path / ".old-runs-4242", "old")
    restored = outputs.restore_dir(tmp_path / "runs")
    assert restored is not None and restored.name == ".old-runs-4242"
    assert "old" == (tmp_path / "runs" / "resumed" / "step-0001").read_text()
    assert outputs.restore_dir(tmp_path / "runs") is None  # present: nothing to do


def test_the_exchange_swaps_two_folders_in_one_rename_on_linux(tmp_path: Path) -> None:
    """renameat2(RENAME_EXCHANGE): both names exist before and after; the contents trade places."""
    a, b = _runs(tmp_path / "a", "a"), _runs(tmp_path / "b", "b")
    if not outputs.exchange(a, b):
        pytest.skip("no atomic exchange on this system or file system; swap_dir falls back to two renames")
    assert "b" == (a / "resumed" / "step-0001").read_text()
    assert "a" == (b / "resumed" / "step-0001").read_text()


def test_a_failed_reference_write_leaves_the_previous_reference_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """reference.pt is serialized in memory and renamed in whole: a failure while saving leaves the old bytes."""
    out = tmp_path / "out"
    assert 0 == main(["prepare", "--config", SMALL, "--outputs", str(out)])
    assert 0 == main(["reference", "--config", SMALL, "--outputs", str(out)])
    before = (out / "reference" / "reference.pt").read_bytes()

    def half_then_fail(obj: object, f: object, *args: object, **kwargs: object) -> None:
        if hasattr(f, "write"):
            f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(protocol.torch, "save", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        protocol.compute_reference(load_config(SMALL), out, protocol.require_prepared(load_config(SMALL), out, SMALL))
    assert before == (out / "reference" / "reference.pt").read_bytes()
    assert ["reference.json", "reference.pt"] == sorted(p.name for p in (out / "reference").iterdir())


def test_a_failed_figure_leaves_the_previous_png_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """report.png is drawn in memory: a failure while drawing leaves the old figure and no temporary name."""
    import matplotlib.figure

    path = write_figure(tmp_path / "report.png", [[10, 30]], [3.0, 2.0], [3.0, 2.0], 1)
    before = path.read_bytes()

    def fail(self: object, fname: object, **kwargs: object) -> None:
        if hasattr(fname, "write"):
            fname.write(b"\x89PNG half")
        raise OSError("disk full")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", fail)
    with pytest.raises(OSError, match="disk full"):
        write_figure(path, [[10, 30]], [3.0, 2.0], [3.0, 2.0], 1)
    assert before == path.read_bytes()
    assert ["report.png"] == [p.name for p in tmp_path.iterdir()]


def test_bad_input_found_after_prepare_names_the_files_the_report_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 2 does not claim that nothing was written when prepare and reference already were: it lists them."""
    out = tmp_path / "out"

    def bad_checkpoint(*args: object, **kwargs: object) -> None:
        raise outputs.BadInput("the trio's newest checkpoint is incomplete")

    monkeypatch.setattr(report, "ddp_parity", bad_checkpoint)
    assert 2 == main(["report", "--config", SMALL, "--outputs", str(out)])
    err = capsys.readouterr().err
    assert "the trio's newest checkpoint is incomplete" in err
    for name in (*protocol.PREPARED_FILES, *protocol.REFERENCE_FILES):
        assert name in err
        assert (out / name).is_file()
    assert not (out / "runs").exists()
    assert isinstance(torch.load(out / "reference" / "reference.pt", weights_only=True)["gradient"], torch.Tensor)
