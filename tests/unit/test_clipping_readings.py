"""The clipping readings (:mod:`harness.diagnosis.clipping`) on a run assembled by hand from the battery's
own reference chain: a norm is named only by the candidate its number fits, a norm too large is never called too
small, and a gradient is read as unclipped only when it is the unclipped reference."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from harness.battery import scenarios
from harness.battery.diagnose.of_run import evidence_of
from harness.battery.launch.run import WindowRecord
from harness.battery.plan.options import RunSpec
from harness.battery.prepare.steps import Prepared, prepare
from harness.diagnosis.clipping import clip_factor, gradient_reading, read_norm
from harness.diagnosis.evidence import Evidence

CLIPPED = "harness.recipes:clipped_global_token_mean"


@pytest.fixture(scope="module")
def prepared() -> Prepared:
    """The uneven case at W=2 of the correct clipping recipe, references only (no rank starts)."""
    return prepare(RunSpec(CLIPPED, "uneven", 2, "fp32"), scenarios.build("uneven", 2), share_chain=True)


def _run(ready: Prepared, grad: torch.Tensor, norm: float) -> Evidence:
    """The evidence of a run whose every rank left ``grad`` and returned ``norm`` in window 0."""
    start = ready.chain.starts[0]
    rec = WindowRecord(grad=grad, params_before=start, params_after=start, syncs=1, logged=None, error=None,
                              mode_changed=False, grad_dtypes=(), grad_norm=norm)
    return evidence_of(ready.run([[rec] for _ in range(2)]))


def test_a_norm_sqrt_w_too_large_is_named_so_and_never_too_small(prepared: Prepared) -> None:
    ref = prepared.chain.references[0]
    assert ref is not None and prepared.chain.norms[0] is not None
    want = prepared.chain.norms[0]
    reading = read_norm(_run(prepared, ref.gradient, math.sqrt(2) * want), 0, 0, math.sqrt(2) * want)
    assert "norm_reduced_again" == reading.name and abs(reading.ratio - math.sqrt(2)) < 1e-9
    assert "too small" not in reading.sentence


def test_a_norm_that_fits_no_candidate_is_called_too_large_or_too_small_by_its_ratio(
        prepared: Prepared) -> None:
    """The control: 2.9x and 0.77x the reference's norm fit no candidate; each is named by its direction only."""
    ref = prepared.chain.references[0]
    assert ref is not None and prepared.chain.norms[0] is not None
    want = prepared.chain.norms[0]
    large = read_norm(_run(prepared, ref.gradient, 2.9 * want), 0, 0, 2.9 * want)
    small = read_norm(_run(prepared, ref.gradient, 0.77 * want), 0, 0, 0.77 * want)
    assert (None, None) == (large.name, small.name)
    assert large.sentence.startswith("too large") and small.sentence.startswith("too small")


def test_the_unclipped_reference_reads_clipping_not_applied_and_the_clipped_one_nothing(
        prepared: Prepared) -> None:
    """The gradient reading fits the unclipped reference only; the right (clipped) gradient is left to the catalog."""
    ref = prepared.chain.references[0]
    assert ref is not None and prepared.chain.norms[0] is not None
    want = prepared.chain.norms[0]
    run = _run(prepared, ref.gradient / clip_factor(_run(prepared, ref.gradient, want), 0), want)
    sig = gradient_reading(run, 0, 1)
    assert sig is not None and "clipping_not_applied" == sig.name
    assert gradient_reading(_run(prepared, ref.gradient, want), 0, 1) is None


def _per_tensor_case(ready: Prepared) -> tuple[Evidence, torch.Tensor, torch.Tensor]:
    """The uneven window's unclipped gradient U with a max_norm under its largest tensor's own norm (the built-in
    model's tensors all sit under the harness's max_norm at the battery's starting weights): the run whose reference
    is U clipped as clip_grad_norm_ does, and U with each tensor over max_norm clipped alone."""
    run = _run(ready, ready.chain.references[0].gradient, 1.0)  # type: ignore[union-attr]
    unclipped = run.references[0].gradient.double() / clip_factor(run, 0)  # type: ignore[union-attr]
    sizes = [p.numel() for p in run.model.build().parameters()]
    tensors = list(torch.split(unclipped, sizes))
    max_norm = 0.9 * max(float(t.norm()) for t in tensors)
    f = max_norm / (float(unclipped.norm()) + 1e-6)
    ref = dataclasses.replace(run.references[0], gradient=(unclipped * f).to(torch.float32))  # type: ignore[type-var]
    run = dataclasses.replace(run, max_norm=max_norm, references=[ref, *run.references[1:]])
    alone = torch.cat([t * min(1.0, max_norm / (float(t.norm()) + 1e-6)) for t in tensors]).to(torch.float32)
    return run, alone, ref.gradient


def test_tensors_clipped_alone_past_max_norm_read_clipped_per_tensor(prepared: Prepared) -> None:
    """A gradient whose tensors over max_norm were each scaled alone reads ``clipped_per_tensor``; its control, the
    gradient clipped over every parameter together, gets no clipping reading."""
    run, alone, right = _per_tensor_case(prepared)
    assert run.records is not None
    for rank in run.records:
        rank[0] = dataclasses.replace(rank[0], grad=alone)  # type: ignore[index]
    found = gradient_reading(run, 0, 0)
    assert found is not None and "clipped_per_tensor" == found.name, found
    for rank in run.records:
        rank[0] = dataclasses.replace(rank[0], grad=right)  # type: ignore[index]
    assert gradient_reading(run, 0, 0) is None
