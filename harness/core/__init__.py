"""The core: microbatches, the loss and its one denominator, gradient comparison, the single-device reference,
metrics from counts. Imports nothing else of the harness.
"""
