"""Retention over delta chains: the newest few steps, what else is pinned, and every base down
their chains; removal goes newest first, so a delta always goes before its base."""

from __future__ import annotations

from ckptzip.series import removable, retained

# Chains 1 <- 2 <- 3, 4 (whole), 5 <- 6 <- 7; 9's base 8 is missing.
BASES: dict[int, int | None] = {1: None, 2: 1, 3: 2, 4: None, 5: None, 6: 5, 7: 6, 9: 8}
STEPS = [1, 2, 3, 4, 5, 6, 7]


def test_the_newest_keep_and_every_base_down_their_chains_are_retained() -> None:
    assert retained(STEPS, 1, BASES.get) == {5, 6, 7}
    assert retained(STEPS, 4, BASES.get) == {4, 5, 6, 7}
    assert retained([1, 2, 3, 4], 1, BASES.get) == {4}
    assert retained([1, 2, 3, 4], 2, BASES.get) == {1, 2, 3, 4}


def test_none_keeps_every_step() -> None:
    assert retained(STEPS, None, BASES.get) == set(STEPS)
    assert removable(STEPS, None, BASES.get) == []


def test_pinned_steps_keep_their_chains_too() -> None:
    assert retained(STEPS, 1, BASES.get, also=[3]) == {1, 2, 3, 5, 6, 7}
    assert removable(STEPS, 1, BASES.get, also=[3]) == [4]


def test_removal_goes_newest_first_a_delta_before_its_base() -> None:
    assert removable(STEPS, 1, BASES.get) == [4, 3, 2, 1]
    assert removable([5, 6, 7, 10], 1, BASES.get) == [7, 6, 5]


def test_a_missing_base_is_retained_as_a_step_but_removes_nothing() -> None:
    assert retained([7, 9], 1, BASES.get) == {8, 9}
    assert removable([7, 9], 1, BASES.get) == [7]
