"""Training: the harness's own loop (:mod:`~harness.training.trainer`, one optimizer step at a time, the resume
battery's default trainer) with its learning-rate schedule (:mod:`~harness.training.schedule`), per-rank generators
(:mod:`~harness.training.rng`), evaluation (:mod:`~harness.training.evaluation`), the torchrun command
(:mod:`~harness.training.torchrun`, ``python -m harness.train``) and the trainer's resume mistakes as the resume
battery's negative controls (:mod:`~harness.training.resume_controls`).

Moved to :mod:`harness.resume`, below this layer, because the resume battery judges any loop with them:
the checkpoint folders, their commit and the one discovery of the newest valid one (``checkpoint``), atomic writes
(``atomic``), the manifest and its checks (``manifest``), the ``HARNESS_FAULT`` kill points (``faults``) and CPU
copies and distances of training states (``state``). ``harness.training.trainer`` still re-exports the names tests
and benchmarks import from it (``FAULT_ENV``, ``Fault``, ``parse_fault``, ``state_difference``, ...).

Never imports the battery, the workflow or the test infrastructure.
"""
