"""Recipes written the way users write them, outside the harness package: the battery must judge them right.

Each module imports only torch (never the harness's own helpers), so a verdict on it is a verdict on code this
repository did not shape. ``tests/conftest.py`` puts ``tests/`` on ``sys.path`` so ranks import them as
``user_recipes.<module>:<attr>``.
"""
