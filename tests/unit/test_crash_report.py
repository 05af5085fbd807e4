"""A recipe's crash said once: the user's frame, not torch's; a known fix; one block per distinct exception."""

from __future__ import annotations

import pytest

from harness.battery.judge.crash_hints import HINTS, hint
from harness.battery.judge.crash_report import every_rank_raised, grouped, parse
from harness.battery.judge.verdict import FAIL, Verdict
from harness.distributed.errors import LaunchError

TORCH = "/venv/lib/python3.11/site-packages/torch/nn/functional.py"
HARNESS = __import__("harness").__file__.rsplit("/", 1)[0]


def traceback_text(exception: str, *inner: tuple[str, int, str, str]) -> str:
    """A rank's traceback through the harness's rank program into ``inner`` frames (outermost first)."""
    frames = [(f"{HARNESS}/distributed/rank.py", 200, "rank_main", "message = ('ok', fn(*args))"),
              (f"{HARNESS}/battery/rank_program.py", 144, "rank_body", "out = recipe.backward_window(ddp, mine)"),
              *inner]
    body = "".join(f'  File "{f}", line {n}, in {fn}\n    {src}\n    ^^^^^^\n' for f, n, fn, src in frames)
    return f"Traceback (most recent call last):\n{body}{exception}\n"


USER = ("/home/me/train/loop.py", 7, "backward_window", "F.cross_entropy(logits, labels, ignore_index=-1)")
IN_TORCH = (TORCH, 3555, "cross_entropy", "return torch._C._nn.cross_entropy_loss(")
OUT_OF_BOUNDS = "IndexError: Target -100 is out of bounds."


def test_the_culprit_is_the_users_line_not_torchs() -> None:
    """The innermost frame outside the harness, torch and the standard library: the user's call of the loss."""
    crash = parse(traceback_text(OUT_OF_BOUNDS, USER, IN_TORCH), rank=0)
    assert crash is not None
    assert OUT_OF_BOUNDS == crash.exception
    assert ["/home/me/train/loop.py"] == [f.file for f in crash.frames]
    text = "\n".join(crash.lines())
    assert "/home/me/train/loop.py:7, in backward_window" in text and "ignore_index=-1" in text
    assert "functional.py" not in text


def test_a_library_frame_comes_with_the_users_frame_that_called_it() -> None:
    """transformers' loss raising: its frame, and the user's own frame that called into it."""
    library = ("/venv/lib/python3.11/site-packages/transformers/loss/loss_utils.py", 30, "ForCausalLMLoss",
               "loss = fixed_cross_entropy(logits, shift_labels)")
    crash = parse(traceback_text(OUT_OF_BOUNDS, USER, library, IN_TORCH))
    assert crash is not None
    assert [USER[0], library[0]] == [f.file for f in crash.frames]


def test_a_traceback_wholly_inside_the_harness_has_no_culprit() -> None:
    """Negative control: no frame of the user's to name, rather than a wrong one."""
    crash = parse(traceback_text("RuntimeError: boom", IN_TORCH))
    assert crash is not None and () == crash.frames
    assert parse("died from SIGKILL") is None


@pytest.mark.parametrize(("real", "unrelated"), [
    (OUT_OF_BOUNDS, "IndexError: index 5 is out of bounds for dimension 0 with size 4"),
    ("RuntimeError: Expected to have finished reduction in the prior iteration before starting a new one. This error "
     "indicates that your module has parameters that were not used in producing loss.",
     "RuntimeError: Expected all tensors to have finished loading"),
    ("RuntimeError: result type Float can't be cast to the desired output type Long",
     "RuntimeError: result type Float can't be cast to the desired output type Int8"),
    ("RuntimeError: element 0 of tensors does not require grad and does not have a grad_fn",
     "RuntimeError: element 0 of tensors is not contiguous"),
    ("RuntimeError: Trying to backward through the graph a second time (or directly access saved tensors after they "
     "have already been freed).", "RuntimeError: Trying to allocate 2 GiB"),
    ("AttributeError: 'dict' object has no attribute 'inputs'", "AttributeError: 'Model' object has no attribute 'x'"),
    ("RuntimeError: Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!",
     "RuntimeError: Expected all tensors to be contiguous"),
])
def test_each_known_crash_gets_its_hint_and_an_unrelated_text_none(real: str, unrelated: str) -> None:
    """Every hint matches a real exception text and not a near miss (one case per entry of HINTS)."""
    assert hint(real) is not None
    assert hint(unrelated) is None


def test_every_hint_has_a_case_above() -> None:
    """The parametrization above covers each entry of the catalog."""
    assert 7 == len(HINTS)


def test_the_wrong_ignore_index_hint_says_what_to_pass() -> None:
    """The hint names -100 and the option to pass, the words of the user's code."""
    assert "ignore_index=-100" in (hint(OUT_OF_BOUNDS) or "")


def crash_verdict(scenario: str, world: int, details: str, check: str = "parity") -> Verdict:
    return Verdict(check, "r:recipe", scenario, world, "fp32", FAIL, f"check {check} FAILED: the run crashed",
                   cause="crash", details=f"rank 0 of {world} raised\n--- rank 0 ---\n{details}")


def test_the_same_exception_from_many_cases_is_printed_once_with_its_count() -> None:
    """Three cases, two checks each: one block, 3 cases, their world sizes and scenarios."""
    text = traceback_text(OUT_OF_BOUNDS, USER, IN_TORCH)
    verdicts = [crash_verdict(s, w, text, check) for s, w in (("uneven", 1), ("uneven", 2), ("long", 2))
                for check in ("parity", "hygiene")]
    said = grouped(verdicts)
    assert 1 == sum("raised in" in ln for ln in said), said
    assert "the recipe raised in 3 cases (W=1,2; scenarios uneven,long; 6 verdicts):" == said[0]
    assert 1 == sum(OUT_OF_BOUNDS in ln for ln in said)


def test_two_different_exceptions_are_two_blocks() -> None:
    """Negative control: another message, or the same message from another line, is not merged."""
    first = traceback_text(OUT_OF_BOUNDS, USER, IN_TORCH)
    other_line = traceback_text(OUT_OF_BOUNDS, (USER[0], 9, *USER[2:]), IN_TORCH)
    other_message = traceback_text("KeyError: 'labels'", USER)
    said = grouped([crash_verdict("uneven", 1, first), crash_verdict("uneven", 2, other_line),
                    crash_verdict("long", 1, other_message)])
    assert 3 == sum("raised in 1 case " in ln for ln in said), said


def test_ranks_that_raised_the_same_exception_can_go_on_and_a_collective_failure_cannot() -> None:
    """Under torchrun --battery-keep-going goes on only when every rank raised the recipe's own exception."""
    same = traceback_text(OUT_OF_BOUNDS, USER, IN_TORCH)
    lost = traceback_text("RuntimeError: Connection closed by peer", IN_TORCH)
    assert every_rank_raised(LaunchError("raised", [0, 1], {0: same, 1: same}, "x"), 2)
    assert not every_rank_raised(LaunchError("raised", [0, 1], {0: same, 1: lost}, "x"), 2)
    assert not every_rank_raised(LaunchError("raised", [0], {0: same}, "x"), 2)
    assert not every_rank_raised(LaunchError("deadline", [0, 1], {0: same, 1: same}, "x"), 2)
