"""What the probe finds about a user's model before any rank starts (:mod:`harness.battery.facts`), and the drawn
layouts keeping to it; one process, no ranks."""

from __future__ import annotations

import torch
from hypothesis import given, settings

from harness.battery import facts as f
from harness.battery.layouts import Layout, _candidates, fits, layouts
from harness.battery.spec import ModelSpec
from harness.testing.hypothesis_profiles import load_profile

load_profile()


def _facts(name: str, batch_format: str = "harness") -> f.ModelFacts:
    return f.probe_model(ModelSpec(f"user_recipes.zoo:{name}", batch_format))


def test_batchnorm_needs_two_values_per_channel_and_its_running_statistics_are_not_read_back() -> None:
    """One row of one position is refused with BatchNorm's own error; the running statistics are reported as
    written, not read."""
    found = _facts("BatchNormLM")
    assert 2 == found.min_positions
    assert not found.allows(1, 1) and found.allows(1, 2) and found.allows(2, 1)
    assert any("Expected more than 1 value per channel" in r for r in found.refused)
    assert ("norm.running_mean", "norm.running_var", "norm.num_batches_tracked") == found.buffers_changed
    assert not found.stateful
    assert any("without reading them back" in n for n in found.notes())


def test_a_parameter_no_forward_uses_is_named_before_any_rank_starts() -> None:
    """The value head requires grad and gets no gradient: both its tensors are named, with DDP's remedy."""
    found = _facts("UnusedHeadLM")
    assert ("value_head.weight", "value_head.bias") == found.unused
    (note,) = found.notes()
    assert "value_head.weight" in note and "find_unused_parameters=True" in note


def test_a_forward_that_reads_the_buffer_it_updates_is_called_stateful() -> None:
    """The same microbatch twice gives two losses: the note says the reference is another computation."""
    found = _facts("CountingLM")
    assert ("calls",) == found.buffers_changed and found.stateful
    assert any("reads them back" in n and "reference" in n for n in found.notes())


def test_a_short_position_table_gives_the_longest_row_the_model_takes() -> None:
    """64 learned positions: rows of up to 64 positions run, longer ones are refused with the model's IndexError."""
    found = _facts("ShortPositionsLM")
    assert 64 == found.max_len
    assert found.allows(4, 64) and not found.allows(1, 65)
    assert any("IndexError" in r for r in found.refused)


def test_the_hf_format_feeds_one_more_position_so_batchnorm_takes_a_one_token_row() -> None:
    """Under hf a one-position harness microbatch is two input positions: BatchNorm has two values per channel."""
    assert 1 == _facts("BatchNormLM", "hf").min_positions


def test_a_model_the_battery_takes_as_it_is_has_no_notes() -> None:
    """The causal convolution model of the user recipes: no unused parameter, no buffer, every shape."""
    found = f.probe_model(ModelSpec("user_recipes.models:make_model"))
    assert () == found.notes() and 1 == found.min_positions and found.max_len is None


def test_the_probe_leaves_the_callers_thread_count_and_random_state_alone() -> None:
    """It computes with the ranks' one thread and restores the caller's count and generators."""
    threads, state = torch.get_num_threads(), torch.get_rng_state()
    f.probe_model.cache_clear()
    _facts("BatchNormLM")
    assert threads == torch.get_num_threads()
    assert torch.equal(state, torch.get_rng_state())


def test_rank_threads_sets_one_thread_inside_and_restores_after() -> None:
    """The reference, the logged-loss truth and the diagnosis run with the ranks' thread count."""
    before = torch.get_num_threads()
    with f.rank_threads():
        assert f.THREADS == torch.get_num_threads()
    assert before == torch.get_num_threads()


BATCHNORM = f.ModelFacts("user_recipes.zoo:BatchNormLM", "harness", min_positions=2, max_len=40)


@settings(max_examples=60, deadline=None)
@given(layout=layouts(facts=BATCHNORM))
def test_drawn_layouts_hold_only_shapes_the_model_runs(layout: Layout) -> None:
    """No drawn microbatch is one row of one position under BatchNorm, or longer than the model takes; shrinking
    keeps to it too."""
    assert fits(layout, BATCHNORM)


def test_fits_rejects_a_one_row_one_position_microbatch_for_batchnorm() -> None:
    """The negative control of the property above: the shape BatchNorm refuses is recognized as such."""
    one_token = ((2, 0),)  # a row of 2 tokens: 1 position
    layout = Layout(2, (((one_token,), (((5, 0), (3, 1)),)),))
    assert not fits(layout, BATCHNORM)
    assert fits(layout, None)
    # Shrinking a fitting layout to one row per microbatch would make that shape: the candidates include it.
    two_rows = Layout(1, (((((2, 0), (2, 0)),),),))
    assert fits(two_rows, BATCHNORM)
    assert not all(fits(c, BATCHNORM) for c in _candidates(two_rows))


def test_the_probe_runs_with_gradients_on_so_reentrant_checkpointing_does_not_warn() -> None:
    """A model checkpointed with use_reentrant=True warns "None of the inputs have requires_grad=True" only when
    run without gradients: the probe runs as the ranks will, so a correct run starts without that false alarm."""
    import warnings

    from harness.battery.facts import probe

    f.probe_model.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe("user_recipes.models:SharedBlockCheckpointed")
    assert not [w for w in caught if "requires_grad" in str(w.message)]
