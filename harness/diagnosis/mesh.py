"""The mesh family: the readings of a run over a device mesh of more than one dimension.

A count reduced over the wrong group of the mesh weighs the blocks of one group alike
(:mod:`harness.diagnosis.count_groups` reads which group off the fitted weights); a common scale that is one mesh size
over another is named by those sizes; on a mesh with cp each cp rank's chunk of a microbatch is a block of its own
(:func:`token_blocks`); a model that shards the sequence itself is named where nothing else explains the gradient
(:func:`sharded_sequence_note`).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from harness.core.mesh import Mesh
from harness.core.microbatch import IGNORE_INDEX, PAD, Microbatch
from harness.core.objective_names import SEQUENCE_MEAN
from harness.data.context_parallel import supervise_chunk
from harness.diagnosis.count_groups import count_group, mesh_factor
from harness.diagnosis.evidence import Evidence
from harness.diagnosis.fit import Block, Fit, explained_residual
from harness.diagnosis.signatures import SIGNATURES, Signature
from harness.distributed.sequence_sharding import plan_of as sequence_plan_of


def token_blocks(ev: Evidence, window: int) -> list[tuple[Block, Microbatch]]:
    """The fit's blocks of ``window`` and the microbatch each stands for: every microbatch of every data rank, and on
    a mesh with cp, each cp rank's chunk of it apart (a count reduced over the wrong group weighs the chunks of one
    microbatch apart). A block's ``rank`` is its token rank (:meth:`harness.core.mesh.Mesh.token_rank`). A chunk's
    microbatch carries its rows' whole counts (``Microbatch.counts``), so that under a per-sequence objective its
    block is its tokens' share of their sequences', not a mean over the chunk alone."""
    mesh = ev.mesh
    cp = mesh.size("cp")
    chunking = ev.chunking
    out = []
    for d, mbs in enumerate(ev.windows[window]):
        for c in range(cp):
            t = d * cp + c
            holder = None
            if len(mesh.names) > 1:
                at = mesh.holder(t)
                holder = f"rank {at} ({', '.join(f'{k} {v}' for k, v in mesh.coords(at).items() if mesh.size(k) > 1)})"
            for m, mb in enumerate(mbs):
                part = supervise_chunk(mb, c, cp, chunking)
                if part is not mb:  # a per-sequence objective divides a chunk's tokens by their whole row's count
                    whole = mb.counts if mb.counts is not None else (mb.labels != IGNORE_INDEX).sum(dim=1)
                    part = dataclasses.replace(part, counts=whole)
                real = int((mb.inputs != PAD).sum()) if cp == 1 else 0
                out.append((Block(t, m, part.supervised, rows=mb.inputs.shape[0], real=real, holder=holder), part))
    return out


def mesh_reading(sig: Signature, blocks: list[Block], fit: Fit, mesh: Mesh) -> Signature:
    """On a mesh of more than one dimension: a reading of the weights that a count reduced over a group of the mesh
    explains is named by that group (``count_group``), and a common scale that is one mesh size over another by
    those sizes."""
    if len(mesh.names) < 2 or sig.name in ("correct", "float32_computation", "extra_term", "not_synchronized"):
        return sig
    n = sum(b.tokens for b in blocks)
    q = [float(w) * n for w in fit.weights]
    if fit.residual <= explained_residual():
        found = count_group(blocks, q, mesh)
        if found is not None:
            return found
    if sig.name == "global_scale" and sig.factor is not None:
        words = mesh_factor(sig.factor, mesh)
        if words is not None:
            return dataclasses.replace(sig, sentence=f"{words}; {sig.sentence}")
    return sig


def per_shard_sequence_reading(ev: Evidence, window: int, rows: list[tuple[Microbatch, torch.Tensor]],
                               g: torch.Tensor) -> Signature | None:
    """Under cp and the sequence mean: the gradient every cp rank leaves by dividing its chunk of each sequence by the
    chunk's own count of its tokens (``per_shard_sequence_mean``), tested as one hypothesis. ``rows`` holds each
    (chunk, row) block of the window, its microbatch carrying the whole row's count, with its column (the row's term
    of the numerator over the chunk's tokens): the hypothesis weighs each column ``n_row / n_chunk``, and one scale
    ``s`` must take it to ``g`` within the fit's explained residual. The scale is named where it is ``1/S`` (the
    window's sequences) or ``1/S'`` (the sequences counted once per chunk that holds one of their tokens, as a
    count over the token group does). None where the mesh has no cp, the objective is another, or the hypothesis
    leaves more unexplained."""
    if ev.mesh.size("cp") < 2 or ev.objective.name != SEQUENCE_MEAN:
        return None
    h = torch.zeros_like(g)
    shards = 0
    for mb, col in rows:
        chunk = mb.supervised
        if chunk and mb.counts is not None:
            h = h + col * (float(mb.counts[0]) / chunk)
            shards += 1
    hh = float(h.dot(h))
    if hh == 0 or not shards:
        return None
    scale = float(g.dot(h)) / hh
    gap = float((g - scale * h).norm() / g.norm()) if float(g.norm()) > 0 else math.inf
    if gap > explained_residual():
        return None
    whole = ev.objective.window_normalizer(ev.windows[window])
    said = f"the gradient is that hypothesis times {scale:.6g} ({gap:.1e} left unexplained)"
    for z, what in ((whole, f"S = {whole:g}, the window's sequences"),
                    (float(shards), f"S' = {shards}, the sequences counted once per chunk holding one of their tokens "
                                    "(a sequence count over the token group dp x cp)")):
        if abs(scale * z - 1) <= 1e-3:
            said = f"divided by {what}"
            break
    return Signature("per_shard_sequence_mean", f"{SIGNATURES['per_shard_sequence_mean']}; {said}")


def sharded_sequence_note(ev: Evidence, sig: Signature) -> Signature:
    """An unexplained reading on a cp mesh whose model shards the sequence itself (its ``cp_plan``): the sentence
    says the forward over the chunks may be the cause."""
    if ev.mesh.size("cp") < 2 or sequence_plan_of(ev.model_path) is None:
        return sig
    return dataclasses.replace(sig, sentence=f"{sig.sentence}; this run's model shards the sequence (its cp_plan): "
                              "a gradient no re-weighting gives can come from its forward over the chunks (an "
                              "attention masked for another chunking than the run's, positions not passed), "
                              "which the reference, on whole sequences, does not share: run the same with the "
                              "other --cp-chunking, or compare the sharded logits with the whole ones")


__all__ = ["mesh_reading", "per_shard_sequence_reading", "sharded_sequence_note", "token_blocks"]
