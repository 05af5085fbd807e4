"""Training: the loop with its schedule, RNG state and fault points, checkpoints, evaluation, and the torchrun
command (``python -m harness.train``). Never imports the battery, the workflow or the test infrastructure.
"""
