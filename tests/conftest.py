"""Test configuration: GPU tests skip without CUDA; a fixture shrinks chunk sizes.

Markers (gpu, slow) and warning filters live in pyproject.toml; nothing here overrides them.
"""

from __future__ import annotations

import pytest
import torch

from ckptzip.engine import policy

SMALL_CHUNK_BYTES = 1000


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> int:
    """Make every codec use chunks of SMALL_CHUNK_BYTES, so small tensors span many chunks."""
    monkeypatch.setattr(policy, "CHUNK_BYTES", dict.fromkeys(policy.CHUNK_BYTES, SMALL_CHUNK_BYTES))
    monkeypatch.setattr(policy, "DEFAULT_CHUNK_BYTES", SMALL_CHUNK_BYTES)
    return SMALL_CHUNK_BYTES
