"""Stage 5, judging: takes a :class:`~harness.battery.launch.run.Run` and gives one
:class:`~harness.battery.judge.verdict.Verdict` per check.

:mod:`.checks` holds the checks (registered in :mod:`.registry`; the empty window's two policies in
:mod:`.empty_window`); :mod:`.failed_runs` reads a failed launch as a verdict, with the recipe's own frame
(:mod:`.crash_report`) and a known crash's fix (:mod:`.crash_hints`); :mod:`.run_fixes` gives a failing verdict its
fix in the run's words; :mod:`.witness` keeps a drawn layout's reading through shrinking.
"""
