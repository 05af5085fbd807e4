"""The mesh family: the readings of a run over a device mesh of more than one dimension.

A count reduced over the wrong group of the mesh weighs the blocks of one group alike
(:mod:`harness.diagnosis.count_groups` reads which group off the fitted weights); a common scale that is one mesh size
over another is named by those sizes; on a mesh with cp each cp rank's chunk of a microbatch is a block of its own
(:func:`token_blocks`); a model that shards the sequence itself is named where nothing else explains the gradient
(:func:`sharded_sequence_note`).
"""

from __future__ import annotations

import dataclasses

from harness.core.mesh import Mesh
from harness.core.microbatch import Microbatch
from harness.data.context_parallel import supervise_chunk
from harness.diagnosis.count_groups import count_group, mesh_factor
from harness.diagnosis.evidence import Evidence
from harness.diagnosis.fit import Block, Fit, explained_residual
from harness.diagnosis.signatures import Signature
from harness.distributed.sequence_sharding import plan_of as sequence_plan_of


def token_blocks(ev: Evidence, window: int) -> list[tuple[Block, Microbatch]]:
    """The fit's blocks of ``window`` and the microbatch each stands for: every microbatch of every data rank, and on
    a mesh with cp, each cp rank's chunk of it apart (a count reduced over the wrong group weighs the chunks of one
    microbatch apart). A block's ``rank`` is its token rank (:meth:`harness.core.mesh.Mesh.token_rank`)."""
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
                out.append((Block(t, m, part.supervised, rows=mb.inputs.shape[0], holder=holder), part))
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


__all__ = ["mesh_reading", "sharded_sequence_note", "token_blocks"]
