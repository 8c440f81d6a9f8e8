"""A snapshot's plan (staging/plan.py): the share copied raw, the buffers each tensor is copied into,
and a stager's limits, derived once."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ckptzip.engine import GpuLimits, Policy
from ckptzip.memory.pinned import PinnedPool
from ckptzip.staging import HostPlan, stage_coded
from ckptzip.staging.plan import raw_share


def test_the_raw_share_is_the_tail_of_the_table_up_to_its_bytes() -> None:
    nbytes = [100] * 10
    assert raw_share(nbytes, list(range(10)), 0.4) == {6, 7, 8, 9}
    assert raw_share(nbytes, [0, 2, 4, 6, 8], 0.4) == {6, 8}  # only candidates, by their bytes
    assert raw_share(nbytes, list(range(10)), 0.0) == set()
    assert raw_share([], [], 0.4) == set()


def test_a_tensor_that_would_overshoot_the_share_is_passed_over_for_smaller_ones() -> None:
    nbytes = [100, 100, 100, 100, 600]  # 40 % of 1000 is 400: the last tensor alone is 600
    assert raw_share(nbytes, list(range(5)), 0.4) == {0, 1, 2, 3}
    assert raw_share([1000], [0], 0.4) == set()  # a lone tensor is coded on its GPU


def test_a_host_plan_copies_host_tensors_now_and_pins_what_it_keeps() -> None:
    sources = [torch.ones(10), torch.arange(4), torch.zeros(3)]
    plan = HostPlan.of(sources, Policy.parse("auto"), None, None, 0.25, keep=True)
    assert plan.coded == [False, False, False]  # no CUDA tensor: nothing for a GPU
    assert plan.now == [0, 1, 2] and plan.pinned == [] and plan.overlap is None
    assert plan.pinned_bytes(sources) == 0


def test_a_stager_derives_its_gpu_limits_once(monkeypatch: pytest.MonkeyPatch) -> None:
    of = GpuLimits.of.__func__  # type: ignore[attr-defined]
    calls: list[int] = []

    def counted(cls: type[GpuLimits], *args: Any) -> Any:
        calls.append(1)
        return of(cls, *args)

    monkeypatch.setattr(GpuLimits, "of", classmethod(counted))
    staged = stage_coded(["a", "b"], [torch.ones(64), torch.arange(32)], Policy.parse("auto"), PinnedPool())
    assert len(calls) == 1
    staged.release()
