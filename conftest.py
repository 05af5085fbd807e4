"""Loads the harness's pytest plugin, so the suite runs from a checkout without installing the package.

When the package is installed, its ``pytest11`` entry point has the same name as this module path, and pytest skips
the second registration.
"""

pytest_plugins = ["harness.testing.plugin"]


def pytest_addoption(parser):  # type: ignore[no-untyped-def]
    # The `timeout` backstop is pytest-timeout's option: where the plugin is missing (the GPU machine has none), keep
    # the key known so --strict-config does not fail. Every multi-rank run has its own, shorter deadline anyway.
    import importlib.util

    if importlib.util.find_spec("pytest_timeout") is None:
        parser.addini("timeout", "backstop per test, in seconds (used by pytest-timeout when installed)")

