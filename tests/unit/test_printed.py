"""What the ranks printed over a battery: each distinct line once, with how many ranks and launches printed it."""

from __future__ import annotations

import pytest

from harness.battery.launch import printed
from harness.battery.launch.printed import SHOWN, Printed, collecting, record, start, stop


def test_a_line_every_rank_of_every_launch_printed_is_one_line_with_its_counts() -> None:
    """Two launches of 2 and 3 ranks: 5 ranks in 2 launches; a library warning with a time stamp counts as one."""
    printed = Printed()
    warn = "[W1201 10:45:{:02d}.647622935 reducer.cpp:1529] Warning: find_unused_parameters=True was specified"
    printed.add({0: "hello from my step\n" + warn.format(1), 1: "hello from my step\nhello from my step\n"})
    printed.add({r: f"hello from my step\n{warn.format(r + 2)}\n" for r in range(3)})
    assert ["[printed by 5 ranks in 2 launches] hello from my step",
            "[printed by 4 ranks in 2 launches] [W reducer.cpp:1529] Warning: find_unused_parameters=True was "
            "specified"] == printed.lines()


def test_past_the_cap_the_rest_is_counted_and_every_line_is_there_uncapped() -> None:
    """The end-of-battery block shows SHOWN lines and how many more; lines(None) gives them all (-v)."""
    printed = Printed()
    printed.add({0: "\n".join(f"line {i}" for i in range(SHOWN + 3))})
    capped = printed.lines()
    assert SHOWN + 1 == len(capped)
    assert "3 more distinct lines: -v shows them" == capped[-1]
    assert SHOWN + 3 == len(printed.lines(None))


def test_different_lines_are_not_merged() -> None:
    """Negative control: two different prints stay two lines."""
    printed = Printed()
    printed.add({0: "loss 1.0\n", 1: "loss 2.0\n"})
    assert 2 == len(printed.lines())


def test_a_battery_inside_a_collecting_session_collects_its_own_and_the_session_resumes() -> None:
    """start/stop nest: the inner collection gets the launch; verbose relays (negative control); then the outer."""
    outer = start(verbose=False)
    inner = start(verbose=False)
    record({0: "inner\n"})
    assert ["[printed by 1 rank in 1 launch] inner"] == inner.lines()
    stop(inner)
    start(verbose=True)
    assert not collecting()
    stop(Printed())
    assert collecting()
    record({0: "outer\n"})
    assert "[printed by 1 rank in 1 launch] outer" in stop(outer)
    assert "inner" not in outer.block()


def test_a_workers_counts_merge_into_the_controllers() -> None:
    """Under xdist each worker sends its counts; the controller adds them."""
    a, b = Printed(), Printed()
    a.add({0: "hi\n"})
    b.add({0: "hi\n", 1: "hi\n"})
    a.merge(b.as_dict())
    assert ["[printed by 3 ranks in 2 launches] hi"] == a.lines()


def test_a_warning_and_its_source_line_are_one_message() -> None:
    """Python prints a warning's source line, indented, under it: counted apart, ``  warnings.warn(`` would be a
    message of its own from every library that warns."""
    text = ("/x/accelerate/state.py:279: UserWarning: OMP_NUM_THREADS unset\n  warnings.warn(\n"
            "hello\n  indented after a plain line\n")
    assert ["/x/accelerate/state.py:279: UserWarning: OMP_NUM_THREADS unset", "hello",
            "  indented after a plain line"] == printed.messages(text)


def test_a_constructor_s_print_in_the_battery_s_process_is_said_once_with_its_count(
        capsys: pytest.CaptureFixture[str]) -> None:
    """nanoGPT's GPT prints its parameter count when built: the probe and the reference build it many times in the
    battery's own process, and the collection says the line once with how often; with nothing collecting, the print
    goes through as it was (the negative control)."""
    from harness.battery.launch.printed import building

    relaying = start(True)  # -v: nothing collects, output goes through
    with building():
        print("number of parameters: 0.03M")
    stop(relaying)
    assert "number of parameters: 0.03M" in capsys.readouterr().out
    said = start(False)
    for _ in range(3):
        with building():
            print("number of parameters: 0.03M")
    block = stop(said)
    assert "" == capsys.readouterr().out
    assert "[printed 3 times building the model in the battery's process] number of parameters: 0.03M" in block
