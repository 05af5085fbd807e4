"""The launcher's relay of what the ranks printed: one line per distinct line, prefixed with the ranks, capped."""

from __future__ import annotations

import io

from harness.distributed import output


def test_identical_lines_from_several_ranks_are_merged_in_order_of_first_appearance() -> None:
    """Ranks are read line by line in turn: a line takes its place where a rank first printed it."""
    texts = {0: "a\nb\n", 1: "a\nc\nd\nb\n", 2: "a\n"}
    assert ["[ranks 0,1,2] a", "[ranks 0,1] b", "[rank 1] c", "[rank 1] d"] == output.merged(texts)


def test_torchs_rank_prefix_and_a_log_lines_time_stamp_do_not_make_lines_differ() -> None:
    """DDP's reducer warning from two ranks differs only in [rank<r>]: and its time: it is one line."""
    line = "[W1201 10:45:30.64762{} reducer.cpp:1529] Warning: find_unused_parameters=True was specified"
    texts = {0: "[rank0]:" + line.format(2935) + "\n", 1: "[rank1]:" + line.format(3101) + "\n"}
    assert ["[ranks 0,1] [W reducer.cpp:1529] Warning: find_unused_parameters=True was specified"] == (
        output.merged(texts))


def test_past_the_cap_the_rest_is_counted_and_where_to_find_it_is_said() -> None:
    """Distinct lines beyond max_lines become one line with their number."""
    lines = output.merged({0: "".join(f"line {i}\n" for i in range(7))}, max_lines=5)
    assert 6 == len(lines)
    assert "[rank 0] line 4" == lines[4]
    assert lines[5].startswith("... 2 more lines of rank output not shown") and "relay_output=False" in lines[5]


def test_nothing_printed_relays_nothing() -> None:
    """No rank output, no line on the stream (not even an empty one)."""
    stream = io.StringIO()
    output.relay({0: "", 1: "\n"}, stream)
    assert "" == stream.getvalue()
