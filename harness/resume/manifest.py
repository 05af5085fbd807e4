"""The manifest of a checkpoint (``manifest.json``, written last): size and SHA-256 of every file in the step
directory, and the reading side that trusts a checkpoint only once the manifest's shape and every file check out.

Every problem is a ValueError naming the file and what is wrong with it, never a KeyError from a damaged manifest.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
SHARED = "shared.pt"
FORMAT = 1
LAYOUT_HARNESS = "harness"
"""The harness trainer's files: ``shared.pt`` and one ``rank-R.pt`` per rank, each required. A manifest without a
``layout`` key is of this layout (every manifest written before the key existed)."""
LAYOUT_TRAINER = "trainer"
"""A user's trainer's own files (``torch.save``, ``torch.distributed.checkpoint``, ...), committed by the resume
battery: the manifest lists whatever the trainer's ``save`` wrote and requires nothing by name."""


def rank_file(rank: int) -> str:
    return f"rank-{rank}.pt"



def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()



def read_manifest(folder: str | Path) -> dict[str, Any]:
    """The manifest of ``folder``, after checking that every file it lists is there, whole, and unchanged.

    Any problem, a malformed manifest included, is a ValueError that names the file and what is wrong with it.
    """
    folder = Path(folder)
    if not folder.is_dir():
        msg = f"checkpoint {str(folder)!r} is not a directory; pass a step directory such as runs/stopped/step-0050"
        raise ValueError(msg)
    path = folder / MANIFEST
    if not path.is_file():
        msg = (
            f"checkpoint {str(folder)!r} has no {MANIFEST}: it is incomplete (the run was stopped while writing it); "
            "resume from an earlier step directory or use latest_checkpoint(run_dir)"
        )
        raise ValueError(msg)
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, OSError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        msg = f"{path}: not a valid manifest ({type(exc).__name__}: {exc}); the checkpoint cannot be trusted"
        raise ValueError(msg) from None
    files = _check_manifest(path, manifest)
    for name, entry in files.items():
        _check_file(folder / name, entry)
    return dict(manifest)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_manifest(path: Path, manifest: Any) -> dict[str, dict[str, Any]]:
    """The ``files`` of a parsed manifest, once its shape is right: the keys, their types, and every file listed."""

    def bad(what: str) -> ValueError:
        return ValueError(f"{path}: malformed manifest: {what}; the checkpoint cannot be trusted, use another step")

    if not isinstance(manifest, dict):
        raise bad(f"holds a JSON {type(manifest).__name__}, not an object")
    for key in ("step", "world_size", "files"):
        if key not in manifest:
            raise bad(f"no {key!r} key")
    for key in ("step", "world_size"):
        if not _is_int(manifest[key]) or manifest[key] < (0 if key == "step" else 1):
            raise bad(f"{key!r} is {manifest[key]!r}, not a {'non-negative' if key == 'step' else 'positive'} integer")
    files = manifest["files"]
    if not isinstance(files, dict):
        raise bad(f"'files' is a {type(files).__name__}, not an object of file entries")
    for name, entry in files.items():
        parts = name.split("/") if isinstance(name, str) else [""]
        if not all(parts) or any(part in (".", "..") for part in parts) or name.startswith("/") or "\\" in name:
            raise bad(f"file name {name!r} is not a plain name or relative path inside the step directory")
        if not isinstance(entry, dict):
            raise bad(f"the entry of {name!r} is a {type(entry).__name__}, not an object with size and sha256")
        if not _is_int(entry.get("size")) or entry["size"] < 0:
            raise bad(f"the entry of {name!r} has size {entry.get('size')!r}, not a non-negative integer")
        digest = entry.get("sha256")
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise bad(f"the entry of {name!r} has sha256 {digest!r}, not 64 lowercase hex digits")
    layout = manifest.get("layout", LAYOUT_HARNESS)
    if layout not in (LAYOUT_HARNESS, LAYOUT_TRAINER):
        raise bad(f"'layout' is {layout!r}, not {LAYOUT_HARNESS!r} or {LAYOUT_TRAINER!r}")
    positions = manifest.get("positions")
    if positions is not None and (not isinstance(positions, list) or len(positions) != manifest["world_size"]
                                  or not all(_is_int(p) for p in positions)):
        raise bad(f"'positions' is {positions!r}, not one integer data position per rank")
    required = [SHARED, *(rank_file(r) for r in range(manifest["world_size"]))] if layout == LAYOUT_HARNESS else []
    for name in required:
        if name not in files:
            raise bad(f"lists no {name} (world size {manifest['world_size']} needs {SHARED} and every rank's file)")
    return files


def _check_file(path: Path, entry: Mapping[str, Any]) -> None:
    if not path.is_file():
        kind = "rank file" if path.name.startswith("rank-") else "file"
        msg = f"{path}: missing {kind} listed in {MANIFEST}; the checkpoint is incomplete, resume from another step"
        raise ValueError(msg)
    size = path.stat().st_size
    if size != entry["size"]:
        what = "truncated" if size < entry["size"] else "longer than recorded"
        msg = f"{path}: {what}: {size} bytes, {MANIFEST} says {entry['size']}; resume from another step"
        raise ValueError(msg)
    digest = sha256(path)
    if digest != entry["sha256"]:
        msg = (
            f"{path}: checksum mismatch: SHA-256 {digest[:16]}..., {MANIFEST} says {entry['sha256'][:16]}...; "
            "the file was changed or corrupted, resume from another step"
        )
        raise ValueError(msg)


__all__ = ["FORMAT", "LAYOUT_HARNESS", "LAYOUT_TRAINER", "MANIFEST", "SHARED", "rank_file", "read_manifest", "sha256"]
