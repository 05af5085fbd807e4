"""``package.module:attr`` to the object it names: the one import walk behind ``--recipe``, ``--model`` and
``--trainer``, with the errors that name the option, the path and the fix."""

from __future__ import annotations

import importlib
from typing import Any


def resolve(path: str, option: str, fix: str, error: type[Exception]) -> Any:
    """Import ``path``'s module and walk its dotted attribute; ``error`` (the caller's usage error) naming
    ``option``, the path and ``fix`` when the import fails or an attribute is missing. ``path`` has one colon."""
    module_name, attr = path.split(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        msg = (f"{option}={path!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc} "
               "(is the package installed, or its folder on PYTHONPATH?)")
        raise error(msg) from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            msg = f"{option}={path!r}: {module_name!r} has no attribute {attr!r}; {fix}"
            raise error(msg)
        obj = getattr(obj, part)
    return obj


__all__ = ["resolve"]
