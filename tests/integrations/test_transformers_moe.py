"""transformers' mixture-of-experts causal LMs built from a config (``harness.recipes.libraries.transformers_moe``),
judged with their own router auxiliary loss: what the model's ``aux_loss`` computes, the recipe that weighs it as one
value per microbatch passing the battery, and ``Trainer``'s own loop failing with the router term's reading."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import harness.battery.judge.checks  # noqa: F401  (the checks register themselves in REGISTRY when imported)
from harness.battery import scenarios
from harness.battery.judge import registry
from harness.battery.launch import runner
from harness.core.formats import to_hf
from harness.core.microbatch import IGNORE_INDEX
from harness.moe_plan import expert_parameters, router_parameters
from harness.recipes.libraries._common import EXTRA_HINT

pytestmark = pytest.mark.integrations

ROOT = Path(__file__).parents[2]
MODULE = "harness.recipes.libraries.transformers_moe"
MIXTRAL = f"{MODULE}:tiny_mixtral"
QWEN2_MOE = f"{MODULE}:tiny_qwen2_moe"
RECIPE = f"{MODULE}:transformers_moe_router_loss"
CONTROL = "harness.recipes:trainer_router_loss_per_microbatch"


@pytest.fixture(autouse=True)
def _transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers", reason=EXTRA_HINT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing is fetched: the models are built from a config


def _model(path: str) -> torch.nn.Module:
    from harness.battery.spec import ModelSpec

    return ModelSpec(path, "hf").build()


def _reference_aux(router_logits: tuple[torch.Tensor, ...], mask: torch.Tensor | None, k: int) -> torch.Tensor:
    """The Switch term as the model's docstring reads: ``E * sum_e f_e * P_e``, f the share of the top-k slots
    choosing e and P the mean probability of e, each pooled over every layer and the tokens ``mask`` keeps."""
    probs = torch.cat([g.softmax(dim=-1) for g in router_logits])
    keep = torch.ones(probs.shape[0], dtype=torch.bool) if mask is None else mask.reshape(-1).bool().repeat(
        len(router_logits))
    probs = probs[keep]
    experts = probs.shape[1]
    chosen = torch.nn.functional.one_hot(probs.topk(k, dim=-1).indices, experts).sum(dim=1).to(probs.dtype)
    return experts * (chosen.mean(dim=0) * probs.mean(dim=0)).sum()


def test_the_models_aux_loss_is_the_switch_term_over_its_attended_tokens_summed_over_the_k_slots() -> None:
    """``outputs.aux_loss`` (Mixtral, transformers 5.25) is the Switch term pooled over both layers, over the tokens
    the attention mask keeps: prompt tokens and each row's last token count, padding does not. Its ``f`` sums over
    the k slots: uniform routing gives k = 2, not 1. The negative controls: the same term over the supervised tokens
    only, or over every position (padding included), is another number."""
    model = _model(MIXTRAL)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(100.0)  # a peaked routing: at initialization it is near uniform everywhere
    mb = scenarios.build("long", 2)[0][0][3]  # 6 of its 136 attended positions predict no target
    batch = to_hf(mb)
    assert int((batch["attention_mask"] == 0).sum()) > 0 and int((batch["labels"] == IGNORE_INDEX).sum()) > 0
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True)
    assert 2 == len(out.router_logits)
    want = _reference_aux(out.router_logits, batch["attention_mask"], 2)
    # float32 sums in another order (the model accumulates layer by layer): a few ulps of a number near 2.
    torch.testing.assert_close(out.aux_loss, want.to(out.aux_loss.dtype), atol=1e-6, rtol=1e-6)
    supervised = torch.zeros_like(batch["labels"], dtype=torch.bool)
    supervised[:, :-1] = batch["labels"][:, 1:] != IGNORE_INDEX  # the positions whose logit predicts a target
    aux = out.aux_loss.detach()
    # Measured: 1.0e-2 over the supervised tokens, 1.9e-1 over every position: far beyond the match's 1e-6.
    assert float((_reference_aux(out.router_logits, supervised, 2).detach() - aux).abs()) > 1e-3
    assert float((_reference_aux(out.router_logits, None, 2).detach() - aux).abs()) > 1e-3
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.zero_()  # every expert equally probable
    uniform = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True)
    assert 2.0 == pytest.approx(float(uniform.aux_loss.detach()), abs=1e-6)


def test_the_moe_plan_names_the_experts_and_the_routers_of_both_models() -> None:
    """Mixtral and Qwen2-MoE keep every expert of a layer in one module and the router in ``gate``; Qwen2-MoE's
    shared expert and its gate are neither."""
    for path, names in ((MIXTRAL, ()), (QWEN2_MOE, ("shared_expert",))):
        model = _model(path)
        plan = getattr(importlib.import_module(MODULE), path.split(":")[1]).moe_plan
        experts, routers = expert_parameters(model, plan), router_parameters(model, plan)
        assert ["model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.gate_up_proj",
                "model.layers.1.mlp.experts.down_proj", "model.layers.1.mlp.experts.gate_up_proj"] == sorted(experts)
        assert ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"] == sorted(routers)
        for name in names:
            assert any(name in n for n, _ in model.named_parameters())
            assert not any(name in n for n in [*experts, *routers])


def test_the_router_loss_recipe_passes_the_quick_battery_on_a_mixtral_from_outside_the_checkout(
        tmp_path: Path) -> None:
    """The command a user runs, from a folder outside the checkout: every check of the quick scenarios holds at
    W=2 (parity with the router term, one synchronization, the logged loss, hygiene, the empty window)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "harness", "battery", "--model", MIXTRAL, "--batch-format", "hf",
                           "--recipe", RECIPE, "--quick", "--battery-world-sizes", "2"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert 0 == done.returncode, done.stdout[-3000:] + done.stderr[-3000:]
    assert "every check holds" in done.stdout, done.stdout[-3000:]


def test_the_trainers_own_loop_weighs_the_router_term_w_times_k() -> None:
    """``Trainer``'s loop on the same Mixtral: the model's loss carries ``coef * aux_loss`` in every microbatch,
    times W, never divided by the accumulation steps. Parity fails and the diagnosis reads the router term at
    W*k = 4 times its weight (W=2, k=2) with the main loss right; the recipe passes the same case."""
    run = runner.run(CONTROL, "uneven", 2, model=MIXTRAL, batch_format="hf")
    verdict = registry.CHECKS["parity"](run)
    assert ("fail", "numbers") == (verdict.status, verdict.cause), verdict.message
    assert verdict.diagnosis is not None
    assert "auxiliary_misweighted" == verdict.diagnosis["signature"], verdict.diagnosis["line"]
    assert "the main loss's weights are right" in str(verdict.diagnosis["line"])
    assert "a factor W*k = 4 (W=2, k=2)" in str(verdict.diagnosis["line"])
    right = registry.CHECKS["parity"](runner.run(RECIPE, "uneven", 2, model=MIXTRAL, batch_format="hf"))
    assert "pass" == right.status, right.message


def test_the_trainer_whose_compute_loss_divides_the_router_term_by_k_gives_the_global_objective() -> None:
    """The same ``Trainer`` loop with ``compute_loss`` taking the router term out of the model's loss (times W) and
    adding it back divided by the accumulation steps: parity, one synchronization and the logged loss hold."""
    run = runner.run(f"{MODULE}:transformers_moe_trainer_router_loss", "uneven", 2, model=MIXTRAL,
                     batch_format="hf")
    verdicts = [registry.CHECKS[c](run) for c in ("parity", "one_sync", "logged_loss")]
    assert [] == [v.message for v in verdicts if v.status != "pass"]


def test_the_router_loss_recipe_gives_the_global_objective_on_a_qwen2_moe_with_its_shared_expert() -> None:
    """The same recipe on Qwen2-MoE (top-2 without renormalization, a gated shared expert): parity and the
    logged loss hold on the uneven scenario at W=2."""
    run = runner.run(RECIPE, "uneven", 2, model=QWEN2_MOE, batch_format="hf")
    verdicts = [registry.CHECKS[c](run) for c in ("parity", "logged_loss", "one_sync")]
    assert [] == [v.message for v in verdicts if v.status != "pass"]
