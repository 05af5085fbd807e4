"""The in-code audit in one process: a loop the harness did not write, watched by global hooks, judged against the
single-device reference through the diagnosis. The correct loop passes; the loop that divides each microbatch's mean
loss by the accumulation steps fails with the per-microbatch-mean reading and its fix; what the audit cannot read yet
is named, never judged."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.audit import watch
from harness.core.microbatch import IGNORE_INDEX
from harness.data.config import Config
from harness.model import build_model


class HFLike(nn.Module):
    """A causal LM called the Hugging Face way: ``model(input_ids=..., attention_mask=..., labels=...)`` returns
    ``.logits`` and ``.loss``, the mean cross-entropy of the shifted labels."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = build_model(Config(dropout=0.0), seed=3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> SimpleNamespace:
        logits = self.lm(input_ids)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX)
        return SimpleNamespace(logits=logits, loss=loss)


def batch(lengths: list[int], seed: int, left: bool = False) -> dict[str, torch.Tensor]:
    """Right-padded rows (``left``: left-padded) of the given lengths, the padding labelled -100."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        where = slice(width - n, width) if left else slice(0, n)
        ids[i, where] = torch.randint(1, 32, (n,), generator=g)
        mask[i, where] = 1
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


WINDOWS = [[batch([9, 4], 1), batch([17, 12, 3], 2)], [batch([6], 3), batch([11, 10], 4)]]


def train(model: nn.Module, windows: list[list[dict[str, torch.Tensor]]], right: bool, step: bool = True) -> None:
    """The loop under audit: SGD, two microbatches per step. ``right``: each microbatch's loss sum over the window's
    token count; else its mean loss over the accumulation steps."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for mbs in windows:
        n = sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in mbs)
        for b in mbs:
            out = model(**b)
            count = int((b["labels"][:, 1:] != IGNORE_INDEX).sum())
            loss = out.loss * count / n if right else out.loss / len(mbs)
            loss.backward()
        if step:
            opt.step()
        opt.zero_grad()


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
    assert 2 == len(audit.windows[0].calls) and audit.windows[0].calls[0].input_ids.shape == (1, 6)
    assert audit.verdict().passed


@pytest.mark.parametrize(("what", "said"), [
    ("no_labels", "called without labels"),
    ("left_padding", "padded on the left"),
    ("no_step", "no optimizer step was recorded"),
])
def test_what_the_audit_cannot_read_is_named_and_not_judged(what: str, said: str) -> None:
    windows = WINDOWS
    if what == "left_padding":
        windows = [[batch([9, 4], 1, left=True), batch([5, 2], 2, left=True)]]
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
    from harness.audit.record import Record

    monkeypatch.setenv(capture.CONTINUE_ENV, "1")
    capture.finish(Record(1, 0), tmp_path, [])
    assert "no optimizer step was recorded" in (tmp_path / capture.VERDICT).read_text()

    def broken(*args: object) -> None:
        raise RuntimeError("the reference's forward failed")

    monkeypatch.setattr(evidence, "judge", broken)
    capture.finish(Record(1, 0), tmp_path, [])
    said = (tmp_path / capture.VERDICT).read_text()
    assert "not judged: judging the record failed: RuntimeError: the reference's forward failed" in said
