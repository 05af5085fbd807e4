"""A run's layout (:class:`harness.core.mesh.Mesh`) as torch's ``DeviceMesh`` on the ranks, and the process group a
reduction over some of its dimensions spans.

Called on every rank after the process group is up. ``DeviceMesh`` numbers ranks as :mod:`harness.core.mesh` does
(``tests/distributed/test_device_mesh.py`` compares the groups torch builds with the ones the parent computes). Several
dimensions reduce over one flattened group (``DeviceMesh._flatten``, the way torchtitan builds ``dp_shard_cp``); the
flattened mesh is kept on the :class:`RankMesh`, since slicing a flattened dimension back out of the root mesh is
deprecated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from harness.core.mesh import Mesh

_FLAT: dict[int, tuple[Any, dict[tuple[str, ...], Any]]] = {}
"""Flattened meshes by the id of the root mesh they came from (the root kept alive beside them, so the id stays its
own): flattening the same dimensions again would create a new process group, a collective, in every window."""


def flattened(device_mesh: Any, dims: Sequence[str]) -> Any:
    """The ``DeviceMesh`` over ``dims`` of ``device_mesh`` (names it has, in its order): the dimension itself when one,
    else the dimensions flattened into one named by joining them with ``_``, as torchtitan names ``dp_shard_cp``; made
    once per root mesh and set of dimensions."""
    names = tuple(n for n in device_mesh.mesh_dim_names if n in dims)
    unknown = [d for d in dims if d not in device_mesh.mesh_dim_names]
    if unknown or not names:
        msg = f"dims={tuple(dims)!r} must name dimensions of the mesh {tuple(device_mesh.mesh_dim_names)}"
        raise ValueError(msg)
    if len(names) == 1:
        return device_mesh[names[0]]
    root, flat = _FLAT.setdefault(id(device_mesh), (device_mesh, {}))
    if names not in flat:
        flat[names] = root[names]._flatten("_".join(names))
    return flat[names]


class RankMesh:
    """One rank's view of the run's mesh: the ``DeviceMesh`` and the groups of its dimensions."""

    def __init__(self, mesh: Mesh, device_type: str) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        if dist.get_world_size() != mesh.world_size:
            msg = (f"mesh {mesh.label} has {mesh.world_size} ranks but the process group has "
                   f"{dist.get_world_size()}")
            raise ValueError(msg)
        self.mesh = mesh
        self.device_mesh = init_device_mesh(device_type, mesh.shape, mesh_dim_names=mesh.names)
        self._replicate_shard: Any = None

    def submesh(self, dims: Sequence[str]) -> Any:
        """The ``DeviceMesh`` over ``dims`` (in mesh order; several: flattened into one dimension named by joining
        them with ``_``, as torchtitan names ``dp_shard_cp``)."""
        return flattened(self.device_mesh, dims)

    def replicate_shard(self) -> Any:
        """HSDP's 2-D ``DeviceMesh``: ``dp_replicate`` by the other token dimensions (``dp_shard`` and ``cp``)
        flattened into one, torchtitan's ``dp_shard_cp``; FSDP2 over it shards over the second dimension and
        all-reduces the shards' gradients over the first. Built once (by unflattening the token dimensions: slicing a
        flattened dimension back out of the root mesh is deprecated). ValueError on a mesh without ``dp_replicate``
        or without a dimension to shard over."""
        if self._replicate_shard is None:
            token = self.mesh.token_dims
            shard = tuple(d for d in token if d != "dp_replicate")
            if "dp_replicate" not in token or not shard:
                msg = (f"mesh {self.mesh.label} has no replicate x shard layout: HSDP needs dp_replicate and one of "
                       "dp_shard or cp")
                raise ValueError(msg)
            if len(shard) == 1:
                self._replicate_shard = self.device_mesh["dp_replicate", shard[0]]
            else:
                sizes = (self.mesh.size("dp_replicate"), math.prod(self.mesh.size(d) for d in shard))
                self._replicate_shard = self.submesh(token)._unflatten(0, sizes, ("dp_replicate", "_".join(shard)))
        return self._replicate_shard

    def group(self, dims: Sequence[str]) -> dist.ProcessGroup:
        """The process group a reduction over ``dims`` spans from this rank."""
        return self.submesh(dims).get_group()

    def ranks(self, dims: Sequence[str]) -> tuple[int, ...]:
        """The global ranks of :meth:`group`, sorted."""
        return tuple(sorted(dist.get_process_group_ranks(self.group(dims))))
