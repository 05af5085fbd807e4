"""Loads the harness's pytest plugin, so the suite runs from a checkout without installing the package.

When the package is installed, its ``pytest11`` entry point has the same name as this module path, and pytest skips
the second registration.
"""

pytest_plugins = ["harness.pytest_plugin"]
