"""Crash summaries keep the failing rank's exception type and message, with the lines naming a remedy or a culprit.

The tracebacks are verbatim from real 2-rank gloo runs through the launcher (torch 2.13 CPU; the rank body's file
renamed): DDP's error for a parameter unused in forward (the second iteration without ``find_unused_parameters``),
reentrant checkpointing of a block applied twice (``find_unused_parameters=True``), a chained exception, and a peer's
faulthandler stack at the deadline. ``tests/distributed/test_crash_summaries.py`` produces the first two for real.
A deadline's verdict names the phase the time ran out in, from the launcher's record of each rank.
"""

from __future__ import annotations

from harness.battery.judge.failed_runs import crash_summary, deadline_phase
from harness.distributed.errors import LaunchError

UNUSED_PARAM = (
    'Traceback (most recent call last):\n'
    '  File "/work/main/harness/distributed/rank.py", line 189, in rank_main\n'
    '    message = ("ok", fn(*args))\n'
    '                     ^^^^^^^^^\n'
    '  File "/home/user/project/train_step.py", line 21, in unused_param\n'
    '    m(torch.randn(2, 4)).sum().backward()\n'
    '    ^^^^^^^^^^^^^^^^^^^^\n'
    '  File "/work/main/.venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1778, '
    'in _wrapped_call_impl\n'
    '    return self._call_impl(*args, **kwargs)\n'
    '           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n'
    '  File "/work/main/.venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1789, '
    'in _call_impl\n'
    '    return forward_call(*args, **kwargs)\n'
    '           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n'
    '  File "/work/main/.venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py", line '
    '1886, in forward\n'
    '    inputs, kwargs = self._pre_forward(*inputs, **kwargs)\n'
    '                     ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n'
    '  File "/work/main/.venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py", line '
    '1775, in _pre_forward\n'
    '    if torch.is_grad_enabled() and self.reducer._rebuild_buckets():\n'
    '                                   ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n'
    'RuntimeError: Expected to have finished reduction in the prior iteration before starting a new '
    'one. This error indicates that your module has parameters that were not used in producing '
    'loss. You can enable unused parameter detection by passing the keyword argument '
    '`find_unused_parameters=True` to `torch.nn.parallel.DistributedDataParallel`, and by \n'
    'making sure all `forward` function outputs participate in calculating loss. \n'
    "If you already have done the above, then the distributed data parallel module wasn't able to "
    "locate the output tensors in the return value of your module's `forward` function. Please "
    'include the loss function and the structure of the return value of `forward` of your module '
    'when reporting this issue (e.g. list, dict, iterable).\n'
    'Parameter indices which did not receive grad for rank 1: 2 3\n'
    ' In addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG to either INFO or '
    'DETAIL to print out information about which particular parameters did not receive gradient on '
    'this rank as part of this error\n'
)
REENTRANT_TWICE = (
    'Traceback (most recent call last):\n'
    '  File "/work/main/harness/distributed/rank.py", line 189, in rank_main\n'
    '    message = ("ok", fn(*args))\n'
    '                     ^^^^^^^^^\n'
    '  File "/home/user/project/train_step.py", line 50, in reentrant_twice_iters\n'
    '    m(x).sum().backward()\n'
    '  File "/work/main/.venv/lib/python3.11/site-packages/torch/_tensor.py", line 623, in backward\n'
    '    torch.autograd.backward(\n'
    '  File "/work/main/.venv/lib/python3.11/site-packages/torch/autograd/__init__.py", line 395, '
    'in backward\n'
    '    _engine_run_backward(\n'
    '  File "/work/main/.venv/lib/python3.11/site-packages/torch/autograd/graph.py", line 979, in '
    '_engine_run_backward\n'
    '    return Variable._execution_engine.run_backward(  # Calls into the C++ engine to run the '
    'backward pass\n'
    '           '
    '^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n'
    '  File "/work/main/.venv/lib/python3.11/site-packages/torch/autograd/function.py", line 325, '
    'in apply\n'
    '    return user_fn(self, *args)\n'
    '           ^^^^^^^^^^^^^^^^^^^^\n'
    '  File "/work/main/.venv/lib/python3.11/site-packages/torch/utils/checkpoint.py", line 331, in '
    'backward\n'
    '    torch.autograd.backward(outputs_with_grad, args_with_grad)\n'
    '  File "/work/main/.venv/lib/python3.11/site-packages/torch/autograd/__init__.py", line 395, '
    'in backward\n'
    '    _engine_run_backward(\n'
    '  File "/work/main/.venv/lib/python3.11/site-packages/torch/autograd/graph.py", line 979, in '
    '_engine_run_backward\n'
    '    return Variable._execution_engine.run_backward(  # Calls into the C++ engine to run the '
    'backward pass\n'
    '           '
    '^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n'
    'RuntimeError: Expected to mark a variable ready only once. This error is caused by one of the '
    'following reasons: 1) Use of a module parameter outside the `forward` function. Please make '
    'sure model parameters are not shared across multiple concurrent forward-backward passes. or '
    'try to use _set_static_graph() as a workaround if this module graph does not change during '
    'training loop.2) Reused parameters in multiple reentrant backward passes. For example, if you '
    'use multiple `checkpoint` functions to wrap the same part of your model, it would result in '
    'the same set of parameters been used by different reentrant backward passes multiple times, '
    'and hence marking a variable ready multiple times. DDP does not support such use cases in '
    'default. You can try to use _set_static_graph() as a workaround if your module graph does not '
    'change over iterations.\n'
    'Parameter at index 1 with name block.bias has been marked as ready twice. This means that '
    'multiple autograd engine  hooks have fired for this particular parameter during this iteration.\n'
)
CHAINED = (
    'Traceback (most recent call last):\n'
    '  File "/home/user/project/train_step.py", line 91, in chained\n'
    '    {}["lr"]\n'
    '    ~~^^^^^^\n'
    "KeyError: 'lr'\n"
    '\n'
    'The above exception was the direct cause of the following exception:\n'
    '\n'
    'Traceback (most recent call last):\n'
    '  File "/work/main/harness/distributed/rank.py", line 189, in rank_main\n'
    '    message = ("ok", fn(*args))\n'
    '                     ^^^^^^^^^\n'
    '  File "/home/user/project/train_step.py", line 93, in chained\n'
    '    raise RuntimeError("the recipe\'s optimizer settings are incomplete: set lr in the config") '
    'from exc\n'
    "RuntimeError: the recipe's optimizer settings are incomplete: set lr in the config\n"
)
STACK = (
    "(still running when rank 0 failed; its stack)\n"
    "Current thread 0x00007f18241ccb80 (most recent call first):\n"
    '  File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3252 in '
    "all_reduce\n"
    '  File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper\n'
    '  File "/home/user/project/train_step.py", line 101 in exit_rank0\n'
    '  File "/work/main/harness/distributed/rank.py", line 189 in rank_main\n'
    '  File "/root/.pyenv/versions/3.11.7/lib/python3.11/multiprocessing/process.py", line 108 in run\n'
    '  File "<string>", line 1 in <module>\n'
)


def test_ddps_unused_parameter_error_keeps_the_option_and_the_parameter_indices() -> None:
    """The whole short exception block survives, not only its TORCH_DISTRIBUTED_DEBUG last line."""
    lines = crash_summary(UNUSED_PARAM)
    assert 'File "/work/main/.venv/lib/python3.11/site-packages/torch/nn/parallel/distributed.py", line 1775, ' \
           "in _pre_forward" == lines[0]
    assert lines[1].startswith("RuntimeError: Expected to have finished reduction in the prior iteration")
    assert "`find_unused_parameters=True`" in lines[1]
    assert "Parameter indices which did not receive grad for rank 1: 2 3" in lines
    assert lines[-1].startswith("In addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG")
    assert 6 == len(lines)


def test_reentrant_checkpointing_keeps_the_static_graph_remedy_and_the_parameter_name() -> None:
    """"Marked as ready twice" comes with DDP's reasons and _set_static_graph(), and names block.bias."""
    lines = crash_summary(REENTRANT_TWICE)
    assert lines[1].startswith("RuntimeError: Expected to mark a variable ready only once")
    assert "_set_static_graph()" in lines[1] and "reentrant backward passes" in lines[1]
    assert lines[2].startswith("Parameter at index 1 with name block.bias has been marked as ready twice")
    assert 3 == len(lines)


def test_a_long_exception_block_keeps_its_first_line_the_remedies_and_its_last_line() -> None:
    """Over the limit, a block keeps what names an option or a culprit and says how many lines it left out."""
    lines = crash_summary(UNUSED_PARAM, limit=3)
    assert lines[1].startswith("RuntimeError: Expected to have finished reduction") and "find_unused" in lines[1]
    assert "... (2 lines left out)" == lines[2]
    assert "Parameter indices which did not receive grad for rank 1: 2 3" == lines[3]
    assert lines[4].startswith("In addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG")
    assert 5 == len(lines)
    assert not any(ln.startswith("If you already have done the above") for ln in lines)


def test_a_chained_exception_shows_the_raised_one_and_its_innermost_cause() -> None:
    """The exception the rank raised, then "caused by" the first one in the chain, with its type."""
    assert [
        'File "/home/user/project/train_step.py", line 93, in chained',
        "RuntimeError: the recipe's optimizer settings are incomplete: set lr in the config",
        "caused by: KeyError: 'lr'",
    ] == crash_summary(CHAINED)


def test_what_the_launcher_said_before_a_traceback_is_kept() -> None:
    """A death reported with the peer's traceback after it keeps "died from ..." and the peer's exception."""
    text = "died from SIGABRT\n(rank 1 then raised:)\n" + CHAINED
    lines = crash_summary(text)
    assert ["died from SIGABRT", "(rank 1 then raised:)"] == lines[:2]
    assert "caused by: KeyError: 'lr'" == lines[-1]


def test_a_faulthandler_stack_gives_where_the_rank_was_newest_frame_first() -> None:
    """A stack (deadline, desync) has no exception: its header and its two newest frames."""
    assert [
        "(still running when rank 0 failed; its stack)",
        "Current thread 0x00007f18241ccb80 (most recent call first):",
        'File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3252 in '
        "all_reduce",
        'File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper',
    ] == crash_summary(STACK)


def test_a_plain_report_keeps_its_lines_and_an_empty_one_says_so() -> None:
    """Text without a traceback (a death with gloo's last words) is kept; nothing at all reads "(nothing reported)"."""
    text = ("died from SIGABRT\n(its last output:)\nterminate called after throwing an instance of "
            "'gloo::EnforceNotMet'\n  what():  [enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 8 vs 4. "
            "Received data size doesn't match expected size. Is there a distributed collective mismatch in your code?")
    lines = crash_summary(text)
    assert "died from SIGABRT" == lines[0]
    assert lines[-1].startswith("what():") and "collective mismatch" in lines[-1]
    assert ["(nothing reported)"] == crash_summary("\n  \n")


def _deadline(progress: dict[int, int | None], started: tuple[int, ...]) -> LaunchError:
    return LaunchError("deadline", sorted(progress), dict.fromkeys(progress, "(no stack written)"),
                       "deadline of 3 s passed", progress=progress, started=started, deadline=3.0)


def test_a_deadline_names_start_up_when_no_rank_function_started() -> None:
    """No rank past the rendezvous: the time ran out during start-up, not in the recipe."""
    assert deadline_phase(_deadline({0: None, 1: None}, ()), 2).startswith("during start-up")


def test_a_deadline_after_every_window_says_so() -> None:
    """Every window reported on every rank: what ran out was the run's end."""
    assert deadline_phase(_deadline({0: 1, 1: 1}, (0, 1)), 2).startswith("after the last window (all 2 finished")


def test_a_deadline_with_ranks_in_different_windows_names_each() -> None:
    """Ranks in different places are listed per place."""
    assert ("in window 1 of 3 (window 0 finished) on rank(s) [0]; in window 2 of 3 (window 1 finished) on rank(s) "
            "[1]") == deadline_phase(_deadline({0: 0, 1: 1}, (0, 1)), 3)
