"""The resume battery: does a user's training loop, killed or stopped anywhere and resumed, land on the bits of a run
that never stopped?

``--trainer=pkg.module:factory`` names the loop (:mod:`~harness.resume.contract`); :mod:`~harness.resume.runner` drives
it on real ranks and wraps its ``save`` with the harness's commit (so a kill can land inside it);
:mod:`~harness.resume.battery` runs the cases and compares every piece of state (:mod:`~harness.resume.compare`);
the checkpoint folders, their manifest and the one discovery of the newest valid one are here too
(:mod:`~harness.resume.checkpoint`, below the trainer that uses them); :mod:`~harness.training.resume_controls` ships
the harness trainer's resume mistakes the battery must reject, and :mod:`~harness.resume.commit_controls` the
commit machinery's own; :mod:`~harness.resume.buckets` keeps every DDP a rank builds in its construction layout, so
that a resumed run's fresh wrapper sums like the run that never stopped; ``examples/`` holds three loops written
without the harness's helpers. ``pytest --pyargs harness.resume --trainer=...`` and
``python -m harness resume --trainer ...`` run it. The harness's own trainer
(:class:`harness.training.trainer.HarnessTrainer`) is the default.
"""
