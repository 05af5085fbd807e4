"""Stage 7, the report: takes the verdicts and gives text, JSON and JUnit.

:mod:`.table` runs the cases without pytest and renders tables and the ``--battery-report`` JSON; :mod:`.summary` is
the last screen on every surface; :mod:`.junit` writes JUnit XML.
"""
