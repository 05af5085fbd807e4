"""What the probe finds about a user's model before any rank starts (:mod:`harness.battery.prepare.probe.facts`), and
the drawn layouts keeping to it; one process, no ranks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from harness.battery.layouts import Layout, _candidates, fits, layouts
from harness.battery.prepare.probe import facts as f
from harness.battery.spec import ModelSpec
from harness.testing.hypothesis_profiles import load_profile

load_profile()


def _facts(name: str, batch_format: str = "harness") -> f.ModelFacts:
    return f.probe_model(ModelSpec(f"user_recipes.zoo:{name}", batch_format))


def test_batchnorm_needs_two_values_per_channel_and_its_running_statistics_are_not_read_back() -> None:
    """One row of one position is refused with BatchNorm's own error; the running statistics are reported as
    written, not read."""
    found = _facts("BatchNormLM")
    assert 2 == found.min_positions
    assert not found.allows(1, 1) and found.allows(1, 2) and found.allows(2, 1)
    assert any("Expected more than 1 value per channel" in r for r in found.refused)
    assert ("norm.running_mean", "norm.running_var", "norm.num_batches_tracked") == found.buffers_changed
    assert not found.stateful
    assert any("without reading them back" in n for n in found.notes())


def test_a_parameter_no_forward_uses_is_named_before_any_rank_starts() -> None:
    """The value head requires grad and gets no gradient: both its tensors are named, with the cause (its module never
    ran, and the loss does not change along it) and DDP's remedy."""
    found = _facts("UnusedHeadLM")
    assert ("value_head.weight", "value_head.bias") == found.unused
    assert {"never"} == {g.cause for g in found.gradless}
    (note, remedy) = found.notes()
    assert "value_head.weight" in note and "find_unused_parameters=True" in remedy
    assert "no forward reaches them: their module value_head never ran" in note


def test_a_forward_that_reads_the_buffer_it_updates_is_called_stateful() -> None:
    """The same microbatch twice gives two losses: the note says the reference is another computation."""
    found = _facts("CountingLM")
    assert ("calls",) == found.buffers_changed and found.stateful
    assert any("reads them back" in n and "reference" in n for n in found.notes())


def test_a_short_position_table_gives_the_longest_row_the_model_takes() -> None:
    """64 learned positions: rows of up to 64 positions run, longer ones are refused with the model's IndexError."""
    found = _facts("ShortPositionsLM")
    assert 64 == found.max_len
    assert found.allows(4, 64) and not found.allows(1, 65)
    assert any("IndexError" in r for r in found.refused)


def test_the_hf_format_feeds_one_more_position_so_batchnorm_takes_a_one_token_row() -> None:
    """Under hf a one-position harness microbatch is two input positions: BatchNorm has two values per channel."""
    assert 1 == _facts("BatchNormLM", "hf").min_positions


def test_a_model_the_battery_takes_as_it_is_has_no_notes() -> None:
    """The causal convolution model of the user recipes: no unused parameter, no buffer, every shape."""
    found = f.probe_model(ModelSpec("user_recipes.models:make_model"))
    assert () == found.notes() and 1 == found.min_positions and found.max_len is None


def test_the_probe_leaves_the_callers_thread_count_and_random_state_alone() -> None:
    """It computes with the ranks' one thread and restores the caller's count and generators."""
    threads, state = torch.get_num_threads(), torch.get_rng_state()
    f.probe_model.cache_clear()
    _facts("BatchNormLM")
    assert threads == torch.get_num_threads()
    assert torch.equal(state, torch.get_rng_state())


def test_rank_threads_sets_one_thread_inside_and_restores_after() -> None:
    """The reference, the logged-loss truth and the diagnosis run with the ranks' thread count."""
    before = torch.get_num_threads()
    with f.rank_threads():
        assert f.THREADS == torch.get_num_threads()
    assert before == torch.get_num_threads()


BATCHNORM = f.ModelFacts("user_recipes.zoo:BatchNormLM", "harness", min_positions=2, max_len=40)


@settings(max_examples=60, deadline=None)
@given(layout=layouts(facts=BATCHNORM))
def test_drawn_layouts_hold_only_shapes_the_model_runs(layout: Layout) -> None:
    """No drawn microbatch is one row of one position under BatchNorm, or longer than the model takes; shrinking
    keeps to it too."""
    assert fits(layout, BATCHNORM)


def test_fits_rejects_a_one_row_one_position_microbatch_for_batchnorm() -> None:
    """The negative control of the property above: the shape BatchNorm refuses is recognized as such."""
    one_token = ((2, 0),)  # a row of 2 tokens: 1 position
    layout = Layout(2, (((one_token,), (((5, 0), (3, 1)),)),))
    assert not fits(layout, BATCHNORM)
    assert fits(layout, None)
    # Shrinking a fitting layout to one row per microbatch would make that shape: the candidates include it.
    two_rows = Layout(1, (((((2, 0), (2, 0)),),),))
    assert fits(two_rows, BATCHNORM)
    assert not all(fits(c, BATCHNORM) for c in _candidates(two_rows))


def test_the_probe_runs_with_gradients_on_so_reentrant_checkpointing_does_not_warn() -> None:
    """A model checkpointed with use_reentrant=True warns "None of the inputs have requires_grad=True" only when
    run without gradients: the probe runs as the ranks will, so a correct run starts without that false alarm."""
    import warnings

    from harness.battery.prepare.probe.facts import probe

    f.probe_model.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe("user_recipes.models:SharedBlockCheckpointed")
    assert not [w for w in caught if "requires_grad" in str(w.message)]


def _backward(name: str) -> f.ModelFacts:
    return f.probe_model(ModelSpec(f"user_recipes.backward_models:{name}"))


def test_a_custom_attention_whose_backward_drops_a_term_is_refused_naming_the_model_the_module_and_the_function(
) -> None:
    """The softmax Jacobian's second term missing: every direction misses its bound at both steps, the module alone
    misses too, and the message names the model, ``attn`` and the Function."""
    from harness.model import ModelError

    path = "user_recipes.backward_models:wrong_attention"
    with pytest.raises(ModelError) as refused:
        f.probe(path)
    message = str(refused.value)
    assert message.startswith(f"model={path!r}: the model's backward is not the gradient of its forward")
    assert "module attn (FusedAttention)" in message and "_AttentionFn" in message
    assert "parity would pass a wrong gradient" in message


def test_the_same_attention_with_its_right_backward_passes_the_check() -> None:
    """The control: the same custom Function, with the Jacobian's second term, agrees in every direction."""
    found = _backward("right_attention")
    assert found.backward is not None and not found.backward.disagrees
    assert ("user_recipes.backward_models._AttentionFn",) == found.backward.functions
    assert all(d.agrees for d in found.backward.directions) and 3 == len(found.backward.directions)


def test_a_wrong_backward_called_between_submodules_is_named_as_the_models_own_forward() -> None:
    """Logit soft-capping whose backward forgets tanh's derivative, applied in the model's forward: every leaf
    agrees alone, the model's own forward does not."""
    found = _backward("SoftcapLM")
    assert found.backward is not None and found.backward.wrong
    assert [""] == [m.name for m in found.backward.modules]
    assert "SoftcapLM.forward itself, between its submodules" in found.backward.failure("the model")


@pytest.mark.parametrize("path", [None, "user_recipes.backward_models:NormWithUnusedHead",
                                  "user_recipes.backward_models:ReluLM", "user_recipes.zoo:BatchNormLM",
                                  "user_recipes.zoo:CountingLM", "user_recipes.zoo:Float32InsideLM",
                                  "user_recipes.backward_models:FrozenEmbeddingCheckpointed"],
                         ids=lambda p: "builtin" if p is None else p.split(":")[1])
@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # the checkpointed model's own, true
def test_a_right_backward_agrees_with_the_finite_difference_in_every_direction(path: str | None) -> None:
    """The built-in model, a LayerNorm with an unused head, ReLUs, BatchNorm, a forward that reads a buffer it
    updates, a float32 region in a float64 model, a reentrant checkpoint: each direction within its bound."""
    found = f.probe(path)
    assert found.backward is not None and not found.backward.disagrees
    assert all(d.agrees for d in found.backward.directions)


def test_the_bound_is_the_measured_truncation_plus_six_sigma_of_rounding_at_e_the_cube_root_of_eps() -> None:
    """On the built-in model in float64: e = eps^(1/3); the rounding term is at least 6 eps |L| / (sqrt(2) e); the
    bound is the sum of its parts; and the wrong attention misses it by more than a thousandfold (the margin)."""
    import math

    from harness.battery.prepare.probe.backward_check import Z

    check = f.probe(None).backward
    assert check is not None and "torch.float64" == check.dtype
    eps = float(torch.finfo(torch.float64).eps)
    for d in check.directions:
        assert eps ** (1 / 3) == pytest.approx(d.step)
        assert d.bound == d.truncation + d.rounding + d.dot
        assert d.rounding >= Z * eps * 1000 / (math.sqrt(2) * d.step)  # the built-in model's |L| is over 1000
    wrong = _backward("wrong_attention").backward
    assert wrong is not None and min(d.miss / d.bound for d in wrong.directions) > 1e3


def test_a_model_that_cannot_run_in_float64_is_checked_in_its_own_dtype_and_says_so() -> None:
    """A float32 table kept as a plain attribute breaks the float64 copy's matmul: checked in float32, with a note
    naming the error."""
    found = _backward("Float32OnlyLM")
    assert found.backward is not None and "torch.float32" == found.backward.dtype
    assert not found.backward.disagrees
    (note,) = found.notes()
    assert "checked in torch.float32, not float64" in note and "expected m1 and m2 to have the same dtype" in note


def test_a_detached_branch_is_a_stop_gradient_noted_not_a_wrong_backward() -> None:
    """The backward disagrees with the forward (a .detach() in the model's forward), and no custom Function lies
    there: a note, not a refusal; the gate's own parameters are named as used but cut off."""
    found = _backward("DetachedBranchLM")
    assert found.backward is not None and found.backward.disagrees and not found.backward.wrong
    assert {"dropped"} == {g.cause for g in found.gradless}
    assert any("no custom autograd.Function lies there" in n for n in found.notes())
    f.probe("user_recipes.backward_models:DetachedBranchLM")  # not refused


def test_an_expert_no_token_was_routed_to_is_named_a_branch_the_data_decides() -> None:
    """Rows of at most 100 tokens never reach ``experts.1``, which is skipped while ``experts.0`` runs: the cause is a
    routed branch; the control, a head no forward calls, reads "never" in the same model."""
    from user_recipes.zoo import RoutedLM

    from harness.battery.prepare.probe import gradless
    from harness.battery.prepare.probe.backward_check import moves_loss

    with torch.random.fork_rng(devices=[]):  # the global generator is the suite's: leave it as found
        model = RoutedLM()
        model.value_head = torch.nn.Linear(16, 1)
    spec = ModelSpec("user_recipes.zoo:RoutedLM")
    mb = f.small_battery_microbatch()
    with gradless.watch(model) as seen:
        spec.loss_sum(model, mb).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    params = dict(model.named_parameters())
    groups = {m: [params[f"{m}.weight"], params[f"{m}.bias"]] for m in ("experts.1", "value_head")}
    causes = {g.name: g for g in gradless.find_causes(model, missing, seen, set(), moves_loss(spec, model, mb, groups))}
    assert ("routed", "experts.0") == (causes["experts.1.weight"].cause, causes["experts.1.weight"].where)
    assert "never" == causes["value_head.weight"].cause
    (routed, never, _) = gradless.notes(tuple(causes.values()))
    assert "an expert no token was routed to" in routed and "while experts.0 ran" in routed
    assert "no forward reaches them" in never
