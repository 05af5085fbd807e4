"""Data: the config, the synthetic corpus and its lock, the window plan, batching rows into microbatches.
Imports only :mod:`harness.core`.
"""
