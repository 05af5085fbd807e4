"""The in-code audit in one process: a loop the harness did not write, watched by global hooks, judged against the
single-device reference through the diagnosis. The correct loop passes; the loop that divides each microbatch's mean
loss by the accumulation steps fails with the per-microbatch-mean reading and its fix; what the audit cannot read yet
is named, never judged."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support.audit_models import HFLike, accumulate, batch
from torch import nn

from harness.audit import watch
from harness.core.microbatch import IGNORE_INDEX
from harness.data.config import Config
from harness.model import build_model

WINDOWS = [[batch([9, 4], 1), batch([17, 12, 3], 2)], [batch([6], 3), batch([11, 10], 4)]]


def train(model: nn.Module, windows: list[list[dict[str, torch.Tensor]]], right: bool, step: bool = True) -> None:
    """The loop under audit: SGD, two microbatches per step. ``right``: each microbatch's loss sum over the window's
    token count; else its mean loss over the accumulation steps."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for mbs in windows:
        accumulate(model, opt, mbs, right, step)


def test_the_right_loop_passes_every_window() -> None:
    with watch(windows=2) as audit:
        train(HFLike(), WINDOWS, right=True)
    verdict = audit.verdict()
    assert verdict.passed, str(verdict)
    assert 2 == str(verdict).count("parity PASSED")


def test_a_mean_per_microbatch_fails_with_its_reading_and_fix() -> None:
    with watch(windows=2) as audit:
        train(HFLike(), WINDOWS, right=False)
    verdict = audit.verdict()
    assert not verdict.passed and verdict.diagnosis is not None, str(verdict)
    assert "per_microbatch_mean" == verdict.diagnosis.signature.name
    assert "fix: divide each microbatch's loss sum by the window's supervised count" in str(verdict)


def test_balanced_windows_pass_a_wrong_loop_and_say_what_they_could_not_show() -> None:
    """Every microbatch of the same token count: a mean per microbatch is then the token mean, parity holds, and the
    verdict says which mistake these windows could not show (the unbalanced windows above are its control: no such
    line)."""
    balanced = [[batch([8, 8], 5), batch([8, 8], 6)]]
    with watch(windows=1) as audit:
        train(HFLike(), balanced, right=False)
    verdict = audit.verdict()
    assert verdict.passed, str(verdict)
    assert "could not show: every microbatch held the same token count (14 in window 0)" in str(verdict)
    with watch(windows=1) as audit:
        train(HFLike(), WINDOWS, right=True)
    assert "could not show" not in str(audit.verdict())


def test_skip_lets_steps_pass_before_the_audited_window() -> None:
    with watch(windows=1, skip=1) as audit:
        train(HFLike(), WINDOWS, right=True)
    assert 2 == audit.steps and 1 == len(audit.windows)
    assert 2 == len(audit.windows[0].calls) and audit.windows[0].calls[0].kwargs["input_ids"].shape == (1, 6)
    assert audit.verdict().passed


def test_a_left_padded_batch_is_replayed_as_the_script_called_it() -> None:
    """The reference calls the model with the call's own arguments (its attention_mask too), so padding on the left
    is judged like any other; the wrong loop on the same batches is its control."""
    windows = [[batch([9, 4], 1, left=True), batch([5, 2], 2, left=True)]]
    for right in (True, False):
        with watch(windows=1) as audit:
            train(HFLike(), windows, right=right)
        assert right == audit.verdict().passed, str(audit.verdict())


@pytest.mark.parametrize(("what", "said"), [
    ("no_labels", "called without labels"),
    ("no_step", "no optimizer step was recorded"),
])
def test_what_the_audit_cannot_read_is_named_and_not_judged(what: str, said: str) -> None:
    windows = WINDOWS
    with watch(windows=1) as audit:
        if what == "no_labels":
            model = HFLike()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            model(input_ids=WINDOWS[0][0]["input_ids"]).logits.sum().backward()
            opt.step()
        else:
            train(HFLike(), windows, right=True, step=what != "no_step")
    verdict = audit.verdict()
    assert not verdict.passed and verdict.diagnosis is None
    assert said in str(verdict), str(verdict)


def test_the_hooks_are_gone_after_the_block() -> None:
    with watch(windows=1) as audit:
        pass
    train(HFLike(), WINDOWS, right=True)
    assert 0 == audit.steps and audit.model is None


def test_bad_arguments_name_the_value_and_the_fix() -> None:
    with pytest.raises(ValueError, match="windows=0 must be at least 1"):
        watch(windows=0).__enter__()
    with pytest.raises(ValueError, match="skip=-1 must be 0 or more"):
        watch(skip=-1).__enter__()


def test_a_judging_that_fails_is_said_and_still_reaches_the_end(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's judging raising (a model the reference cannot run) writes a verdict that says so, and finish returns
    (under --continue) rather than leaving the other ranks at the barrier; its control: a record that judges."""
    from harness.audit import capture, evidence
    from harness.audit.watcher import Audit

    monkeypatch.setenv(capture.CONTINUE_ENV, "1")
    capture.finish(Audit(1, 0), tmp_path, [])
    assert "no optimizer step was recorded" in (tmp_path / capture.VERDICT).read_text()

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the reference's forward failed")

    monkeypatch.setattr(evidence, "judge", broken)
    capture.finish(Audit(1, 0), tmp_path, [])
    said = (tmp_path / capture.VERDICT).read_text()
    assert "not judged: judging the record failed: RuntimeError: the reference's forward failed" in said


class GPTLike(nn.Module):
    """nanoGPT's calling convention: ``model(X, Y)`` with aligned targets (-1 ignored) returns ``(logits, loss)``."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.lm = build_model(Config(dropout=0.0), seed=4)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.drop(self.lm(idx))
        assert targets is not None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)


def gpt_windows(seed: int = 7, balanced: bool = False) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Two windows of two microbatches (X, Y): Y aligned, each row keeping a drawn number of its targets (all of them
    when ``balanced``), the rest -1."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        window = []
        for _ in range(2):
            x = torch.randint(1, 32, (2, 10), generator=g)
            y = torch.randint(1, 32, (2, 10), generator=g)
            if not balanced:
                for row, keep in zip(y, torch.randint(2, 10, (2,), generator=g)):
                    row[int(keep):] = -1
            window.append((x, y))
        out.append(window)
    return out


def gpt_train(model: nn.Module, windows: list[list[tuple[torch.Tensor, torch.Tensor]]], mistake: str | None = None,
              clip: float | None = None, autocast: bool = False) -> None:
    """nanoGPT's loop: ``mistake`` ``accumulation_mean`` is its own ``loss / gradient_accumulation_steps``; with
    ``clip``, ``clip_grad_norm_`` over every parameter (``per_tensor``: each tensor clipped alone); ``autocast``: each
    forward under bf16 autocast, as nanoGPT's ``ctx``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for mbs in windows:
        total = sum(int((y != -1).sum()) for _, y in mbs)
        for x, y in mbs:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                _, loss = model(x, y)
            loss = loss / len(mbs) if mistake == "accumulation_mean" else loss * int((y != -1).sum()) / total
            loss.backward()
        if clip is not None:
            params = list(model.parameters())
            for group in ([[p] for p in params] if mistake == "per_tensor" else [params]):
                torch.nn.utils.clip_grad_norm_(group, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_aligned_targets_as_the_second_argument_are_read_and_judged() -> None:
    """nanoGPT's ``model(X, Y)``: the targets are read as aligned (-1 ignored) without being told; its own
    ``loss / gradient_accumulation_steps`` over microbatches of different counts is the control that fails."""
    with watch(windows=2) as audit:
        gpt_train(GPTLike(), gpt_windows())
    verdict = audit.verdict()
    assert verdict.passed, str(verdict)
    assert "labels read: the targets the model is given, aligned (negative ignored)" in str(verdict)
    with watch(windows=2) as audit:
        gpt_train(GPTLike(), gpt_windows(), mistake="accumulation_mean")
    verdict = audit.verdict()
    assert verdict.diagnosis is not None and "per_microbatch_mean" == verdict.diagnosis.signature.name, str(verdict)


def labels_of_second(args: tuple[object, ...], kwargs: dict[str, object]) -> torch.Tensor:
    """A ``--labels`` function: the call's second argument."""
    y = args[1]
    assert isinstance(y, torch.Tensor)
    return y


def test_labels_named_by_a_function_and_wrong_label_modes_are_said() -> None:
    with watch(windows=1) as audit:
        gpt_train(GPTLike(), gpt_windows()[:1])
    assert audit.verdict(labels=f"{__name__}:labels_of_second").passed
    assert "called without a labels= tensor" in str(audit.verdict(labels="hf"))
    assert "cannot import it" in str(audit.verdict(labels="nowhere.at_all:fn"))
    with pytest.raises(ValueError, match="give auto, hf, aligned or PKG"):
        audit.verdict(labels="shifted")


def test_a_clip_is_judged_by_its_norm_and_a_clip_per_tensor_is_named() -> None:
    """The reference is clipped as ``clip_grad_norm_`` clips (here it engages: max_norm 0.05); each tensor clipped
    alone returns the last tensor's norm and leaves another gradient: both are named."""
    with watch(windows=2) as audit:
        gpt_train(GPTLike(), gpt_windows(), clip=0.05)
    verdict = audit.verdict()
    assert verdict.passed, str(verdict)
    assert 2 == str(verdict).count("clipping PASSED") and "(max_norm 0.05, engaged)" in str(verdict)
    with watch(windows=2) as audit:
        gpt_train(GPTLike(), gpt_windows(), mistake="per_tensor", clip=0.05)
    verdict = audit.verdict()
    assert not verdict.passed and "clipping FAILED" in str(verdict), str(verdict)
    assert "the last tensor's norm" in str(verdict)
    assert verdict.diagnosis is not None and "clipped_per_tensor" == verdict.diagnosis.signature.name


def test_dropout_is_off_in_the_windows_and_restored_after() -> None:
    model = GPTLike(dropout=0.5)
    with watch(windows=2) as audit:
        gpt_train(model, gpt_windows())
    verdict = audit.verdict()
    assert verdict.passed and "dropout was off in the audited windows (1 probabilities" in str(verdict), str(verdict)
    assert 0.5 == model.drop.p


class Rows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Rows of one length, every token supervised: balanced batches."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(1, 32, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def loader_train(model: nn.Module, right: bool) -> None:
    """A loop over a DataLoader: two microbatches per step; each counted after the loader yields it."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = iter(torch.utils.data.DataLoader(Rows(), batch_size=2, generator=torch.Generator().manual_seed(0)))
    for _ in range(2):
        accumulate(model, opt, [next(batches), next(batches)], right)


def test_unbalance_makes_a_mean_per_microbatch_visible_on_balanced_batches() -> None:
    """Balanced batches hide a mean per microbatch (the verdict says so); ``unbalance`` masks a drawn suffix of each
    row's labels in the batches the DataLoader yields, and the same wrong loop fails with its reading. The right
    loop passes under the same masking (its counts are taken from the masked batches)."""
    with watch(windows=2) as audit:
        loader_train(HFLike(), right=False)
    verdict = audit.verdict()
    assert verdict.passed and "could not show: every microbatch held the same token count" in str(verdict)
    with watch(windows=2, unbalance=3) as audit:
        loader_train(HFLike(), right=False)
    verdict = audit.verdict()
    assert verdict.diagnosis is not None and "per_microbatch_mean" == verdict.diagnosis.signature.name, str(verdict)
    assert "--unbalance: each row of the 4 batches" in str(verdict) and "(seed 3)" in str(verdict)
    with watch(windows=2, unbalance=3) as audit:
        loader_train(HFLike(), right=True)
    assert audit.verdict().passed, str(audit.verdict())
    with watch(windows=2, unbalance=3) as audit:  # no DataLoader to mask: judged on its own counts, and told so
        gpt_train(GPTLike(), gpt_windows())
    assert audit.verdict().passed and "--unbalance found no batch to mask" in str(audit.verdict())


def test_a_capture_over_its_bound_is_refused_and_not_judged() -> None:
    with watch(windows=2, max_capture_mb=0.01) as audit:
        train(HFLike(), WINDOWS, right=True)
    verdict = audit.verdict()
    assert not verdict.passed and "not judged: the capture reached" in str(verdict), str(verdict)
    assert "over --max-capture-mb=0.01" in str(verdict)


def test_a_declared_sequence_mean_is_judged_against_its_own_reference() -> None:
    """A loop that averages each row's mean over the window's rows passes under ``objective="sequence_mean"`` and
    fails under the default token mean (rows of different counts)."""
    def seq_train(model: nn.Module) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for mbs in WINDOWS:
            rows = sum(b["input_ids"].shape[0] for b in mbs)
            for b in mbs:
                logits = model(**b).logits[:, :-1]
                target = b["labels"][:, 1:]
                per = F.cross_entropy(logits.transpose(1, 2), target, ignore_index=IGNORE_INDEX, reduction="none")
                ((per.sum(1) / (target != IGNORE_INDEX).sum(1)).sum() / rows).backward()
            opt.step()
            opt.zero_grad()

    with watch(windows=2) as audit:
        seq_train(HFLike())
    assert audit.verdict(objective="sequence_mean").passed, str(audit.verdict(objective="sequence_mean"))
    assert not audit.verdict().passed
    with pytest.raises(ValueError, match="the audit judges token_mean"):
        audit.verdict(objective="median")


def test_a_mesh_that_is_not_data_parallel_is_refused_with_its_reason() -> None:
    """Parameters on a (dp, tp) mesh: the tp ranks share a batch, so the audit refuses and names the mesh; its
    controls are a dp_replicate x dp_shard mesh over every rank and a plain model, which it judges."""
    from harness.audit.models import mesh_refusal

    def on(names: tuple[str, ...], shape: tuple[int, ...]) -> nn.Module:
        model = nn.Linear(2, 2, bias=False, device="meta")  # no draw from the global generator
        mesh = SimpleNamespace(mesh_dim_names=names, shape=shape, ndim=len(shape), size=lambda: int(torch.tensor(shape)
                                                                                                  .prod()))
        model.weight.device_mesh = mesh  # type: ignore[attr-defined]
        return model

    said = mesh_refusal(on(("dp", "tp"), (2, 2)), world=4)
    assert said is not None and "device mesh (dp=2 x tp=2) over 4 of 4 ranks" in said
    assert "python -m harness battery --recipe ... --mesh" in said
    assert mesh_refusal(on(("dp_replicate", "dp_shard"), (2, 2)), world=4) is None
    assert "over 2 of 4 ranks" in str(mesh_refusal(on(("dp_shard",), (2,)), world=4))
    assert mesh_refusal(nn.Flatten(), world=4) is None


def test_a_loop_under_bf16_autocast_is_judged_by_the_noise_of_its_own_replay() -> None:
    """Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` fixed float32 tolerances would fail the right loop; the
    bound is 4x the noise of the correct computation replayed under the same autocast. The right loop passes with the
    bound printed; nanoGPT's loss / gradient_accumulation_steps over unbalanced microbatches fails it."""
    def under_autocast(mistake: str | None) -> Any:
        with watch(windows=2) as audit:
            gpt_train(GPTLike(), gpt_windows(), mistake=mistake, autocast=True)
        return audit.verdict()

    right = under_autocast(None)
    assert right.passed, str(right)
    assert 2 == str(right).count("under bfloat16 autocast, 4 x the noise"), str(right)
    assert "could not show: window 1 ran under bfloat16 autocast" in str(right)  # its microbatches: 14 and 14
    with watch(windows=2) as audit, torch.autocast("cpu", dtype=torch.bfloat16):  # the whole loop: a stale cache
        gpt_train(GPTLike(), gpt_windows())
    assert "problem: optimizer.step() ran inside a bfloat16 autocast region" in str(audit.verdict())
    assert not audit.verdict().passed
    wrong = under_autocast("accumulation_mean")
    assert not wrong.passed and "parity FAILED: relative L2 error" in str(wrong), str(wrong)


def not_a_model() -> str:
    return "a string"


def test_a_model_factory_builds_the_reference_and_a_bad_one_is_named() -> None:
    """``model="pkg.mod:factory"`` builds the reference's model (its weights are the window's); a factory that does
    not return a module, and one that does not import, are named and not judged."""
    with watch(windows=1) as audit:
        train(HFLike(), WINDOWS, right=True)
    assert audit.verdict(model=f"{__name__}:HFLike").passed
    assert "returned str, not a torch.nn.Module" in str(audit.verdict(model=f"{__name__}:not_a_model"))
    assert "--model nowhere:at_all: cannot import it" in str(audit.verdict(model="nowhere:at_all"))


def test_an_evaluation_call_inside_a_window_is_not_one_of_its_microbatches() -> None:
    """A forward under ``torch.no_grad()`` between the microbatches (a loop that logs a validation loss) trains
    nothing, so the reference leaves it out and the right loop passes; its control is the same batch called with
    gradients on and its loss dropped, which the audit does count, and which fails."""
    def loop(graded: bool) -> Any:
        model, held_out = HFLike(), batch([14, 9], 9)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with watch(windows=1) as audit:
            mbs = WINDOWS[0]
            n = sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in mbs)
            for b in mbs:
                with torch.set_grad_enabled(graded):
                    model(**held_out)
                count = int((b["labels"][:, 1:] != IGNORE_INDEX).sum())
                (model(**b).loss * count / n).backward()
            opt.step()
        return audit.verdict()

    assert loop(graded=False).passed, str(loop(graded=False))
    assert not loop(graded=True).passed
