"""Which group of a device mesh a wrong count was reduced over, read off the fitted weights (``count_group``).

On a mesh the count a recipe divides by must be all-reduced over the token group: the dimensions whose ranks hold
distinct supervised tokens (dp x cp, :attr:`harness.core.mesh.Mesh.token_dims`). A count reduced over another group
``S`` of the mesh's dimensions gives each token rank ``t`` the count ``N_S(t)``, the sum of the tokens held by the ranks
of its ``S`` group (a tp or pp rank holds its coordinate's tokens again), so its tokens weigh ``N / N_S(t)`` times the
right weight, up to one common factor ``c`` (the loss's own factor: the token group's size ``T`` gives ``c = 1``,
another size ``F`` gives ``F / T``). :func:`count_group` tries every group of the mesh's dimensions against the ratios
``q`` of a microbatch-level fit whose blocks are the token ranks' (:class:`harness.diagnosis.fit.Block` with ``rank``
the token rank) and names the first that explains them; :func:`mesh_factor` names a common scale that is one mesh size
over another (the world size where the token group's size belongs).

Pure Python on the fit's numbers: ``tests/unit/test_count_groups.py`` reads each group from counts built by hand.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from harness.core.mesh import Mesh
from harness.diagnosis.fit import Block, match_tolerance
from harness.diagnosis.signatures import Signature, scale_fit


def dims_words(mesh: Mesh, dims: Sequence[str]) -> str:
    """``"dp x cp"`` (the mesh's order); ``"no dimension"`` for none."""
    names = [n for n in mesh.names if n in dims]
    return " x ".join(names) if names else "no dimension"


def counts_over(mesh: Mesh, per_token_rank: dict[int, int], dims: Sequence[str]) -> dict[int, int]:
    """Each token rank's count all-reduced over ``dims``: the tokens held by every rank of its group (a tp or pp rank
    holds its coordinate's tokens, so a group across tp counts them once per tp rank)."""
    out = {}
    for t in per_token_rank:
        members = mesh.group(mesh.holder(t), dims)
        out[t] = sum(per_token_rank.get(mesh.token_rank(r), 0) for r in members)
    return out


def _groups(mesh: Mesh) -> list[tuple[str, ...]]:
    """Every group of the mesh's dimensions but the token group itself (the right one), fewest dimensions first."""
    right = set(mesh.token_dims)
    out = []
    for size in range(len(mesh.names) + 1):
        for dims in itertools.combinations(mesh.names, size):
            if set(dims) != right:
                out.append(dims)
    return out


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= match_tolerance() * max(abs(b), 1e-300)


def mesh_factor(c: float, mesh: Mesh) -> str | None:
    """Words for a common scale ``c`` that is one size of the mesh over the token group's size ``T`` (the loss scaled
    by the world size, or by dp's alone, where ``T`` belongs), every group of that size named; None when none is."""
    t = mesh.token_ranks
    if _close(c, 1.0) or len(mesh.names) < 2:
        return None
    right = f"the token group's size ({dims_words(mesh, mesh.token_dims)}: {t})"
    if _close(c, 1 / t):
        return f"the loss was not scaled by {right}"
    for f in sorted({math.prod(mesh.size(d) for d in dims) for size in range(1, len(mesh.names) + 1)
                     for dims in itertools.combinations(mesh.names, size)}):
        if f == t or not _close(c, f / t):
            continue
        if f == mesh.world_size:
            what = "the world size"
        else:
            groups = [dims for size in range(1, len(mesh.names)) for dims in itertools.combinations(mesh.names, size)
                      if math.prod(mesh.size(d) for d in dims) == f and all(mesh.size(d) > 1 for d in dims)]
            what = " or ".join(f"{dims_words(mesh, dims)}'s size" for dims in groups)
        return f"the loss was scaled by {what} ({f}) where {right} belongs"
    return None


def count_group(blocks: Sequence[Block], q: Sequence[float], mesh: Mesh) -> Signature | None:
    """``count_group``: the ratios ``q`` (one per block, ``w * N``) are ``c * N / N_S(t)`` for a group ``S`` of the
    mesh's dimensions other than the token group. A group whose counts differ between token ranks is evidenced by the
    pattern itself and is read first; groups whose counts are one value read as a common scale, named only where it
    is exactly that value (``c = 1``), every such group listed. None: no group explains the weights."""
    if len(mesh.names) < 2:
        return None
    per: dict[int, int] = {}
    for b in blocks:
        per[b.rank] = per.get(b.rank, 0) + b.tokens
    n = sum(per.values())
    if n == 0:
        return None
    live = [(b, v) for b, v in zip(blocks, q) if b.tokens > 0 and math.isfinite(v)]
    if not live:
        return None
    shaped: list[tuple[tuple[str, ...], float, dict[int, int]]] = []
    flat: list[tuple[tuple[str, ...], float, dict[int, int]]] = []
    for dims in _groups(mesh):
        over = counts_over(mesh, per, dims)
        p = [n / over[b.rank] if over[b.rank] else math.nan for b, _ in live]
        c, dev = scale_fit([v for _, v in live], p)
        if dev > match_tolerance() or not math.isfinite(c):
            continue
        distinct = {over[b.rank] for b, _ in live}
        (shaped if len(distinct) > 1 else flat).append((dims, c, over))
    if shaped:
        # A group of the mesh first, each rank's own count last: where an empty coordinate makes a group's count one
        # rank's, both read alike, and every group these counts cannot tell apart is named.
        shaped.sort(key=lambda t: (not _close(t[1], 1.0), not t[0]))
        dims, c, over = shaped[0]
        alike = [d for d, oc, o in shaped if _close(oc, c) and all(o[b.rank] == over[b.rank] for b, _ in live)]
        return Signature("count_group", _sentence(mesh, dims, c, over, n, live, alike), c)
    exact = [t for t in flat if _close(t[1], 1.0)]
    if exact:
        dims, c, over = exact[0]
        return Signature("count_group", _sentence(mesh, dims, c, over, n, live, [d for d, _, _ in exact]), c)
    return None


def _sentence(mesh: Mesh, dims: tuple[str, ...], c: float, over: dict[int, int], n: int,
              live: Sequence[tuple[Block, float]], alike: Sequence[tuple[str, ...]]) -> str:
    right = dims_words(mesh, mesh.token_dims)
    named = " or ".join(f"{dims_words(mesh, d)} ({math.prod(mesh.size(x) for x in d)} rank"
                        f"{'s' if math.prod(mesh.size(x) for x in d) > 1 else ''})" if d else
                        "no group at all (each rank's own count: these counts cannot tell the two apart)"
                        for d in alike)
    local_means = not dims and _close(c, 1 / mesh.token_ranks)
    shard = " (its cp shard's)" if mesh.size("cp") > 1 else ""
    if local_means:
        head = (f"each rank divided its loss sum by its own count{shard}, never reduced, and the gradients' "
                f"average over {dims_words(mesh, mesh.token_dims)} made a mean of the "
                f"{'shards' if shard else 'ranks'}' local means")
    else:
        head = (f"the count was not all-reduced: each rank divided by its own count{shard}" if not dims
                else f"the count was reduced over {named}")
    spread = f"; this window's tokens are spread over {right} ({mesh.token_ranks} ranks)"
    extra = [d for d in dims if d not in mesh.token_dims]
    if extra:
        spread += (f", and the ranks of {dims_words(mesh, extra)} hold the same tokens, so the count holds each "
                   f"{math.prod(mesh.size(d) for d in extra)} times")
    held = sorted({b.rank for b, _ in live})
    ratios = {t: c * n / over[t] for t in held}
    if len({round(v, 9) for v in ratios.values()}) == 1:
        body = f": every weight is {ratios[held[0]]:.2f}x"
    else:
        by_group: dict[tuple[int, ...], list[int]] = {}
        for t in held:
            members = tuple(sorted({mesh.token_rank(r) for r in mesh.group(mesh.holder(t), dims)}))
            by_group.setdefault(members, []).append(t)
        whose = "its own count" if not dims else "their group's count"
        shown = [f"the tokens of {_ranks(mesh, ts)} ({whose} {over[ts[0]]} of N={n}) weigh "
                 f"{ratios[ts[0]]:.3g}x" for ts in list(by_group.values())[:4]]
        body = ": " + "; ".join(shown) + ("; ..." if len(by_group) > 4 else "")
    scale = ("" if _close(c, 1.0) or local_means else
             f"; besides, a common factor {c:.3g}x ({mesh_factor(c, mesh) or 'unnamed'})")
    return head + spread + body + scale


def _ranks(mesh: Mesh, token_ranks: Sequence[int]) -> str:
    """``"ranks 0 and 2 (cp 0)"``: the ranks holding ``token_ranks``' tokens, with the coordinates they share."""
    ranks = [mesh.holder(t) for t in token_ranks]
    coords = [mesh.coords(r) for r in ranks]
    shared = [f"{k} {v}" for k, v in coords[0].items()
              if mesh.size(k) > 1 and all(c[k] == v for c in coords) and k in mesh.token_dims]
    names = ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    return f"rank{'s' if len(ranks) > 1 else ''} {names}" + (f" ({', '.join(shared)})" if shared else "")


__all__ = ["count_group", "counts_over", "dims_words", "mesh_factor"]
