"""The two batch conventions (``--batch-format=harness|hf``), a user's model (``--model``) and the recipe helpers,
on one process: the hf dict's alignment rule, equal loss sums in both formats, the logits of any output shape, the
dropout rule, identical initial weights from one seed, and the loader's usage errors."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from harness.battery import scenarios
from harness.battery.launch.run import Run
from harness.battery.spec import ModelSpec, weights_digest
from harness.core.compare import flat_params
from harness.core.formats import logits_of, shifted_loss_sum, supervised_tokens, to_hf
from harness.core.microbatch import IGNORE_INDEX, PAD, Microbatch
from harness.data.batching import collate
from harness.data.corpus import Row
from harness.model import CausalLMOutput, ModelError, build_model, build_user_model, disable_dropout
from harness.recipes import global_count, require_tokens, sync_context

MODEL = "user_recipes.models:make_model"
I = IGNORE_INDEX  # noqa: E741


def _rows() -> Microbatch:
    # A row of 5 tokens whose first 2 are the prompt, a row of 3 tokens without prompt (padded), and a row that is
    # all prompt (no supervised token; padded).
    return collate([Row(0, "a", (11, 12, 13, 14, 15), 2), Row(1, "b", (21, 22, 23), 0), Row(2, "c", (31, 32), 2)])


def test_the_hf_dict_follows_the_alignment_rule_exactly() -> None:
    """input_ids: the full row (PAD after it); attention_mask: 1 on real tokens; labels: the token itself where it is
    a target and at position 0 of a row without prompt, -100 on the prompt and on padding."""
    mb = _rows()
    assert mb.inputs.tolist() == [[11, 12, 13, 14], [21, 22, PAD, PAD], [31, PAD, PAD, PAD]]
    assert mb.labels.tolist() == [[I, 13, 14, 15], [22, 23, I, I], [I, I, I, I]]
    hf = to_hf(mb)
    assert hf["input_ids"].tolist() == [[11, 12, 13, 14, 15], [21, 22, 23, PAD, PAD], [31, PAD, PAD, PAD, PAD]]
    assert hf["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]
    assert hf["labels"].tolist() == [[I, I, 13, 14, 15], [21, 22, 23, I, I], [I, I, I, I, I]]
    # The HF shift pairs exactly the harness's (position, target) pairs.
    assert torch.equal(hf["labels"][:, 1:], mb.labels)
    assert torch.equal(hf["input_ids"][:, :-1][mb.labels != I], mb.inputs[mb.labels != I])
    assert supervised_tokens(hf) == supervised_tokens(mb) == mb.supervised == 5
    assert all(t.dtype == torch.int64 for t in hf.values())


def test_the_readme_example_rows_convert_as_the_readme_shows() -> None:
    """docs/your-model.md's two rows, 5 tokens with a 2-token prompt and 4 without, in a microbatch whose longest row
    has 6."""
    mb = collate([Row(0, "a", (11, 12, 13, 14, 15), 2), Row(1, "b", (21, 22, 23, 24), 0),
                  Row(2, "c", (1, 2, 3, 4, 5, 6), 0)])
    hf = to_hf(mb)
    assert [[11, 12, 13, 14, 0], [21, 22, 23, 0, 0]] == mb.inputs[:2].tolist()
    assert [[I, 13, 14, 15, I], [22, 23, 24, I, I]] == mb.labels[:2].tolist()
    assert [[11, 12, 13, 14, 15, 0], [21, 22, 23, 24, 0, 0]] == hf["input_ids"][:2].tolist()
    assert [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]] == hf["attention_mask"][:2].tolist()
    assert [[I, I, 13, 14, 15, I], [21, 22, 23, 24, I, I]] == hf["labels"][:2].tolist()


def _battery_microbatches() -> list[Microbatch]:
    """Every microbatch of every battery scenario at every world size the command line accepts."""
    return [mb for name in scenarios.BATTERY_SCENARIOS for world in range(1, scenarios.MAX_WORLD_SIZE + 1)
            if not (name in scenarios.MULTI_RANK_ONLY and world == 1)
            for window in scenarios.build(name, world) for rank in window for mb in rank]


def test_an_unprompted_row_is_its_own_label_at_position_0_and_a_prompted_row_is_ignored_there() -> None:
    """labels = input_ids, prompt masked (a real HF dataset's rows): on every battery microbatch, a row whose first
    target is supervised has labels[b, 0] == input_ids[b, 0]; any other row (a prompt, no supervised token) has -100."""
    seen = {"unprompted": 0, "prompted": 0}
    for mb in _battery_microbatches():
        hf = to_hf(mb)
        for b in range(mb.labels.shape[0]):
            if mb.labels[b, 0] != I:
                assert int(hf["input_ids"][b, 0]) == int(hf["labels"][b, 0]) != PAD
                seen["unprompted"] += 1
            else:
                assert I == int(hf["labels"][b, 0])
                seen["prompted"] += bool((mb.labels[b] != I).any())
    assert seen["unprompted"] > 0 and seen["prompted"] > 0, seen


def test_a_count_before_the_shift_is_one_too_many_per_unprompted_row() -> None:
    """(labels != -100).sum() on the unshifted labels exceeds supervised_tokens by the rows without prompt, exactly:
    the mistake ``hf_count_before_shift`` makes, which only a real token at position 0 shows."""
    differs = 0
    for mb in _battery_microbatches():
        hf = to_hf(mb)
        before = int((hf["labels"] != I).sum())
        unprompted = int((mb.labels[:, 0] != I).sum())
        assert before - unprompted == supervised_tokens(hf) == mb.supervised
        differs += unprompted > 0
    assert differs > 0


def test_the_shift_gives_exactly_the_harness_position_target_pairs() -> None:
    """labels[:, 1:] is the harness's aligned labels, and each supervised position's hf input is the harness's input,
    on every battery microbatch: position 0's label is never paired with a logit."""
    for mb in _battery_microbatches():
        hf = to_hf(mb)
        assert torch.equal(hf["labels"][:, 1:], mb.labels)
        mask = mb.labels != I
        assert torch.equal(hf["input_ids"][:, :-1][mask], mb.inputs[mask])
        assert torch.equal(hf["input_ids"][:, 1:][mask], mb.labels[mask])


@pytest.mark.parametrize("scenario", ["uneven", "sparse", "long"])
def test_the_built_in_model_gives_the_same_loss_sums_in_both_formats(scenario: str) -> None:
    """Its causal attention makes the extra last column and the padding irrelevant to every supervised position:
    every microbatch's loss sum and gradient agree (float64), whole and row by row (the diagnosis slices rows)."""
    harness, hf = ModelSpec(None, "harness", None, "fp64"), ModelSpec(None, "hf", None, "fp64")
    model = harness.build()
    for rank in scenarios.build(scenario, 2)[0]:
        for mb in rank:
            a, b = harness.loss_sum(model, mb), hf.loss_sum(model, mb)
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
            rows = [Microbatch(mb.inputs[i:i + 1], mb.labels[i:i + 1]) for i in range(mb.inputs.shape[0])]
            torch.testing.assert_close(sum(hf.loss_sum(model, r) for r in rows), b, rtol=1e-12, atol=1e-12)
    mb = scenarios.build(scenario, 2)[0][0][0]
    grads = []
    for spec in (harness, hf):
        model.zero_grad()
        spec.loss_sum(model, mb).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))  # type: ignore[union-attr]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-12)


def test_the_user_model_gives_the_same_loss_sums_in_both_formats() -> None:
    """The convolution model reads the attention mask; padding after the row's end still changes no supervised
    position."""
    harness, hf = ModelSpec(MODEL, "harness", None, "fp64"), ModelSpec(MODEL, "hf", None, "fp64")
    model = harness.build()
    for mb in scenarios.build("uneven", 2)[0][1]:
        torch.testing.assert_close(harness.loss_sum(model, mb), hf.loss_sum(model, mb), rtol=1e-12, atol=1e-12)


def test_shifting_twice_or_not_at_all_gives_another_loss() -> None:
    """The two hf mistakes are not rounding: they pair logits with other tokens."""
    spec = ModelSpec(None, "hf", None, "fp64")
    model, mb = spec.build(), _rows()
    hf = to_hf(mb)
    logits = logits_of(model(input_ids=hf["input_ids"], attention_mask=hf["attention_mask"]))
    right = shifted_loss_sum(logits, hf["labels"])
    unshifted = nn.functional.cross_entropy(logits.flatten(0, 1), hf["labels"].flatten(), reduction="sum")
    assert abs(float((right - unshifted).detach())) > 1e-3


def test_the_built_in_model_takes_a_hugging_face_style_call() -> None:
    """model(input_ids=, attention_mask=) -> an output with .logits equal to model(inputs)'s; labels= -> HF's shifted
    mean in .loss; model(inputs) still returns the logits tensor."""
    model = build_model(scenarios.BATTERY_CONFIG).double()
    hf = to_hf(_rows())
    out = model(input_ids=hf["input_ids"], attention_mask=hf["attention_mask"])
    assert isinstance(out, CausalLMOutput) and out.loss is None
    assert torch.equal(out.logits, model(hf["input_ids"]))
    with_labels = model(**hf)
    torch.testing.assert_close(with_labels.loss, shifted_loss_sum(out.logits, hf["labels"]) / 5)
    with pytest.raises(TypeError, match="pass the token ids once"):
        model(hf["input_ids"], input_ids=hf["input_ids"])


def test_logits_come_from_a_tensor_a_tuple_a_dict_or_an_object() -> None:
    t = torch.zeros(1, 2, 3)
    assert logits_of(t) is t and logits_of((t, None)) is t and logits_of({"logits": t}) is t
    assert logits_of(CausalLMOutput(t)) is t
    with pytest.raises(TypeError, match=r"tensor, an object with \.logits"):
        logits_of("nope")


def test_dropout_is_disabled_by_the_documented_rule_and_train_mode_kept() -> None:
    """Dropout modules get p=0, config and module float attributes ending in dropout/_pdrop get 0.0; two forward
    passes in train mode then agree (they would not with the model's dropout 0.5)."""
    raw = build_user_model(MODEL, 0)
    x = torch.randint(1, 32, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.random.fork_rng(devices=[]):
        assert not torch.equal(raw(x).logits, raw(x).logits)
    model = ModelSpec(MODEL).build()
    assert model.training and model.drop.p == 0.0 and model.config.hidden_dropout == 0.0
    with torch.random.fork_rng(devices=[]):
        assert torch.equal(model(x).logits, model(x).logits)

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention_dropout, self.resid_pdrop, self.keep = 0.1, 0.2, 0.3
            self.drop2d = nn.Dropout2d(0.4)

    plain = disable_dropout(Plain())
    assert (plain.attention_dropout, plain.resid_pdrop, plain.keep, plain.drop2d.p) == (0.0, 0.0, 0.3, 0.0)


def test_one_seed_gives_identical_initial_weights_and_leaves_the_global_generator_alone() -> None:
    state = torch.get_rng_state()
    a, b, c = build_user_model(MODEL, 3), build_user_model(MODEL, 3), build_user_model(MODEL, 4)
    assert torch.equal(state, torch.get_rng_state())
    assert torch.equal(flat_params(a), flat_params(b)) and not torch.equal(flat_params(a), flat_params(c))
    assert weights_digest(a) == weights_digest(b) != weights_digest(c)


def test_a_run_builds_the_user_model_and_the_default_model_unchanged() -> None:
    """Run.model() is the factory's model in the run's precision; without --model it is the built-in one, bitwise;
    Run.model_at loads flat weights into either."""
    windows = scenarios.build("uneven", 2)
    user = Run("r", "uneven", 2, "fp64", windows, model_path=MODEL, batch_format="hf")
    built = user.model()
    assert built.embed.weight.dtype == torch.float64 and built.training
    params = flat_params(built) + 1
    assert torch.equal(flat_params(user.model_at(params)), params)
    default = Run("r", "uneven", 2, "fp32", windows)
    assert torch.equal(flat_params(default.model()), flat_params(build_model(scenarios.BATTERY_CONFIG)))
    assert "model user_recipes.models:make_model, hf batches" in user.label()
    assert "model" not in default.label()


@pytest.mark.parametrize(("path", "says"), [
    ("no_colon", "must look like 'package.module:attr'"),
    ("no_such_pkg.mod:f", "importing 'no_such_pkg.mod' failed"),
    ("user_recipes.models:missing", "has no attribute 'missing'"),
    ("user_recipes.models:returns_a_string", "returned a str, not a torch.nn.Module"),
    ("user_recipes.models:VOCAB", "is a int, not callable"),
])
def test_a_bad_model_path_is_a_model_error_naming_the_value_and_the_fix(path: str, says: str) -> None:
    with pytest.raises(ModelError) as err:
        build_user_model(path, 0)
    assert says in str(err.value) and f"model={path!r}" in str(err.value)
    fix = "on PYTHONPATH" if "importing" in says else "zero-argument callable that returns a torch.nn.Module"
    assert fix in str(err.value)


def test_a_tuple_output_model_class_is_a_factory() -> None:
    """A class given by path is built with no argument; a (logits,) output is read."""
    spec = ModelSpec("user_recipes.models:TupleLM", "hf", None, "fp64")
    assert float(spec.loss_sum(spec.build(), _rows()).detach()) > 0


def test_sync_context_skips_the_all_reduce_for_all_but_the_last_microbatch() -> None:
    entered = []

    class Wrapped(nn.Module):
        @contextlib.contextmanager
        def no_sync(self):  # type: ignore[no-untyped-def]
            entered.append(True)
            yield

    for i in range(3):
        with sync_context(Wrapped(), i, 3):
            pass
    assert 2 == len(entered)
    assert isinstance(sync_context(nn.Identity(), 0, 3), contextlib.nullcontext)  # no DDP wrapper: nothing to skip
    for i, n in ((3, 3), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="0 <= i < n"):
            sync_context(Wrapped(), i, n)


def test_require_tokens_and_global_count_on_one_process() -> None:
    """Without a process group the local count is the global one; zero raises the contract's ValueError."""
    assert 7 == global_count(7) and 7 == require_tokens(global_count(7))
    with pytest.raises(ValueError, match="no supervised token in the global accumulation window"):
        require_tokens(global_count(0))
