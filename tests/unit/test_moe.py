"""The built-in mixture-of-experts model (``harness.moe``): top-k routing, its router outputs, the load-balancing term
computed from them, and the declaration of which parameters are experts and which the router."""

from __future__ import annotations

import pytest
import torch

import harness.moe as moe_module
from harness.battery import scenarios
from harness.core.loss import loss_sum
from harness.core.microbatch import IGNORE_INDEX
from harness.model import build_model
from harness.moe import (
    MoECausalLM,
    MoELayer,
    MoePlan,
    RouterOutput,
    expert_parameters,
    load_balancing_loss,
    moe,
    plan_of,
    router_outputs,
    router_parameters,
)


def _model(seed: int = 1234) -> MoECausalLM:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return moe()


def _inputs(b: int, t: int, seed: int = 0) -> torch.Tensor:
    vocab = scenarios.BATTERY_CONFIG.vocab_size
    return torch.randint(1, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def _reference_moe(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, weighted by the renormalized top-k probabilities (0 for an expert not chosen):
    the dense form of what the layer computes sparsely."""
    flat = x.reshape(-1, x.shape[-1])
    probs = layer.router(flat).softmax(dim=-1)
    top, chosen = probs.topk(layer.top_k, dim=-1)
    weights = torch.zeros_like(probs).scatter(1, chosen, top / top.sum(dim=-1, keepdim=True))
    dense = torch.stack([expert(flat) for expert in layer.experts], dim=1)  # [tokens, E, d]
    out = (weights.unsqueeze(2) * dense).sum(dim=1)
    if layer.shared is not None:
        out = out + layer.shared(flat)
    return out.view_as(x)


# --- the model -------------------------------------------------------------------------------------------------------


def test_the_moe_model_at_the_battery_size_has_the_parameter_count_its_docstring_gives() -> None:
    """31,680 parameters (harness/moe.py's docstring): the built-in model's attention, 4 experts and a shared expert
    of width 64, and a bias-free router."""
    assert 31_680 == sum(p.numel() for p in _model().parameters())


def test_the_moe_model_gives_logits_of_the_builtin_models_shape_and_dtype() -> None:
    """``model(inputs)`` is ``[B, T, V]`` in the parameters' dtype, float32 and float64 alike."""
    model = _model()
    inputs = _inputs(3, 7)
    assert (3, 7, scenarios.BATTERY_CONFIG.vocab_size) == tuple(model(inputs).shape)
    assert torch.float32 == model(inputs).dtype
    assert torch.float64 == model.double()(inputs).dtype


def test_each_token_is_the_renormalized_weighted_sum_of_its_top_k_experts_plus_the_shared_one() -> None:
    """The sparse dispatch equals the dense computation with zero weight on the experts not chosen."""
    layer = _model().blocks[0].mlp
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3))
    # Same products, summed in another order (per expert, then added back): float32 rounding only.
    torch.testing.assert_close(_reference_moe(layer, x), layer(x), atol=1e-6, rtol=1e-5)


def test_the_router_chooses_the_k_most_probable_experts() -> None:
    """``chosen`` holds, per token, the indices of its two largest router probabilities, most probable first."""
    model = _model()
    model(_inputs(2, 9))
    out = model.router_outputs()[0]
    assert torch.equal(out.probs.argsort(dim=-1, descending=True)[:, :2], out.chosen)


def test_the_moe_model_is_a_fixed_function_of_its_inputs() -> None:
    """The same inputs twice give bitwise-equal logits (no state, no noise), and two builds from one seed the same
    weights."""
    model = _model()
    inputs = _inputs(2, 11)
    assert torch.equal(model(inputs), model(inputs))
    a, b = _model().state_dict(), _model().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_tokens_output_does_not_depend_on_the_rows_batched_with_it() -> None:
    """No capacity limit: a row forwarded alone gives the logits it gets beside other rows (padding included)."""
    model = _model()
    inputs = _inputs(3, 10)
    together = model(inputs)
    # A matrix product over more rows may block its sums differently: float32 rounding only.
    torch.testing.assert_close(together[1:2], model(inputs[1:2]), atol=1e-6, rtol=1e-5)


def test_every_parameter_gets_a_gradient_on_a_battery_microbatch() -> None:
    """Top-2 of 4 experts over a battery microbatch's tokens reaches every expert: no parameter lacks a gradient."""
    model = _model()
    mb = scenarios.build("single", 1)[0][0][0]
    loss_sum(model(mb.inputs), mb.labels).backward()
    assert [] == [n for n, p in model.named_parameters() if p.grad is None]


def test_an_expert_no_token_chose_gets_no_gradient() -> None:
    """The negative control of the one above: one token reaches two experts only, so two experts get no gradient,
    as DDP's find_unused_parameters must then know."""
    model = _model()
    loss_sum(model(_inputs(1, 1)), torch.tensor([[3]])).backward()
    gradless = [n for n, p in model.named_parameters() if p.grad is None]
    assert all(".mlp.experts." in n for n in gradless)
    assert 2 == len({n.split(".")[4] for n in gradless})  # blocks.0.mlp.experts.<e>.<layer>.<weight|bias>


def test_building_the_moe_model_leaves_the_global_rng_as_it_was() -> None:
    """The factory reads the caller's seed and draws its weights from a private generator."""
    before = torch.get_rng_state()
    moe()
    after = torch.get_rng_state()
    torch.set_rng_state(before)
    assert torch.equal(before, after)


def test_an_invalid_top_k_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"top_k=5 must be between 1 and experts=4"):
        MoELayer(8, experts=4, top_k=5)


# --- the router outputs ----------------------------------------------------------------------------------------------


def test_router_outputs_hold_every_tokens_probabilities_with_autograd_and_its_top_k() -> None:
    """One output per MoE layer: probs ``[B*T, E]`` summing to 1, attached to the graph; chosen int64 ``[B*T, k]``."""
    model = _model()
    model(_inputs(2, 6))
    (out,) = model.router_outputs()
    assert "blocks.0.mlp" == out.layer
    assert (12, 4) == tuple(out.probs.shape) and (12, 2) == tuple(out.chosen.shape)
    assert out.probs.requires_grad and torch.int64 == out.chosen.dtype
    torch.testing.assert_close(torch.ones(12), out.probs.sum(dim=-1))


def test_router_outputs_are_replaced_at_every_forward() -> None:
    """A second forward's outputs are its own: the shapes follow the new inputs."""
    model = _model()
    model(_inputs(2, 6))
    model(_inputs(1, 3))
    assert [(3, 4)] == [tuple(o.probs.shape) for o in model.router_outputs()]


def test_router_outputs_before_any_forward_are_refused() -> None:
    with pytest.raises(RuntimeError, match=r"before a forward of this model: call model\(inputs\) first"):
        _model().router_outputs()


def test_router_outputs_of_a_model_without_routers_are_refused_naming_its_type() -> None:
    with pytest.raises(TypeError, match=r"needs a MoECausalLM .* got TinyCausalLM"):
        router_outputs(build_model(scenarios.BATTERY_CONFIG))


def test_a_model_copy_leaves_the_last_forwards_router_outputs_behind() -> None:
    """deepcopy (the battery copies built models) works after a forward: the decisions hold a graph and stay out."""
    import copy

    model = _model()
    model(_inputs(1, 4))
    assert copy.deepcopy(model).blocks[0].mlp.routed is None


def test_a_router_output_of_the_wrong_shape_is_refused() -> None:
    """probs must be ``[tokens, E]``, chosen int64 ``[tokens, k]`` for the same tokens, ``k <= E``."""
    probs = torch.full((3, 4), 0.25)
    with pytest.raises(ValueError, match=r"probs \(3, 4\) must be \[tokens, E\] and chosen \(2, 2\)"):
        RouterOutput("blocks.0.mlp", probs, torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"1 <= k <= E=4"):
        RouterOutput("blocks.0.mlp", probs, torch.zeros(3, 5, dtype=torch.int64))


# --- the load-balancing term -----------------------------------------------------------------------------------------


def _two_tokens() -> RouterOutput:
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.4, 0.1, 0.4, 0.1]], requires_grad=True)
    return RouterOutput("blocks.0.mlp", probs, torch.tensor([[0, 1], [0, 2]]))


def test_the_load_balancing_term_is_switchs_e_times_sum_of_f_times_p() -> None:
    """By hand: f = (2, 1, 1, 0) / 4 assignments, P = (0.45, 0.2, 0.25, 0.1);
    4 * (0.5*0.45 + 0.25*0.2 + 0.25*0.25 + 0) = 4 * 0.3375 = 1.35."""
    torch.testing.assert_close(torch.tensor(1.35), load_balancing_loss([_two_tokens()]))


def test_the_load_balancing_term_is_one_under_uniform_routing_and_its_gradient_reaches_the_probabilities() -> None:
    """Uniform probabilities and assignments give 1; d/dP_e = E * f_e."""
    uniform = torch.full((2, 4), 0.25, requires_grad=True)
    out = RouterOutput("l", uniform, torch.tensor([[0, 1], [2, 3]]))
    value = load_balancing_loss([out])
    value.backward()
    torch.testing.assert_close(torch.tensor(1.0), value)
    # d/dprobs[t, e] = E * f_e / tokens = 4 * 0.25 / 2
    torch.testing.assert_close(torch.full((2, 4), 0.5), uniform.grad)


def test_the_mask_keeps_only_the_supervised_tokens_and_layers_are_averaged() -> None:
    """With the second token masked out: f = (1, 1, 0, 0) / 2, P = (0.5, 0.3, 0.1, 0.1), 4 * 0.4 = 1.6; the mean over
    two layers of 1.6 and 1.6 is 1.6, and a mask with no token left gives 0."""
    out = _two_tokens()
    mask = torch.tensor([[True, False]])
    torch.testing.assert_close(torch.tensor(1.6), load_balancing_loss([out], mask))
    torch.testing.assert_close(torch.tensor(1.6), load_balancing_loss([out, out], mask))
    assert 0.0 == float(load_balancing_loss([out], torch.tensor([False, False])).detach())


def test_the_load_balancing_term_of_a_forward_uses_its_labels_as_the_mask() -> None:
    """On the model: the labels' supervised positions select the tokens; the value lies between 1 and E."""
    model = _model()
    mb = scenarios.build("single", 1)[0][0][0]
    model(mb.inputs)
    value = load_balancing_loss(router_outputs(model), mb.labels != IGNORE_INDEX)
    assert 1.0 <= float(value.detach()) <= 4.0 and value.requires_grad


def test_a_mask_of_another_forward_or_dtype_and_an_empty_list_are_refused() -> None:
    with pytest.raises(ValueError, match=r"mask \(3,\) has 3 entries and 'blocks.0.mlp' routed 2 tokens"):
        load_balancing_loss([_two_tokens()], torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask must be bool .* got torch.int64"):
        load_balancing_loss([_two_tokens()], torch.ones(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"got no router output"):
        load_balancing_loss([])


# --- the declaration -------------------------------------------------------------------------------------------------


def test_the_factory_declares_its_experts_and_router() -> None:
    """``harness.moe:moe`` carries a MoePlan; the built-in dense models declare none."""
    assert moe.moe_plan == plan_of("harness.moe:moe")  # type: ignore[attr-defined]
    assert plan_of("harness.model:sequence_sharded") is None and plan_of(None) is None


def test_the_declaration_names_every_expert_parameter_and_the_router_and_not_the_shared_expert() -> None:
    """Experts: the 4 experts' 4 tensors each; router: its weight; the shared expert is in neither."""
    model = _model()
    plan = plan_of("harness.moe:moe")
    assert plan is not None
    experts = expert_parameters(model, plan)
    assert 16 == len(experts) and all(".mlp.experts." in n for n in experts)
    assert ["blocks.0.mlp.router.weight"] == list(router_parameters(model, plan))
    assert not any(".shared." in n for n in (*experts, *router_parameters(model, plan)))
    named = dict(model.named_parameters())
    assert all(p is named[n] for n, p in experts.items())


def test_a_pattern_that_matches_no_parameter_is_refused_naming_the_attribute_the_pattern_and_the_fix() -> None:
    plan = MoePlan(experts=("layers.*.moe.experts",), router=("blocks.*.mlp.router",))
    with pytest.raises(ValueError, match=r"moe_plan.experts pattern 'layers.\*.moe.experts' matches no parameter "
                                         r"of the model; name the modules .* blocks.0.mlp.experts.0.0"):
        expert_parameters(_model(), plan)


def test_a_parameter_named_both_expert_and_router_is_refused() -> None:
    plan = MoePlan(experts=("blocks.*.mlp",), router=("blocks.*.mlp.router",))
    with pytest.raises(ValueError, match=r"names 'blocks.0.mlp.router.weight' both as an expert and as a router"):
        router_parameters(_model(), plan)


@pytest.mark.parametrize("value", [(), "blocks.*.mlp.experts", ("",)], ids=["empty", "a_string", "blank"])
def test_a_declaration_without_patterns_is_refused_naming_the_field(value: object) -> None:
    with pytest.raises(ValueError, match=r"MoePlan.experts=.* must be a non-empty tuple of module path patterns"):
        MoePlan(experts=value, router=("r",))  # type: ignore[arg-type]


def test_a_factory_attribute_that_is_not_a_moe_plan_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(moe_module.moe, "moe_plan", {"experts": "blocks.*.mlp.experts"}, raising=False)
    with pytest.raises(ValueError, match=r"its moe_plan is a dict, not a harness.moe.MoePlan; declare factory"):
        plan_of("harness.moe:moe")

