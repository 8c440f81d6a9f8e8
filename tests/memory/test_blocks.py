"""GPU buffers in blocks of one size (ckptzip/memory/blocks.py): the sizes asked of torch, on any machine."""

from __future__ import annotations

import threading

import pytest
import torch

from ckptzip.memory import blocks

MIB = 1 << 20
CUDA = torch.device("cuda", 0)


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes torch is asked for, answered with host memory (no GPU needed)."""
    sizes: list[int] = []
    real = torch.empty

    def empty(n: int, **kwargs: object) -> torch.Tensor:
        sizes.append(n)
        return real(n, dtype=torch.uint8)

    monkeypatch.setattr(blocks.torch, "empty", empty)
    return sizes


def test_inside_uniform_gpu_buffers_are_views_of_blocks_of_its_size(asked: list[int]) -> None:
    with blocks.uniform(64 * MIB):
        t = blocks.empty(5 * MIB, CUDA)
        z = blocks.zeros(2 * MIB, CUDA)
        blocks.empty(64 * MIB, CUDA)
        blocks.empty(65 * MIB, CUDA)  # larger than a block: its own size
        blocks.empty(1000, CUDA)  # small: torch's pool of small blocks
        blocks.empty(5 * MIB, torch.device("cpu"))  # host memory is not torch's GPU cache
    blocks.empty(5 * MIB, CUDA)
    assert asked == [64 * MIB, 64 * MIB, 64 * MIB, 65 * MIB, 1000, 5 * MIB, 5 * MIB]
    assert t.numel() == 5 * MIB and z.numel() == 2 * MIB and not z.any()


def test_uniform_nests_and_belongs_to_its_thread(asked: list[int]) -> None:
    with blocks.uniform(8 * MIB):
        with blocks.uniform(None):
            blocks.empty(2 * MIB, CUDA)
        blocks.empty(2 * MIB, CUDA)
        other = threading.Thread(target=blocks.empty, args=(3 * MIB, CUDA))
        other.start()
        other.join()
    assert asked == [2 * MIB, 8 * MIB, 3 * MIB]
