"""Distributed plumbing: the launcher (ranks with a deadline, no orphans), the counting comm hook, the rank probe of
``check-environment --dual``.
Imports :mod:`harness.core`, :mod:`harness.data` and :mod:`harness.model` at most; never a recipe, the battery or a
workflow.
"""
