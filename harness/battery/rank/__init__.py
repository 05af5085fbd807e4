"""Stage 3, the rank program, on every rank: takes the prepared spec, windows, weights' digest and starting weights,
and gives one :class:`~harness.battery.launch.run.WindowRecord` per rank and window.

:func:`~harness.battery.rank.rank_program.rank_body` runs the recipe; :mod:`.rank_watch` watches each call (who moved
a global generator: :mod:`.rng_watch`); :mod:`.window_report` says what a rank reports when a window ends.
"""
