"""What a user's model allows, found by running it in the parent before any rank starts.

A model the battery has never seen may refuse shapes the battery builds (BatchNorm raises "Expected more than 1 value
per channel when training" on a one-row, one-token microbatch; a learned position table stops at its length), may
hold parameters that get no gradient (DDP then never finishes its reduction), may change buffers in its forward
(BatchNorm's running statistics, a counter a forward reads back), and may carry a backward that is not the gradient
of its forward (a custom ``torch.autograd.Function``). :func:`probe_model` runs the model once in train mode, with
gradients on, on a battery microbatch and on a few small and long shapes, and returns :class:`ModelFacts`: what it
needs of a microbatch (the drawn layouts respect it; a fixed case it cannot run is ``n/a`` with the model's own
error), which parameters get no gradient and why (:mod:`harness.battery.prepare.probe.gradless`), which buffers its
forward changes, and whether its backward agrees with finite differences in float64
(:mod:`harness.battery.prepare.probe.backward_check`; :func:`probe` refuses a model whose backward is wrong).

Nothing here names a recipe: these are properties of the model, reported as such, never as a recipe's mistake.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from harness.battery import scenarios
from harness.battery.prepare.probe import gradless, model_limits
from harness.battery.prepare.probe.backward_check import BackwardCheck, check_backward, dtypes_seen, moves_loss
from harness.battery.prepare.probe.finite_difference import RANK
from harness.battery.spec import ModelSpec
from harness.core.formats import HARNESS, PACKED, hf_forward, to_packed
from harness.core.mesh import Mesh
from harness.core.microbatch import Microbatch

THREADS = 1
"""The intra-op thread count of every battery computation: each rank runs with one thread (the launcher's default),
and so do the parent's reference, the logged-loss truth and the diagnosis, so that no float32 result depends on
where it was computed (a float32-loss model otherwise read differently at W=2 and W=3)."""


@contextlib.contextmanager
def rank_threads() -> Iterator[None]:
    """Run the body with the ranks' intra-op thread count, restoring the caller's after."""
    before = torch.get_num_threads()
    if before == THREADS:
        yield
        return
    torch.set_num_threads(THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class ModelFacts:
    """What :func:`probe_model` found."""

    path: str | None
    batch_format: str
    min_positions: int = 1
    """The fewest ``rows x positions`` a microbatch must hold for the model to run it (2 under BatchNorm)."""
    max_len: int | None = None
    """The longest input (positions per row, the harness format's ``T``) the model runs; None: every length the
    battery draws."""
    unused: tuple[str, ...] = ()
    """Parameters that require grad and received no gradient from a battery microbatch's backward."""
    buffers_changed: tuple[str, ...] = ()
    """Buffers a train-mode forward and backward changed (running statistics, counters)."""
    stateful: bool = False
    """Whether the forward reads what it changed: the same microbatch twice gave two different losses."""
    refused: tuple[str, ...] = ()
    """The shapes the model raised on, with its error: ``"1 row x 1 position: ValueError: ..."``."""
    lower_precision: tuple[str, ...] = ()
    """Floating dtypes below the model's own that its forward computes in (``"torch.float32"`` for a float64 model
    whose norm upcasts to float32), and the first few operations that produced them."""
    gradless: tuple[gradless.Gradless, ...] = ()
    """Each parameter of ``unused`` with the cause it gets no gradient
    (:mod:`harness.battery.prepare.probe.gradless`)."""
    backward: BackwardCheck | None = None
    """The directional finite-difference check of the model's backward
    (:mod:`harness.battery.prepare.probe.backward_check`)."""
    packing: str | None = None
    """Under ``--batch-format packed``, the sentence of a model whose packed forward is not its unpacked one
    (:func:`harness.diagnosis.packing.packing_gap`: its attention crosses the sequences of a packed row); None:
    it keeps them apart, or another batch format."""
    label_loss: str | None = None
    """The note of a forward that takes labels (or targets) and whose own loss cannot take the battery's ignore index
    (:func:`harness.battery.prepare.probe.model_limits.label_loss_note`); None: no such forward, or its loss takes
    -100."""

    @property
    def computes_in(self) -> str | None:
        """The lowest floating dtype the forward computes in when it is below the model's own (None otherwise)."""
        return self.lower_precision[0].split(" ")[0] if self.lower_precision else None

    def notes(self, unused: bool = True) -> tuple[str, ...]:
        """Sentences for the user about their model (empty for a model the battery can take as it is); ``unused=False``
        leaves out the parameters without a gradient (a run says those per window, rank and microbatch)."""
        out = []
        if self.backward is not None and self.backward.wrong:
            out.append(self.backward.failure("the model"))
        elif self.backward is not None and self.backward.note():
            out.append(str(self.backward.note()))
        if self.unused and unused:
            out.extend(gradless.notes(self.gradless))
        if self.buffers_changed:
            which = (f"buffer{'s' if len(self.buffers_changed) > 1 else ''} {_names(self.buffers_changed)}")
            if self.stateful:
                out.append(f"the model's forward changes {which} in train mode and reads them back (the same "
                           "microbatch twice gave two losses): every call computes another function, so the "
                           "single-device reference (one forward per microbatch of every rank, in turn) is another "
                           "computation than the ranks' (one forward per own microbatch); keep state out of the "
                           "forward, or check such a model in eval mode")
            else:
                out.append(f"the model's forward updates {which} in train mode (running statistics) without reading "
                           "them back: gradients are unaffected; DDP broadcasts buffers from rank 0 at each forward "
                           "(broadcast_buffers=True), so the ranks' copies follow rank 0's")
        if self.lower_precision:
            out.append(f"the model computes part of its forward in {self.computes_in} although its weights are "
                       f"{'float64' if self.computes_in == 'torch.float32' else 'of a higher precision'} "
                       f"({'; '.join(self.lower_precision)}): a lane of a higher precision judges it at "
                       f"{self.computes_in}'s tolerances, since the ranks scale the loss by W/N and the reference "
                       "by 1/N, which rounds differently in the lower precision")
        if self.packing is not None:
            out.append(self.packing)
        if self.label_loss is not None:
            out.append(self.label_loss)
        if self.refused:
            out.append("the model refuses some microbatch shapes (" + "; ".join(self.refused) + "): the drawn "
                       "layouts leave them out, and a fixed case holding one is n/a")
        if self.max_len is not None:  # hf and packed rows hold one token more than the harness format's inputs
            limit = self.max_len + (0 if self.batch_format == HARNESS else 1)
            out[-1] += f"; {model_limits.limit_fix(self.batch_format, limit)} to check every case"
        return tuple(out)

    def allows(self, rows: int, positions: int) -> bool:
        """Whether a microbatch of ``rows`` rows of ``positions`` input positions is one the model runs."""
        return rows * positions >= self.min_positions and (self.max_len is None or positions <= self.max_len)


def _names(names: tuple[str, ...], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def small_battery_microbatch() -> Microbatch:
    """Two rows of eight positions of a battery microbatch: a shape every language model takes."""
    mb = scenarios.build("single", 1)[0][0][0]
    return Microbatch(mb.inputs[:2, :8], mb.labels[:2, :8])


def _tokens(rows: int, positions: int, seed: int) -> Microbatch:
    gen = torch.Generator().manual_seed(seed)
    vocab = scenarios.BATTERY_CONFIG.vocab_size
    inputs = torch.randint(1, vocab, (rows, positions), generator=gen)
    labels = torch.randint(1, vocab, (rows, positions), generator=gen)
    return Microbatch(inputs, labels)


def _error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _runs(spec: ModelSpec, model: torch.nn.Module, mb: Microbatch, reached: set[str] | None = None) -> str | None:
    """None when forward and backward of ``mb`` work, else the model's error in one line; ``reached`` gains the
    parameters that got a gradient."""
    model.zero_grad(set_to_none=True)
    try:
        spec.loss_sum(model, mb).backward()
    except Exception as exc:
        return _error(exc)
    if reached is not None:
        reached.update(n for n, p in model.named_parameters() if p.grad is not None)
    return None


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _lower_precision(spec: ModelSpec, model: torch.nn.Module, mb: Microbatch) -> tuple[str, ...]:
    """The floating dtypes below the model's own that its forward produces, with the operations that produced them
    (:func:`harness.battery.prepare.probe.backward_check.dtypes_seen`; gradients on, as everywhere in the probe: a
    reentrant checkpoint warns without them)."""
    own = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    seen = dtypes_seen(lambda: spec.loss_sum(model, mb))
    ordered = sorted((d for d in seen if RANK.get(d, 3) < RANK.get(own, 3)), key=lambda d: RANK.get(d, 3))
    return tuple(f"{d} in {', '.join(seen[d])}" for d in ordered)


@lru_cache(maxsize=16)
def probe_model(spec: ModelSpec) -> ModelFacts:
    """Run ``spec``'s model (train mode, gradients on, the ranks' thread count, the caller's RNG untouched) on a battery
    microbatch and on small and long shapes; ModelError-free: a failure on the battery microbatch itself is the
    caller's to report (:func:`probe` makes it a usage error)."""
    with rank_threads(), torch.random.fork_rng(devices=[]), torch.enable_grad():
        model = spec.build()
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        battery_mb = scenarios.build("single", 1)[0][0][0]
        with gradless.watch(model) as seen:
            if _runs(spec, model, battery_mb) is not None:  # too long for the model, say: what it refuses is below
                battery_mb = small_battery_microbatch()
                seen.clear()
                spec.loss_sum(model, battery_mb).backward()
        unused = tuple(n for n, p in model.named_parameters() if p.requires_grad and p.grad is None)
        reached: set[str] = set()
        changed = tuple(n for n, b in model.named_buffers() if n in buffers and not torch.equal(buffers[n], b))
        stateful = False
        if changed:  # does the forward read what it wrote? The same input twice then gives two outputs
            stateful = not torch.equal(spec.loss_sum(model, battery_mb), spec.loss_sum(model, battery_mb))
        lower = _lower_precision(spec, model, battery_mb)
        refused = []
        min_positions = 1
        for rows, positions in ((1, 1), (1, 2), (2, 1)):
            err = _runs(spec, model, _tokens(rows, positions, seed=rows * 7 + positions), reached)
            if err is not None:
                refused.append(f"{_plural(rows, 'row')} x {_plural(positions, 'position')}: {err}")
                min_positions = max(min_positions, rows * positions + 1)
        longest = scenarios.BATTERY_CONFIG.max_len - 1  # a row of max_len tokens feeds max_len - 1 positions
        max_len = None
        if _runs(spec, model, _tokens(1, longest, seed=11), reached) is not None:
            # The longest the model takes: a position table shorter than the battery's rows.
            lo, hi = 0, longest
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if _runs(spec, model, _tokens(2, mid, seed=mid)) is None:
                    lo = mid
                else:
                    hi = mid
            err = _runs(spec, model, _tokens(1, longest, seed=11))
            refused.append(f"rows of more than {lo} positions: {err}")
            max_len = lo
        causes: tuple[gradless.Gradless, ...] = ()
        if unused:
            params = dict(model.named_parameters())
            owners: dict[str, list[torch.nn.Parameter]] = {}
            for name in unused:
                owners.setdefault(name.rsplit(".", 1)[0] if "." in name else "", []).append(params[name])
            causes = gradless.find_causes(model, unused, seen, reached, moves_loss(spec, model, battery_mb, owners))
        backward = check_backward(spec, battery_mb)
        packing = None
        if spec.batch_format == PACKED:  # a model whose attention crosses a packed row's sequences, said up front
            from harness.diagnosis.packing import packing_gap

            name = f"model={spec.path!r}" if spec.path is not None else "the built-in model"
            with torch.no_grad():
                packing = packing_gap(model, name=name).note()
        label_loss = model_limits.label_loss_note(spec, model, battery_mb)
    return ModelFacts(spec.path, spec.batch_format, min_positions=min_positions, max_len=max_len, unused=unused,
                      buffers_changed=changed, stateful=stateful, refused=tuple(refused),
                      lower_precision=lower, gradless=causes, backward=backward, packing=packing,
                      label_loss=label_loss)


@lru_cache(maxsize=16)
def probe(path: str | None, batch_format: str = HARNESS) -> ModelFacts:
    """Build ``--model`` (None: the built-in model) once and run a battery microbatch through it under
    ``batch_format`` (train mode, gradients on, as the ranks will), so that a factory that cannot be built, an output
    the harness cannot read logits from, or logits of the wrong shape are a usage error before any rank starts
    (:class:`harness.model.ModelError`, naming the path and the fix); then what the model allows
    (:func:`harness.battery.prepare.probe.facts.probe_model`), and a backward that is not the gradient of its forward
    is a :class:`~harness.model.ModelError` naming the model and where it lies. Once per process for each path and
    format (a ModelError is raised again on every call)."""
    from harness.model import ModelError

    spec = ModelSpec(path, batch_format)
    model = spec.build()
    mb = small_battery_microbatch()  # the shapes a model may refuse (one row, long rows) are probe_model's to find
    # Packed batches are judged against the same sequences unpacked: the probe runs the hf call. The model's own
    # error is read by running it again (ids of 1, shorter rows), never by its text alone: docs/your-model.md.
    with rank_threads(), torch.random.fork_rng(devices=[]):
        try:
            wrong = model_limits.check_logits(spec, model, mb)
        except Exception as exc:
            raise ModelError(model_limits.read_failure(spec, model, mb, exc)) from exc
        if wrong is not None:
            raise ModelError(wrong)
        try:
            total = spec.loss_sum(model, mb)
        except Exception as exc:
            msg = f"{model_limits.who(path)}: the loss of its logits on one battery microbatch failed: {exc!r}"
            raise ModelError(msg) from exc
    if total.dim() != 0 or not bool(torch.isfinite(total)):
        msg = f"model={path!r}: the loss sum of one battery microbatch is {total!r}, not a finite scalar"
        raise ModelError(msg)
    if batch_format == PACKED:
        _probe_packed(path, model, mb)
    found = probe_model(spec)
    if found.backward is not None and found.backward.wrong:
        who = f"model={path!r}: the model" if path is not None else "the built-in model"
        raise ModelError(found.backward.failure(who))
    return found


def _probe_packed(path: str | None, model: torch.nn.Module, mb: Microbatch) -> None:
    """ModelError unless ``model`` takes the microbatch's packed rows the way the recipes pass them
    (:func:`harness.core.formats.hf_forward`) and returns logits of their shape."""
    from harness.model import ModelError

    packed = to_packed(mb)
    try:
        with rank_threads(), torch.random.fork_rng(devices=[]), torch.no_grad():
            logits = hf_forward(model, packed)
    except Exception as exc:
        msg = (f"model={path!r}: model(input_ids=..., position_ids=...) on one battery microbatch packed (batch "
               f"format 'packed') failed: {type(exc).__name__}: {exc}. Under --batch-format packed the model must "
               "take position_ids and keep each sequence of a row to itself (docs/your-model.md)")
        raise ModelError(msg) from exc
    rows, width = packed["input_ids"].shape
    if logits.dim() != 3 or tuple(logits.shape[:2]) != (rows, width):
        msg = (f"model={path!r}: packed rows [{rows}, {width}] gave logits {tuple(logits.shape)}; they must be "
               f"[{rows}, {width}, V]")
        raise ModelError(msg)


def probe_meshes(path: str | None, meshes: Sequence[Mesh], batch_format: str = HARNESS,
                 pp_schedule: str = "gpipe") -> None:
    """What ``--model`` (None: the built-in model) must declare to run over ``meshes``, refused before any rank starts
    as :class:`harness.model.ModelError` naming the model and the fix, once for the session rather than in every
    verdict: a mesh with ``tp`` needs its tensor-parallel plan (:func:`harness.distributed.tensor_parallel.plan_of`); a
    mesh with ``pp`` needs a split whose stages hold every parameter once and, applied in order to a battery
    microbatch, give the model's own logits (:func:`harness.distributed.pipeline.check_split`,
    :func:`~harness.distributed.pipeline.check_composes`), cut into pp stages, or pp x 2 under an interleaved
    ``pp_schedule``."""
    from harness.distributed import pipeline
    from harness.distributed.tensor_parallel import plan_of
    from harness.model import ModelError

    if path is not None and any(m.size("tp") > 1 for m in meshes):
        plan_of(path)
    argument = f"model={path!r}" if path is not None else "the built-in model"
    for pp in sorted({m.size("pp") for m in meshes if m.size("pp") > 1}):
        model = ModelSpec(path, batch_format).build()
        n_stages = pp * pipeline.stages_per_rank(pp_schedule)
        try:
            stages = pipeline.split_of(path)(model, n_stages)
            if len(stages) != n_stages:
                msg = f"its pipeline split returned {len(stages)} stages for {n_stages} (pp={pp}, {pp_schedule})"
                raise ValueError(msg)
            with rank_threads(), torch.random.fork_rng(devices=[]):
                pipeline.check_split(model, stages, "its pipeline split")
                pipeline.check_composes(model, stages, small_battery_microbatch().inputs, "its pipeline split")
        except ValueError as exc:
            raise ModelError(f"{argument} over a mesh with pp={pp}: {exc}") from None


__all__ = ["THREADS", "ModelFacts", "probe", "probe_meshes", "probe_model", "rank_threads", "small_battery_microbatch"]
