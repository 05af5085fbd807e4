"""What the ranks print: captured per rank at the file-descriptor level, relayed to the caller once per launch.

Each rank points its file descriptors 1 and 2 at one file of its own in the launch's folder (``output-<rank>.txt``,
opened for appending, so stdout and stderr keep their order), before anything else runs in it: Python's prints and
warnings, and what C++ writes (gloo's "collective mismatch", DDP's reducer warnings), land there. Without it the
ranks would write to the descriptors they inherited from the forkserver, which are the caller's as of the server's
start (another test's capture, a terminal long gone), W copies of every warning.

When the launch ends, returned or failed, :func:`relay` writes the lines to the caller's ``sys.stderr`` once: a line
several ranks printed is printed once, prefixed with those ranks (``[ranks 0,1] UserWarning: ...``), a line of one
rank with that rank (``[rank 1] ...``), in the order of first appearance (the ranks read line by line, in turn), at
most :data:`MAX_LINES` distinct lines. Two ranks' lines count as identical when they differ only in torch's
``[rank<r>]:`` prefix and the time stamp of a C++ log line.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Mapping
from typing import TextIO

MAX_LINES = 200
"""Distinct lines relayed per launch; the rest are counted."""

MAX_BYTES = 1 << 20
"""Bytes read back of each rank's output (the start of it)."""

_RANK_PREFIX = re.compile(r"^\[rank\d+\]:")
_LOG_TIME = re.compile(r"^\[([DIWEF])\d{4} \d\d:\d\d:\d\d\.\d+ ")


def path(tmp: str, rank: int) -> str:
    """The file rank ``rank``'s stdout and stderr go to, in the launch's folder ``tmp``."""
    return os.path.join(tmp, f"output-{rank}.txt")


def capture(tmp: str, rank: int) -> None:
    """In a rank: point file descriptors 1 and 2 at :func:`path`, and make Python's stdout line-buffered there, so
    that a rank killed later loses no finished line."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    fd = os.open(path(tmp, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    for name, number in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        if stream is None:  # a server started without that stream: give the rank one
            setattr(sys, name, open(number, "w", buffering=1, closefd=False))  # noqa: SIM115
        else:
            with contextlib.suppress(Exception):
                stream.reconfigure(line_buffering=True)


def read(tmp: str, world_size: int) -> dict[int, str]:
    """Each rank's output, as far as it wrote any (at most :data:`MAX_BYTES` each, then a note)."""
    out = {}
    for rank in range(world_size):
        try:
            with open(path(tmp, rank), "rb") as f:
                data = f.read(MAX_BYTES + 1)
        except OSError:
            continue
        text = data[:MAX_BYTES].decode(errors="replace")
        if len(data) > MAX_BYTES:
            text += f"\n(output cut after {MAX_BYTES} bytes)\n"
        if text:
            out[rank] = text
    return out


def _same(line: str) -> str:
    """A line as compared across ranks (and shown): without torch's ``[rank<r>]:`` prefix and a C++ log line's
    time stamp (``[W1201 10:45:30.647622935 reducer.cpp:1529]`` -> ``[W reducer.cpp:1529]``)."""
    line = _RANK_PREFIX.sub("", line.rstrip())
    return _LOG_TIME.sub(r"[\1 ", line)


same_line = _same
"""A line as compared across ranks and launches (the public name of the normalization above)."""


def merged(texts: Mapping[int, str], max_lines: int = MAX_LINES) -> list[str]:
    """The distinct lines of every rank's output, each prefixed with the ranks that printed it, in the order of
    first appearance; past ``max_lines``, one line counting the rest."""
    per_rank = {r: [_same(ln) for ln in t.splitlines() if ln.strip()] for r, t in sorted(texts.items())}
    ranks: dict[str, list[int]] = {}
    longest = max((len(lines) for lines in per_rank.values()), default=0)
    for i in range(longest):
        for r, lines in per_rank.items():
            if i < len(lines):
                seen = ranks.setdefault(lines[i], [])
                if r not in seen:
                    seen.append(r)
    out = []
    for line, who in ranks.items():
        who = sorted(who)
        label = f"rank {who[0]}" if len(who) == 1 else f"ranks {','.join(map(str, who))}"
        out.append(f"[{label}] {line}")
    if len(out) > max_lines:
        rest = len(out) - max_lines
        out = [*out[:max_lines], f"... {rest} more line{'s' if rest > 1 else ''} of rank output not shown "
               "(launch(..., relay_output=False) returns each rank's whole output)"]
    return out


def relay(texts: Mapping[int, str], stream: TextIO | None = None) -> None:
    """Write :func:`merged` to ``stream`` (the caller's ``sys.stderr`` by default)."""
    lines = merged(texts)
    if not lines:
        return
    stream = stream or sys.stderr
    with contextlib.suppress(Exception):
        stream.write("\n".join(lines) + "\n")
        stream.flush()


def last_lines(text: str, n: int = 6) -> list[str]:
    """The last ``n`` non-empty lines of one rank's output (what a rank that died said last)."""
    return [_same(ln) for ln in text.splitlines() if ln.strip()][-n:]
