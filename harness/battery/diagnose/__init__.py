"""Stage 6, the diagnosis of a failing window: takes a :class:`~harness.battery.launch.run.Run`, gives it to
:mod:`harness.diagnosis` as :class:`~harness.diagnosis.evidence.Evidence` (:mod:`.of_run`), and gives back a
:class:`~harness.diagnosis.result.Diagnosis` with its fix."""
