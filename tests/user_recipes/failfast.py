"""Recipes for the pre-flight and the quiet output: one that raises everywhere (the wrong ignore index), one that
raises only with peers, and a correct one that prints in every window."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness.recipes import global_token_mean


class WrongIgnoreIndex:
    """A loop written for labels padded with -1: the battery's -100 is out of bounds for cross_entropy."""

    name = "wrong_ignore_index"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        print("hello from my step")
        for mb in window:
            F.cross_entropy(model(mb.inputs).flatten(0, 1), mb.labels.flatten(), ignore_index=-1).backward()


class RaisesWithPeers:
    """Passes alone (the pre-flight's W=1), raises as soon as there is a peer."""

    name = "raises_with_peers"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        if dist.get_world_size() > 1:
            raise RuntimeError("this loop was only ever run on one device")
        global_token_mean.backward_window(model, window)


class PrintsEveryWindow:
    """The correct recipe, saying so in every window on every rank."""

    name = "prints_every_window"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> Any:
        print("hello from my step")
        print(f"window of {len(window)} microbatches")
        return global_token_mean.backward_window(model, window)


class RefusesEveryWindow:
    """Raises ValueError (the way to refuse a window) on every window, tokens or not."""

    name = "refuses_every_window"

    def backward_window(self, model: torch.nn.Module, window: Sequence[Any]) -> None:
        raise ValueError("this loop reads a batch key the battery does not send")
