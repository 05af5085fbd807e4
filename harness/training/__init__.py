"""Training: the loop (trainer) with its schedule, RNG state, fault points and state comparison; checkpoints
(checkpoint, with atomic writes and the manifest beside it), evaluation, and the torchrun command
(``python -m harness.train``). Never imports the battery, the workflow or the test infrastructure.
"""
