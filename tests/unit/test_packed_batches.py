"""``--batch-format packed``: padding-free rows as transformers' ``DataCollatorWithFlattening`` builds them
(:func:`harness.core.formats.to_packed`), their (position, target) pairs and count exactly the unpacked ones, the model
call (:func:`harness.core.formats.hf_forward`), the built-in model keeping the sequences of a row apart, and the
option on every surface."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from harness.battery import scenarios
from harness.battery.dist import parse_args as dist_args
from harness.battery.plan.options import BATCH_FORMAT_HELP, BatteryOptions, RunSpec
from harness.battery.plan.options import BATCH_FORMATS as OPTION_FORMATS
from harness.battery.spec import ModelSpec
from harness.core.formats import (
    BATCH_FORMATS,
    FLASH_KEYS,
    PACKED,
    PACKED_KEYS,
    batch_as,
    hf_forward,
    pack_rows,
    packed_kwargs,
    shifted_loss_sum,
    supervised_tokens,
    to_hf,
    to_packed,
)
from harness.core.microbatch import IGNORE_INDEX, PAD, Microbatch
from harness.data.batching import collate
from harness.data.corpus import Row
from harness.testing.hypothesis_profiles import load_profile
from harness.testing.plugin import pytest_addoption
from harness.workflow.cli import build_parser

load_profile()

I = IGNORE_INDEX  # noqa: E741


def _pairs(batch: dict[str, Any]) -> list[tuple[tuple[int, ...], int]]:
    """Each supervised target after the HF shift, with the tokens its logit sees: the sequence's tokens from its start
    (position 0 of ``position_ids``, or of the row) up to the logit's position."""
    ids, labels = batch["input_ids"], batch["labels"]
    pos = batch.get("position_ids")
    out = []
    for r in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            if int(labels[r, t]) != I:
                start = t - 1 - int(pos[r, t - 1]) if pos is not None else 0
                out.append((tuple(ids[r, start:t].tolist()), int(labels[r, t])))
    return sorted(out)


def test_two_sequences_pack_exactly_as_data_collator_with_flattening() -> None:
    """docs' example (/work/shared FACTS, transformers 5.24): sequences of 3 and 4 tokens, one row."""
    mb = Microbatch(torch.tensor([[1, 2, PAD], [4, 5, 6]]), torch.tensor([[2, 3, I], [5, 6, 7]]))
    packed = to_packed(mb)
    assert set(packed) == set(PACKED_KEYS)
    assert packed["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7]]
    assert packed["labels"].tolist() == [[I, 2, 3, I, 5, 6, 7]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    assert packed["seq_idx"].tolist() == [[0, 0, 0, 1, 1, 1, 1]]
    assert packed["cu_seq_lens_q"].tolist() == packed["cu_seq_lens_k"].tolist() == [0, 3, 7]
    assert packed["max_length_q"] == packed["max_length_k"] == 4
    assert (packed["seq_idx"].dtype, packed["cu_seq_lens_q"].dtype) == (torch.int32, torch.int32)
    assert supervised_tokens(packed) == mb.supervised == 5


def test_one_row_is_what_transformers_collator_builds_from_the_hf_rows() -> None:
    """The collator itself, fed each row's real tokens of its hf form: every key and dtype equal."""
    collator_module = pytest.importorskip("transformers.data.data_collator")
    mb = collate([Row(0, "a", (11, 12, 13, 14, 15), 2), Row(1, "b", (21, 22, 23), 0)])
    hf = to_hf(mb)
    real = hf["attention_mask"].bool()
    features = [{"input_ids": hf["input_ids"][b][real[b]].tolist(), "labels": hf["labels"][b][real[b]].tolist()}
                for b in range(2)]
    collator = collator_module.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    want = collator(features, return_tensors="pt")
    got = to_packed(mb)
    assert set(want) == set(got)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert (value.dtype, value.tolist()) == (got[key].dtype, got[key].tolist()), key
        else:
            assert value == got[key], key


def test_several_rows_padding_and_weights() -> None:
    """Capacity 2 x 5 = 10: first-fit in order puts 5+3 in row 0, 4 in row 1 (8 + 4 > 10), 2 back in row 0. Row 1
    is padded with a sequence of its own; the weights sit where the labels do."""
    mb = collate([Row(0, "a", (11, 12, 13, 14, 15), 0), Row(1, "b", (21, 22, 23), 0), Row(2, "c", (31, 32, 33, 34), 2),
                  Row(3, "d", (41, 42), 0)])
    w = torch.where(mb.labels != I, torch.arange(1, 17, dtype=torch.float64).view(4, 4), torch.zeros(4, 4,
                                                                                                  dtype=torch.float64))
    mb = Microbatch(mb.inputs, mb.labels, w)
    packed = to_packed(mb)
    assert packed["input_ids"].tolist() == [[11, 12, 13, 14, 15, 21, 22, 23, 41, 42],
                                            [31, 32, 33, 34, PAD, PAD, PAD, PAD, PAD, PAD]]
    assert packed["labels"].tolist() == [[I, 12, 13, 14, 15, I, 22, 23, I, 42],
                                         [I, I, 33, 34, I, I, I, I, I, I]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1], [0, 1, 2, 3, 0, 1, 2, 3, 4, 0]]
    # the padding: 6 tokens cut into pieces of at most the longest sequence's 5, each a sequence of its own
    assert packed["seq_idx"].tolist() == [[0, 0, 0, 0, 0, 1, 1, 1, 2, 2], [3, 3, 3, 3, 4, 4, 4, 4, 4, 5]]
    assert packed["cu_seq_lens_q"].tolist() == [0, 5, 8, 10, 14, 19, 20]
    assert packed["max_length_q"] == 5
    hf = to_hf(mb)
    assert packed["weights"].tolist() == [
        [0, *hf["weights"][0, 1:5].tolist(), 0, *hf["weights"][1, 1:3].tolist(), 0, hf["weights"][3, 1].item()],
        [0, 0, *hf["weights"][2, 2:4].tolist(), 0, 0, 0, 0, 0, 0]]
    assert float(packed["weights"].sum()) == float(mb.weights.sum())  # type: ignore[union-attr]
    assert supervised_tokens(packed) == mb.supervised == 9
    assert _pairs(packed) == _pairs(hf)


def test_transformers_finds_the_same_boundaries_in_the_position_ids() -> None:
    """Several rows: the cu_seq_lens emitted are what transformers' own helper reads from the flattened
    position_ids."""
    utils = pytest.importorskip("transformers.modeling_flash_attention_utils")
    for mbs in scenarios.build("uneven", 2)[0]:
        for mb in mbs:
            packed = to_packed(mb)
            (cu_q, cu_k), (max_q, _) = utils.prepare_fa_kwargs_from_position_ids(packed["position_ids"])
            emitted = packed["cu_seq_lens_q"].tolist()
            assert cu_q.tolist() == cu_k.tolist() == emitted == packed["cu_seq_lens_k"].tolist()
            assert int(max_q) == packed["max_length_q"]


def test_the_packing_policy_is_first_fit_in_order() -> None:
    assert pack_rows([5, 3, 4, 2], 10) == [[0, 1, 3], [2]]
    assert pack_rows([7], 14) == [[0]]
    with pytest.raises(ValueError, match="capacity=4 must hold the longest sequence"):
        pack_rows([5], 4)
    mb = collate([Row(0, "a", (11, 12, 13), 0), Row(1, "b", (21, 22, 23), 0)])
    assert to_packed(mb, capacity=3)["input_ids"].shape == (2, 3)  # one sequence per row: no padding
    with pytest.raises(ValueError, match=r"capacity=2 must be a whole number of tokens at least the longest"):
        to_packed(mb, capacity=2)


@st.composite
def _microbatches(draw: st.DrawFn) -> Microbatch:
    n = draw(st.integers(1, 6))
    rows = []
    for i in range(n):
        length = draw(st.integers(2, 9))
        prompt = draw(st.sampled_from([0, *range(2, length + 1)]))
        rows.append(Row(i, "x", tuple(draw(st.lists(st.integers(1, 31), min_size=length, max_size=length))), prompt))
    mb = collate(rows)
    if draw(st.booleans()):
        mb = Microbatch(mb.inputs, mb.labels, torch.where(mb.labels != I, 0.5, 0.0).double())
    return mb


@given(_microbatches())
def test_the_separator_keeps_the_count_and_the_pairs_of_the_unpacked_sequences(mb: Microbatch) -> None:
    """Any microbatch: the shifted count is ``mb.supervised``, each target is seen with exactly its own sequence's
    tokens before it, and the weights are carried over."""
    packed, hf = to_packed(mb), to_hf(mb)
    assert supervised_tokens(packed) == supervised_tokens(hf) == mb.supervised
    assert _pairs(packed) == _pairs(hf)
    assert int((packed["input_ids"] != PAD).sum()) == int(hf["attention_mask"].sum())
    if mb.weights is not None:
        assert torch.equal(packed["weights"][packed["labels"] == I], torch.zeros_like(packed["weights"][
            packed["labels"] == I]))
        assert float(packed["weights"].sum()) == pytest.approx(float(mb.weights.sum()))


@pytest.mark.parametrize("scenario", scenarios.BATTERY_SCENARIOS)
def test_every_scenario_packs_with_the_same_count_and_rows_of_several_sequences(scenario: str) -> None:
    """The battery's own microbatches, at W=3: the counts are the unpacked ones, and the packing does pack (fewer
    rows than sequences somewhere)."""
    fewer = False
    for window in scenarios.build(scenario, 3):
        for mbs in window:
            for mb in mbs:
                packed = to_packed(mb)
                assert supervised_tokens(packed) == mb.supervised
                assert _pairs(packed) == _pairs(to_hf(mb))
                fewer |= packed["input_ids"].shape[0] < mb.inputs.shape[0]
    assert fewer


def test_the_built_in_model_gives_the_unpacked_loss_sum_only_because_it_keeps_sequences_apart() -> None:
    """fp64, the uneven scenario: packed and unpacked loss sums agree to 1e-12; the same rows without position_ids
    (plain causal attention across the sequences, one position range) do not (the negative control)."""
    spec = ModelSpec(None, PACKED, None, "fp64")
    model = spec.build()
    with torch.no_grad():
        _agree_packed_and_unpacked(spec, model)


def _agree_packed_and_unpacked(spec: ModelSpec, model: nn.Module) -> None:
    for mbs in scenarios.build("uneven", 2)[0]:
        for mb in mbs:
            packed = to_packed(mb)
            want = spec.loss_sum(model, mb)
            got = shifted_loss_sum(hf_forward(model, packed), packed["labels"])
            assert float((got - want).abs()) < 1e-12 * float(want)
            if packed["input_ids"].shape[1] <= 128:
                flat = model(input_ids=packed["input_ids"]).logits
                assert float((shifted_loss_sum(flat, packed["labels"]) - want).abs()) > 1e-3


def test_the_reference_under_packed_is_the_unpacked_hf_call() -> None:
    mb = scenarios.build("uneven", 2)[0][0][0]
    packed, hf = ModelSpec(None, PACKED, None, "fp64"), ModelSpec(None, "hf", None, "fp64")
    model = hf.build()
    assert torch.equal(packed.loss_sum(model, mb), hf.loss_sum(model, mb))
    assert torch.equal(packed.logits(model, mb)[1], hf.logits(model, mb)[1])
    assert set(packed.batch(mb)) == set(PACKED_KEYS)  # type: ignore[arg-type]
    assert set(batch_as(mb, "hf")) == {"input_ids", "attention_mask", "labels"}  # type: ignore[arg-type]


class _Named(nn.Module):
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                use_cache: bool | None = None) -> torch.Tensor:
        return torch.zeros(*input_ids.shape, 3)


class _Kwargs(nn.Module):
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, **kwargs: Any) -> Any:
        return torch.zeros(*input_ids.shape, 3)


def test_the_packed_call_passes_what_the_forward_takes() -> None:
    """No attention_mask ever; the flash boundaries only to a forward with **kwargs (DDP unwrapped); use_cache=False
    only to a forward that names it."""
    packed = to_packed(Microbatch(torch.tensor([[1, 2, PAD], [4, 5, 6]]), torch.tensor([[2, 3, I], [5, 6, 7]])))
    assert set(packed_kwargs(_Named(), packed)) == {"input_ids", "position_ids", "use_cache"}
    assert packed_kwargs(_Named(), packed)["use_cache"] is False
    assert set(packed_kwargs(_Kwargs(), packed)) == {"input_ids", "position_ids", *FLASH_KEYS}
    builtin = ModelSpec().build()
    assert set(packed_kwargs(builtin, packed)) == {"input_ids", "position_ids"}
    assert hf_forward(_Named(), packed).shape == (1, 7, 3)
    # an hf dict keeps its call
    hf = to_hf(Microbatch(torch.tensor([[1, 2]]), torch.tensor([[2, 3]])))
    assert hf_forward(builtin, hf).shape == (1, 3, 32)


# --- the option on every surface ------------------------------------------------------------------------------------


def test_packed_is_a_batch_format_everywhere_and_a_bad_one_is_refused_naming_it() -> None:
    assert OPTION_FORMATS == BATCH_FORMATS == ("harness", "hf", "packed")
    assert BatteryOptions.parse(batch_format="packed").batch_format == "packed"
    assert RunSpec("harness.recipes:hf_global_token_mean", batch_format="packed").batch_format == "packed"
    assert ModelSpec(None, "packed").batch_format == "packed"
    with pytest.raises(ValueError, match="--batch-format='padded' must be one of harness, hf, packed"):
        BatteryOptions.parse(batch_format="padded")
    with pytest.raises(ValueError, match="batch_format='padded' must be one of harness, hf, packed"):
        RunSpec("harness.recipes:global_token_mean", batch_format="padded")
    with pytest.raises(ValueError, match="batch_format='padded' must be one of harness, hf, packed"):
        ModelSpec(None, "padded")


@pytest.mark.parametrize("argv", [["battery"], ["explain", "--recipe", "harness.recipes:global_token_mean"]])
def test_the_command_line_takes_packed_and_refuses_another(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args([*argv, "--batch-format", "packed"]).batch_format == "packed"
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--batch-format", "padded"])
    err = capsys.readouterr().err
    assert "invalid choice: 'padded'" in err and "'packed'" in err


def test_torchrun_and_pytest_take_packed_with_the_shared_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert dist_args(["--recipe", "a:b", "--batch-format", "packed"]).batch_format == "packed"
    with pytest.raises(SystemExit):
        dist_args(["--recipe", "a:b", "--batch-format", "padded"])
    assert "invalid choice: 'padded'" in capsys.readouterr().err

    class Group:
        def __init__(self) -> None:
            self.options: dict[str, dict[str, Any]] = {}

        def addoption(self, *names: str, **kwargs: Any) -> None:
            self.options[names[0]] = kwargs

    class Parser:
        group = Group()

        def getgroup(self, *_: Any) -> Group:
            return self.group

        def addini(self, *_: Any, **__: Any) -> None:
            pass

    parser = Parser()
    pytest_addoption(parser)  # type: ignore[arg-type]
    declared = parser.group.options["--batch-format"]
    assert (tuple(declared["choices"]), declared["help"]) == (("harness", "hf", "packed"), BATCH_FORMAT_HELP)
    argparse_side = argparse.ArgumentParser()
    argparse_side.add_argument("--batch-format", **declared)
    assert argparse_side.parse_args(["--batch-format", "packed"]).batch_format == "packed"
