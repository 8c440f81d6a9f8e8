"""engine/plan.py: the device rule, batch sizes, and the one greedy packer."""

from __future__ import annotations

import pytest
import torch

from ckptzip.engine.plan import Limit, batch_bytes, halving, packed, work_device

CPU, GPU0, GPU1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
DEFAULTS = {"cuda": 1000, "cpu": 10}


def test_the_cpu_backend_codes_on_the_cpu_and_a_gpu_on_the_tensors_own() -> None:
    assert work_device("cpu", GPU1) == CPU
    assert work_device("cuda", GPU1) == GPU1


def test_a_gpu_codes_a_host_tensor_on_the_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert work_device("cuda", CPU) == GPU1


def test_a_gpu_batch_is_its_budgets_size_where_known_and_the_cpu_always_its_default() -> None:
    assert batch_bytes(GPU0, DEFAULTS, {GPU0: 64}) == 64
    assert batch_bytes(GPU1, DEFAULTS, {GPU0: 64}) == 1000
    assert batch_bytes(GPU0, DEFAULTS, None) == 1000
    assert batch_bytes(CPU, DEFAULTS, {CPU: 64}) == 10  # GPU sizes never apply to the host


def test_batches_close_once_full_and_other_keys_between_do_not_cut_them() -> None:
    keys = ["a", "b", "a", "a", "b", "a"]
    groups = packed(range(6), [4, 1, 4, 4, 1, 1], keys, {"a": Limit(fill=8), "b": Limit(fill=8)})
    assert groups == [[0, 2], [1, 4], [3, 5]]  # full ones as they fill, then the open ones in opening order


def test_a_fill_of_zero_puts_every_item_alone_in_place() -> None:
    keys = ["a", "parts", "a", "parts"]
    groups = packed(range(4), [1, 5, 1, 0], keys, {"a": Limit(fill=8), "parts": Limit(fill=0)})
    assert groups == [[1], [3], [0, 2]]


def test_within_cuts_before_an_item_that_would_go_over_and_a_larger_item_goes_alone() -> None:
    groups = packed(range(5), [3, 3, 9, 2, 2], ["a"] * 5, {"a": Limit(within=6)})
    assert groups == [[0, 1], [2], [3, 4]]


def test_within_and_fill_together_keep_a_batch_in_its_place_among_the_open_ones() -> None:
    keys = ["cpu", "gpu", "cpu", "cpu"]
    limits = {"cpu": Limit(within=6, fill=6), "gpu": Limit(fill=100)}
    assert packed(range(4), [4, 1, 4, 1], keys, limits) == [[0], [2, 3], [1]]


def test_packing_follows_the_order_given() -> None:
    assert packed([2, 0, 1], [1, 1, 1], ["a"] * 3, {"a": Limit(fill=2)}) == [[2, 0], [1]]


def test_shared_groups_count_each_key_apart_and_cut_for_any() -> None:
    keys = [GPU0, GPU1, GPU0, None, GPU1, GPU1]
    limits = {GPU0: Limit(within=5), GPU1: Limit(within=5), None: Limit()}
    groups = packed(range(6), [3, 3, 2, 100, 2, 1], keys, limits, shared=True)
    assert groups == [[0, 1, 2, 3, 4], [5]]  # unlimited items ride along


def test_nothing_to_pack_is_no_group() -> None:
    assert packed([], [], [], {}) == []


def test_open_groups_fill_within_closer_and_keep_every_item_once_in_order() -> None:
    # a 7B-like layer's tensors in MiB (fp32 weights and moments, bf16 gradients) in blocks of 330
    layer = [64] * 3 + [32] + [64] * 3 + [32] + [64] * 3 + [32] + [64] * 3 + [32] + [172] * 3 + [86]
    layer += [172] * 3 + [86] + [172] * 3 + [86]
    sizes = layer * 4
    limits = {"gpu": Limit(within=330)}
    one = packed(range(len(sizes)), sizes, ["gpu"] * len(sizes), limits)
    eight = packed(range(len(sizes)), sizes, ["gpu"] * len(sizes), limits, open_groups=8)
    assert (len(one), len(eight)) == (48, 39)  # batches 68 % and 84 % full
    for groups in (one, eight):
        assert sorted(i for g in groups for i in g) == list(range(len(sizes)))
        assert all(g == sorted(g) and sum(sizes[i] for i in g) <= 330 for g in groups)
    assert packed(range(len(sizes)), sizes, ["gpu"] * len(sizes), limits, open_groups=1) == one


def test_open_groups_leave_fill_limits_as_they_are() -> None:
    keys = ["a", "b", "a", "a", "b", "a"]
    limits = {"a": Limit(fill=8), "b": Limit(fill=8)}
    assert packed(range(6), [4, 1, 4, 4, 1, 1], keys, limits, open_groups=4) == [[0, 2], [1, 4], [3, 5]]


def test_shared_groups_are_packed_one_open_group_at_a_time() -> None:
    with pytest.raises(ValueError, match=r"^shared groups are packed one open group at a time$"):
        packed([0], [1], ["a"], {"a": Limit(within=2)}, shared=True, open_groups=2)


@pytest.mark.parametrize(("nbytes", "cut"), [
    ([8, 64, 64], 2),  # not after the 8 bytes: the rest would be retried at nearly the size that failed
    ([64, 64, 8], 1),
    ([1, 1, 1, 1], 2),
    ([100, 1, 1, 1], 1),
    ([1, 1, 1, 100], 3),
    ([5, 5], 1),
])
def test_a_batch_is_halved_where_its_larger_run_is_smallest(nbytes: list[int], cut: int) -> None:
    assert halving(nbytes) == cut
