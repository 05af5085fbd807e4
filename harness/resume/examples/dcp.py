"""The plain loop of :mod:`harness.resume.examples.plain`, saving in ``torch.distributed.checkpoint``'s format.

``--trainer=harness.resume.examples.dcp:build``. ``dcp.save`` writes one ``.distcp`` file per rank and a ``.metadata``
file, the format FSDP users save in; model and optimizer go through ``get_state_dict`` / ``set_state_dict`` (keyed
by parameter name, the way ``dcp.load`` needs them). What differs per rank (the data position and every generator)
is not replicated state, so it goes into one ``torch.save`` file per rank beside dcp's files: dcp would keep one
copy of a key that every rank saves alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from harness.resume.examples.plain import PlainTrainer


class DcpTrainer(PlainTrainer):
    def save(self, folder: Path) -> None:
        folder = Path(folder)
        model, optimizer = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model, "optimizer": optimizer, "scheduler": self.scheduler.state_dict()},
                 checkpoint_id=str(folder / "dcp"))
        torch.save(self.rank_state(), folder / f"rank{self.rank}.pt")

    def load(self, folder: Path) -> None:
        folder = Path(folder)
        model, optimizer = get_state_dict(self.model, self.optimizer)
        state: dict[str, Any] = {"model": model, "optimizer": optimizer, "scheduler": self.scheduler.state_dict()}
        dcp.load(state, checkpoint_id=str(folder / "dcp"))  # in place, into the tensors it was given
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.restore_rank_state(torch.load(folder / f"rank{self.rank}.pt", weights_only=True))


def build() -> DcpTrainer:
    """The factory ``--trainer`` names: called on every rank inside the process group."""
    return DcpTrainer()
