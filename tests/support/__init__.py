"""Code only the tests and the benchmarks use, kept out of the ``harness`` package users install.

Rank bodies and recipes of the test suite (``probes``: failure-injecting rank bodies and a DDP step; ``symmetry``:
skipped collectives and the Join recipes; ``reduction``: the summing-hook recipe; ``metrics_bodies``: metrics across
real ranks), and helpers (``sampling``: the ``DistributedSampler`` epoch mode and its audit; ``ports``: a free TCP port
for ``torchrun``). ``tests/conftest.py`` (and ``benchmarks/_common.py``) put ``tests/`` on ``sys.path`` before the
first launch, so ranks import these modules as ``support.<module>`` (and a recipe path reads
``support.<module>:<name>``). Nothing under ``harness/`` imports them (``tests/unit/test_layers.py`` checks it).
"""
