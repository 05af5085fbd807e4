"""Loaded by Python at start-up in every process of a script run by ``python -m harness audit`` (this folder leads its
``PYTHONPATH``): installs the audit (:func:`harness.audit.capture.start`, which does nothing unless the audit's
environment variable is set), then runs the ``sitecustomize`` the environment already had, if any."""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))

try:
    from harness.audit.capture import start

    start()
finally:
    _spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [p for p in sys.path
                                                                       if os.path.abspath(p or ".") != _HERE])
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(_module)
