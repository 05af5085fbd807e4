"""Imported once by the launcher's forkserver as it starts: imports the modules callers asked for with
``launch(..., preload=...)``.

The launcher names them, with the caller's ``sys.path``, in the server's ``HARNESS_LAUNCH_PRELOAD`` environment
variable (JSON), which this module removes again. Each module is imported on its own and one that fails (with any
exception: multiprocessing's own preloading forgives only ``ImportError``, and anything else would end the server) is
skipped with a line on stderr; a rank then imports it itself as before, as it unpickles its function, and reports the
error there.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

from harness.distributed.forkserver import PRELOAD_ENV as ENV


def _load() -> None:
    raw = os.environ.pop(ENV, None)
    if not raw:
        return
    spec = json.loads(raw)
    # The server runs `python -c` and ignores the sys.path multiprocessing hands it: take the caller's, so that a
    # module resolves to the same file here as in a rank.
    caller_path = [p for p in spec.get("sys_path", []) if isinstance(p, str)]
    sys.path[:] = caller_path + [p for p in sys.path if p not in caller_path]
    for name in spec.get("modules", []):
        try:
            importlib.import_module(name)
        except (Exception, SystemExit) as exc:
            print(f"harness launcher: the forkserver could not preload {name!r} ({type(exc).__name__}: {exc}); "
                  "each rank imports it itself", file=sys.stderr, flush=True)


_load()
