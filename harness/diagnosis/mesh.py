"""The mesh family: the readings of a run over a device mesh of more than one dimension.

A count reduced over the wrong group of the mesh weighs the blocks of one group alike
(:mod:`harness.diagnosis.count_groups` reads which group off the fitted weights); a common scale that is one mesh size
over another is named by those sizes; on a mesh with cp each cp rank's chunk of a microbatch is a block of its own
(:func:`token_blocks`); a model that shards the sequence itself is named where nothing else explains the gradient
(:func:`sharded_sequence_note`), after the one mistake of such a run's labels the diagnosis tests: each cp rank
shifting its chunk's already shifted labels again (:func:`chunk_shift_reading`).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from harness.core.compare import flat_grad
from harness.core.mesh import Mesh
from harness.core.microbatch import IGNORE_INDEX, PAD, Microbatch
from harness.core.objective_names import SEQUENCE_MEAN
from harness.data.context_parallel import positions, supervise_chunk
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


def chunk_shifted_labels(mb: Microbatch, cp_rank: int, cp: int, chunking: str) -> Microbatch:
    """``mb`` with cp rank ``cp_rank``'s labels shifted one more column within its chunk, as a rank that shifts
    the labels it holds does: each held position's target becomes the next held position's (the chunk's first
    target dropped, its last held position unsupervised), every other position unsupervised."""
    held = positions(mb.labels.shape[1], cp_rank, cp, chunking).to(mb.labels.device).nonzero().flatten()
    labels = torch.full_like(mb.labels, IGNORE_INDEX)
    labels[:, held[:-1]] = mb.labels[:, held[1:]]
    return Microbatch(mb.inputs, labels)


def chunk_shift_reading(ev: Evidence, window: int, model: torch.nn.Module, g: torch.Tensor) -> Signature | None:
    """Under cp with a model that shards the sequence, and the token mean: the gradient every cp rank leaves by
    shifting its chunk's labels one more column (:func:`chunk_shifted_labels`: labels shifted and sharded, then
    shifted again on each rank), tested as one hypothesis: the shifted chunks' loss sums, recomputed on whole
    sequences, at one common weight ``s``, within the fit's explained residual. The scale is named where it is
    ``1/N'`` (the shifted labels' own count) or ``1/N``. None otherwise."""
    cp = ev.mesh.size("cp")
    if cp < 2 or not ev.objective.plain or sequence_plan_of(ev.model_path) is None:
        return None
    h = torch.zeros_like(g)
    shifted = 0
    for mbs in ev.windows[window]:
        for mb in mbs:
            for c in range(cp):
                part = chunk_shifted_labels(mb, c, cp, ev.chunking)
                if part.supervised:
                    shifted += part.supervised
                    model.zero_grad(set_to_none=True)
                    ev.model.loss_sum(model, part).backward()
                    h = h + flat_grad(model).to(g.dtype)
    hh = float(h.dot(h))
    if hh == 0 or float(g.norm()) == 0:
        return None
    scale = float(g.dot(h)) / hh
    gap = float((g - scale * h).norm() / g.norm())
    if gap > explained_residual():
        return None
    n = sum(mb.supervised for mbs in ev.windows[window] for mb in mbs)
    said = f"the gradient is that loss times {scale:.6g} ({gap:.1e} left unexplained)"
    for z, what in ((shifted, f"1/N' = 1/{shifted}, the shifted labels' own count"), (n, f"1/N = 1/{n}")):
        if abs(scale * z - 1) <= 1e-3:
            said = f"each of them weighs {what} ({gap:.1e} left unexplained)"
            break
    return Signature("labels_shifted_per_chunk", f"{SIGNATURES['labels_shifted_per_chunk']}: the gradient is the "
                     f"loss of the {shifted} targets the cp ranks keep after each shifts its chunk's labels one more "
                     f"position, where the window's {n} belong; {said}")


def sharded_sequence_note(ev: Evidence, sig: Signature, window: int | None = None,
                          model: torch.nn.Module | None = None, g: torch.Tensor | None = None) -> Signature:
    """An unexplained reading on a cp mesh whose model shards the sequence itself (its ``cp_plan``): the labels
    shifted again on each cp rank where that explains the gradient (:func:`chunk_shift_reading`, given the window,
    the model at the rank's starting weights and the gradient), else the sentence says the forward over the chunks
    may be the cause."""
    if ev.mesh.size("cp") < 2 or sequence_plan_of(ev.model_path) is None:
        return sig
    if window is not None and model is not None and g is not None:
        shifted = chunk_shift_reading(ev, window, model, g)
        if shifted is not None:
            return shifted
    return dataclasses.replace(sig, sentence=f"{sig.sentence}; this run's model shards the sequence (its cp_plan): "
                              "a gradient no re-weighting gives can come from its forward over the chunks (an "
                              "attention masked for another chunking than the run's, positions not passed), "
                              "which the reference, on whole sequences, does not share, or from labels shifted "
                              "in another way than the batch's: run the same with the other --cp-chunking, or "
                              "compare the sharded logits with the whole ones")


__all__ = ["chunk_shift_reading", "chunk_shifted_labels", "mesh_reading", "per_shard_sequence_reading",
           "sharded_sequence_note", "token_blocks"]
