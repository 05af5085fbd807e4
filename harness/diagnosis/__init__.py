"""The diagnosis: takes :class:`~harness.diagnosis.evidence.Evidence` (what any source saw of a window: the batches,
the weights each rank started from, the gradient to read and the one expected, the model and its loss convention,
the mesh, objective, strategy, precision and clipping bound) and gives a
:class:`~harness.diagnosis.result.Diagnosis`: the reading, its sentence, its fix and the per-parameter view.

:func:`~harness.diagnosis.diagnose.diagnose` is the entry. Below it: the weight fit (:mod:`.fit`), the catalog of
signatures and the classification (:mod:`.signature_catalog`, :mod:`.signatures`), the window's facts and the words
for a scale (:mod:`.window_facts`, :mod:`.factor_names`), the rows' token weights (:mod:`.row_weights`), the
per-parameter view (:mod:`.parameter_view`), each reading's fix (:mod:`.fix_catalog`, :mod:`.fixes`), and one module
per family of readings: the objective (:mod:`.objective`), clipping (:mod:`.clipping`), the pipeline
(:mod:`.pipeline`), packed rows (:mod:`.packed`, with :mod:`.packing`'s measurement), the mesh (:mod:`.mesh`, with
:mod:`.count_groups`) and the ranks' own gradients (:mod:`.ranks`).

The battery feeds it a launch (:mod:`harness.battery.diagnose.of_run`), ``explain`` the same; nothing here imports the
battery.
"""
