"""A TCP port for a rendezvous that needs one (``torchrun --rdzv-backend=static --master-port=...``).

The launcher needs none (its rendezvous is a FileStore, :mod:`harness.distributed.launcher`); these helpers serve the
command lines that start ``torchrun`` themselves: the resume tests, the GPU tests and ``benchmarks/torchrun_trio.py``
(each imports it as ``support.ports``, with ``tests/`` on ``sys.path``).
A port found free can be taken by another process before torchrun binds it, so callers try again with a new port when
:func:`port_taken` recognizes the failure in torchrun's output.
"""

from __future__ import annotations

import socket

HOST = "127.0.0.1"
"""The address the port is free on, and the ``--master-addr`` the callers pass."""

_IN_USE = "address already in use"


def free_port(host: str = HOST) -> int:
    """A TCP port on ``host`` that no socket was bound to a moment ago (the system picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_taken(output: str) -> bool:
    """Whether a run's ``output`` says its port was taken before it could bind it (worth a retry on a new port)."""
    return _IN_USE in output.lower()


__all__ = ["HOST", "free_port", "port_taken"]
