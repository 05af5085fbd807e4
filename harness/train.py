"""``python -m harness.train``: the torchrun worker command, kept at this path for the commands users already run.

The command itself lives in :mod:`harness.training.torchrun`.
"""

from harness.training.torchrun import entry

if __name__ == "__main__":
    entry()
