"""A re-splitting recipe whose token budget is below the battery's longest row
(``tests/distributed/test_dynamic_microbatches.py``): ranks import it as ``support.dynamic_recipes``."""

from __future__ import annotations

from harness.recipes.dynamic import DynamicTokenMean


class BudgetUnderTheLongestRow(DynamicTokenMean):
    """64 tokens a micro-batch: rank 1's rows of the uneven window hold up to 127, rank 0's fit."""

    name = "budget_under_the_longest_row"
    budget = 64


budget_under_the_longest_row = BudgetUnderTheLongestRow()
