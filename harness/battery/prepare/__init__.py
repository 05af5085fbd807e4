"""Stage 2, preparation, in the parent before any rank starts: takes a
:class:`~harness.battery.plan.options.RunSpec` and the scenario's windows, and gives
:class:`~harness.battery.prepare.steps.Prepared`.

:func:`~harness.battery.prepare.steps.prepare` walks it in order: the declared objective and the windows it needs
(:mod:`.objective`), the warmed starting weights (:mod:`.start`), what the model allows (the probe, :mod:`.probe`,
entered once), the reference chain (:mod:`.chain`) and, in the bf16 lane, the measured noise (:mod:`.bf16`).
"""
