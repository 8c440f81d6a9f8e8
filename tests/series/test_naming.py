"""A series' step names: every step from 0 round-trips through its name, and only the names the
series writes are its steps."""

from __future__ import annotations

import pytest

from ckptzip.series import STEP_LIKE, STEP_PATTERN, is_step, name_of, step_of


@pytest.mark.parametrize("step", [0, 1, 42, 99_999_999, 100_000_000, 123_456_789_012, 2**63 - 1])
def test_every_step_from_0_round_trips_through_its_name(step: int) -> None:
    name = name_of(step)
    assert STEP_PATTERN.fullmatch(name) and STEP_LIKE.fullmatch(name)
    assert step_of(name) == step and is_step(step)


def test_names_have_eight_digits_or_more_without_a_leading_zero() -> None:
    assert name_of(7) == "step_00000007.ckz"
    assert name_of(100_000_000) == "step_100000000.ckz"


@pytest.mark.parametrize("name", ["step_1.ckz", "step_000000100.ckz", "step_-0000007.ckz", "step_0000000\u0661.ckz",
                                  "step_00000001.ckz.tmp", "step_00000001.pt", "Step_00000001.ckz"])
def test_other_names_are_not_steps(name: str) -> None:
    assert not STEP_PATTERN.fullmatch(name)


@pytest.mark.parametrize("step", [-1, -7, -(2**63)])
def test_a_negative_step_is_not_one_the_series_names(step: int) -> None:
    assert not is_step(step)
