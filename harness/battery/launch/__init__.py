"""Stage 4, the launch: takes :class:`~harness.battery.prepare.steps.Prepared` and gives a
:class:`~harness.battery.launch.run.Run` (the ranks' records, the reference chain, the model's notes).

:mod:`.runner` starts the ranks with a deadline (:func:`~harness.battery.launch.runner.launch_run` is stages 2 to 4 in
order); :mod:`.preflight` runs the recipe once on the smallest case first; :mod:`.printed` collects the ranks' prints
to be said once; :mod:`.run` is the record judging reads.
"""
