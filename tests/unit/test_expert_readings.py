"""The expert group's factor named by the mesh's facts (harness.diagnosis.experts): ep, the token group's size W,
their inverses, both where they are equal, and the number itself where none matches."""

from __future__ import annotations

from harness.core.mesh import Mesh
from harness.diagnosis.experts import name_factor


def test_an_average_over_the_expert_data_group_reads_ep() -> None:
    assert "ep=2" == name_factor(2.0, Mesh.parse("dp=2,ep=2"))
    assert "the token group's size W=4" == name_factor(4.0, Mesh.parse("dp=2,ep=2"))
    assert "1/ep=2" == name_factor(0.5, Mesh.parse("dp=2,ep=2"))


def test_equal_facts_are_both_named_and_an_unmatched_factor_is_the_number() -> None:
    both = name_factor(2.0, Mesh.parse("ep=2"))
    assert "ep=2" in both and "W=2" in both and "equal on this mesh" in both
    assert "3" == name_factor(3.0, Mesh.parse("dp=2,ep=2"))
