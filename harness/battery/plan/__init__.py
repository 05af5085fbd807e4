"""Stage 1, the plan: takes the command line's or pytest's options and gives the cases to run.

:mod:`.options` decides the options once (:class:`~harness.battery.plan.options.BatteryOptions`, and
:class:`~harness.battery.plan.options.RunSpec`, one run of one recipe on one case; the mesh's and pipeline's options
in :mod:`.mesh_options`); :mod:`.cases` lists the cases (:class:`~harness.battery.plan.cases.Case`), each a
``RunSpec``; :mod:`.selection` and :mod:`.skips` narrow them (``--quick``, ``--battery-skip``).
"""
