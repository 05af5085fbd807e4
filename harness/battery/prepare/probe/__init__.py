"""The model probe, part of preparation: takes a model spec and gives
:class:`~harness.battery.prepare.probe.facts.ModelFacts`, what the model allows, before any rank starts.

:func:`~harness.battery.prepare.probe.facts.probe_model` is its one entry: the shapes the model refuses and what the
battery feeds it (:mod:`.model_limits`), whether its backward is the gradient of its forward (:mod:`.backward_check`,
the module it lies in: :mod:`.module_check`, both by :mod:`.finite_difference`), the parameters without a gradient and
why (:mod:`.gradless`), and whether a packed row's sequences stay apart (the measurement is the diagnosis's,
:func:`harness.diagnosis.packing.packing_gap`, which reads the same question of a failing gradient).
"""
