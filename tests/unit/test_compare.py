"""compare(): |got - ref| <= atol + rtol * |ref| per component, NaN always fails, and the report says by how much."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from harness.core.compare import (
    FLOAT32_TOLERANCE,
    assert_gradients_close,
    compare,
    flat_grad,
    max_abs_difference,
    tolerances,
)

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@pytest.fixture(params=list(DTYPES.values()), ids=list(DTYPES))
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    return request.param


def _ref(dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([1.0, -2.0, 0.0, 0.5], dtype=dtype)


class _TwoParams(nn.Module):
    """Parameters set by hand: no initializer, so the global RNG is never touched."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor([1.0, 2.0]))
        self.b = nn.Parameter(torch.tensor([[3.0, 4.0], [5.0, 6.0]]))


# --- tolerances ------------------------------------------------------------------------------------------------------


def test_float32_tolerances_are_the_seed_s() -> None:
    """float32 gradients compare with atol 1e-6 and rtol 1e-4, seed 000's r1 tolerances."""
    assert (1e-6, 1e-4) == tolerances(torch.float32)


def test_float64_tolerances_are_stricter_than_float32() -> None:
    """Both float64 tolerances are below float32's, so the strict lane can see a downcast."""
    atol64, rtol64 = tolerances(torch.float64)
    assert atol64 < FLOAT32_TOLERANCE[0]
    assert rtol64 < FLOAT32_TOLERANCE[1]


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_low_precision_has_no_tolerance(low: torch.dtype) -> None:
    """float16 and bfloat16 have no documented tolerance: a ValueError that names the dtype."""
    with pytest.raises(ValueError, match=rf"dtype={low}"):
        tolerances(low)


# --- compare: passing ------------------------------------------------------------------------------------------------


def test_identical_vectors_pass_with_zero_error(dtype: torch.dtype) -> None:
    """A vector compared with a copy of itself passes with error 0 and ratio 0."""
    ref = _ref(dtype)
    result = compare(ref.clone(), ref)
    assert (True, 0.0, 0, 0.0, 4) == (
        result.passed,
        result.max_abs_error,
        result.over_tolerance,
        result.worst_ratio,
        result.components,
    )


def test_default_tolerances_follow_the_reference_dtype(dtype: torch.dtype) -> None:
    """Without atol/rtol, compare uses tolerances(ref.dtype)."""
    result = compare(_ref(dtype), _ref(dtype))
    assert tolerances(dtype) == (result.atol, result.rtol)


def test_a_perturbation_just_inside_the_tolerance_passes(dtype: torch.dtype) -> None:
    """Moving each component by 0.99 (float64) or 0.9 (float32) of atol + rtol * |ref| still passes."""
    ref = _ref(dtype)
    atol, rtol = 1e-3, 1e-2
    share = 0.99 if dtype == torch.float64 else 0.9
    got = ref + share * (atol + rtol * ref.abs())
    result = compare(got, ref, atol=atol, rtol=rtol)
    assert (True, 0) == (result.passed, result.over_tolerance)
    assert result.worst_ratio <= 1.0


def test_a_perturbation_just_outside_the_tolerance_fails(dtype: torch.dtype) -> None:
    """Moving one component by 1.01 (float64) or 1.1 (float32) of atol + rtol * |ref| fails, and only it counts."""
    ref = _ref(dtype)
    atol, rtol = 1e-3, 1e-2
    share = 1.01 if dtype == torch.float64 else 1.1
    got = ref.clone()
    got[1] = ref[1] - share * (atol + rtol * ref[1].abs())
    result = compare(got, ref, atol=atol, rtol=rtol)
    assert (False, 1) == (result.passed, result.over_tolerance)
    assert result.worst_ratio > 1.0


def test_default_float32_tolerance_accepts_summation_order_noise() -> None:
    """A float32 vector summed in another order passes under the default float32 tolerances."""
    gen = torch.Generator().manual_seed(0)
    parts = torch.randn(64, 100, generator=gen)
    forward, backward = parts.sum(dim=0), parts.flip(0).cumsum(dim=0)[-1]
    assert compare(backward, forward).passed


def test_worst_ratio_on_a_hand_example() -> None:
    """diffs (0, 0.1, 1.0) over allowed (0.2, 0.31, 0.3): worst ratio 1.0 / 0.3, max error 1.0, one over."""
    got = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    ref = torch.tensor([1.0, 2.1, 2.0], dtype=torch.float64)
    result = compare(got, ref, atol=0.1, rtol=0.1)
    assert pytest.approx((1.0 / 0.3, 1.0), rel=1e-12) == (result.worst_ratio, result.max_abs_error)
    assert 1 == result.over_tolerance


def test_worst_ratio_is_max_difference_over_allowed() -> None:
    """worst_ratio is max |d| / (atol + rtol * |ref|) component by component, not max |d| over max allowed."""
    gen = torch.Generator().manual_seed(1)
    ref = torch.randn(50, generator=gen, dtype=torch.float64)
    got = ref + 1e-3 * torch.randn(50, generator=gen, dtype=torch.float64)
    atol, rtol = 1e-4, 1e-3
    expected = float(((got - ref).abs() / (atol + rtol * ref.abs())).max())
    assert pytest.approx(expected, rel=1e-12) == compare(got, ref, atol=atol, rtol=rtol).worst_ratio


def test_a_passing_comparison_with_zero_atol_reports_a_ratio_of_at_most_one() -> None:
    """With atol=0, components equal to a zero reference miss by nothing: the passing result's ratio is <= 1."""
    zeros = torch.zeros(3, dtype=torch.float64)
    result = compare(zeros.clone(), zeros, atol=0.0, rtol=1e-4)
    assert (True, 0.0) == (result.passed, result.worst_ratio)


def test_a_component_missing_a_zero_tolerance_reports_an_infinite_ratio() -> None:
    """atol = rtol = 0 (an exact comparison): one differing component gives ratio inf, even beside an equal zero."""
    got = torch.tensor([0.0, 1.0], dtype=torch.float64)
    ref = torch.zeros(2, dtype=torch.float64)
    result = compare(got, ref, atol=0.0, rtol=0.0)
    assert (False, 1, math.inf) == (result.passed, result.over_tolerance, result.worst_ratio)


# --- compare: failing ------------------------------------------------------------------------------------------------


def test_nan_in_got_fails(dtype: torch.dtype) -> None:
    """A NaN component is over tolerance with an infinite ratio, however loose the tolerance."""
    ref = _ref(dtype)
    got = ref.clone()
    got[2] = math.nan
    result = compare(got, ref, atol=1e6, rtol=1e6)
    assert (False, 1, math.inf, math.inf) == (
        result.passed,
        result.over_tolerance,
        result.worst_ratio,
        result.max_abs_error,
    )


def test_infinity_in_got_fails() -> None:
    """An infinite component is over tolerance."""
    ref = _ref(torch.float64)
    got = ref.clone()
    got[0] = math.inf
    assert 1 == compare(got, ref).over_tolerance


def test_shape_mismatch_raises() -> None:
    """Vectors of different shapes are a ValueError that shows both shapes."""
    with pytest.raises(ValueError, match=r"\(3,\).*\(4,\)"):
        compare(torch.zeros(3), torch.zeros(4))


@pytest.mark.parametrize(
    ("got", "ref", "name"),
    [
        (torch.zeros(3, dtype=torch.int64), torch.zeros(3), "got"),
        (torch.zeros(3), torch.zeros(3, dtype=torch.int32), "ref"),
        ([0.0, 0.0, 0.0], torch.zeros(3), "got"),
    ],
    ids=["int-got", "int-ref", "list-got"],
)
def test_non_float_input_raises_type_error(got: object, ref: object, name: str) -> None:
    """Integer tensors or non-tensors are a TypeError naming the argument."""
    with pytest.raises(TypeError, match=rf"^{name} must be a floating-point tensor"):
        compare(got, ref)  # type: ignore[arg-type]


def test_assert_gradients_close_raises_with_the_report() -> None:
    """assert_gradients_close raises AssertionError naming what was compared and how many components failed."""
    ref = _ref(torch.float64)
    got = ref + torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    with pytest.raises(AssertionError, match=r"^rank 1 gradient: 4 components, .*1 components over tolerance"):
        assert_gradients_close(got, ref, what="rank 1 gradient")


def test_assert_gradients_close_returns_the_comparison_when_close() -> None:
    """Within tolerance it returns the passing Comparison."""
    ref = _ref(torch.float32)
    assert assert_gradients_close(ref.clone(), ref).passed


# --- flat_grad and max_abs_difference --------------------------------------------------------------------------------


def test_flat_grad_counts_a_missing_grad_as_zeros() -> None:
    """A parameter without .grad contributes zeros in its place, in parameter order."""
    model = _TwoParams()
    model.b.grad = torch.tensor([[7.0, 8.0], [9.0, 10.0]])
    assert [0.0, 0.0, 7.0, 8.0, 9.0, 10.0] == flat_grad(model).tolist()


def test_flat_grad_concatenates_every_grad_in_order() -> None:
    """With every .grad set the vector is their flattened concatenation."""
    model = _TwoParams()
    model.a.grad = torch.tensor([1.0, 2.0])
    model.b.grad = torch.tensor([[3.0, 4.0], [5.0, 6.0]])
    assert [1.0, 2.0, 3.0, 4.0, 5.0, 6.0] == flat_grad(model).tolist()


def test_flat_grad_unwraps_a_module_attribute() -> None:
    """A wrapper with ``.module`` (as DDP has) gives the inner model's gradient."""
    inner = _TwoParams()
    inner.a.grad = torch.tensor([1.0, 2.0])
    wrapper = nn.Module()
    wrapper.module = inner
    assert [1.0, 2.0, 0.0, 0.0, 0.0, 0.0] == flat_grad(wrapper).tolist()


def test_flat_grad_rejects_a_model_without_parameters() -> None:
    """A parameterless model is a ValueError, not an empty vector that compares equal to anything."""
    with pytest.raises(ValueError, match="no parameters"):
        flat_grad(nn.Identity())


def test_max_abs_difference_of_equal_tensors_is_zero() -> None:
    """Bitwise-equal tensors differ by exactly 0.0."""
    a = [torch.tensor([1.0, 2.0]), torch.tensor([[3.0]])]
    assert 0.0 == max_abs_difference(a, [t.clone() for t in a])


def test_max_abs_difference_is_the_largest_over_all_pairs() -> None:
    """The largest difference over every pair of tensors is reported."""
    a = [torch.tensor([1.0, 2.0]), torch.tensor([[3.0]]), torch.zeros(0)]
    b = [torch.tensor([1.25, 2.0]), torch.tensor([[2.5]]), torch.zeros(0)]
    assert 0.5 == max_abs_difference(a, b)


def test_max_abs_difference_rejects_mismatched_shapes() -> None:
    """Paired tensors of different shapes are a ValueError."""
    with pytest.raises(ValueError, match=r"\(2,\) and \(3,\)"):
        max_abs_difference([torch.zeros(2)], [torch.zeros(3)])


def test_max_abs_difference_rejects_different_numbers_of_tensors() -> None:
    """A missing tensor on one side is an error, not silently skipped."""
    with pytest.raises(ValueError):
        max_abs_difference([torch.zeros(2), torch.zeros(2)], [torch.zeros(2)])
