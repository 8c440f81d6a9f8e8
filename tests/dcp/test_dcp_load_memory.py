"""The DCP reader on a GPU that training fills: a data file's GPU items decode in groups that fit
beside the targets they are copied into."""

from __future__ import annotations

import pytest
import torch

from ckptzip.dcp import _reader

GPU = torch.device("cuda", 0)
CPU = torch.device("cpu")


def test_items_decode_together_when_they_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_reader.gpu, "available", lambda device: 1000)
    assert _reader._groups([100, 200, 200], [GPU, GPU, CPU]) == [[0, 1, 2]]
    assert _reader._groups([1 << 40, 5], [CPU, CPU]) == [[0, 1]]  # host items: no GPU limit


def test_items_that_do_not_fit_decode_in_groups_of_half_what_can_be_had(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_reader.gpu, "available", lambda device: 1000)
    assert _reader._groups([300, 300, 7, 400, 600, 100], [GPU, GPU, CPU, GPU, GPU, GPU]) == [
        [0], [1, 2], [3], [4], [5]]  # a host item rides along; an item over the limit goes alone


def _saved(tmp_path: object, state: dict[str, torch.Tensor]) -> str:
    import torch.distributed.checkpoint as dcp

    from ckptzip.dcp import CompressedStorageWriter

    path = f"{tmp_path}/ckpt"
    dcp.save(state, storage_writer=CompressedStorageWriter(path), no_dist=True)
    return path


def test_a_whole_tensor_decodes_straight_into_its_target_and_a_part_is_copied(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoded into new tensors and then copied, a load needed the targets plus the group's
    decoded tensors; on a GPU that training fills that failed with 1 GiB free."""
    import torch.distributed.checkpoint as dcp

    from ckptzip.dcp import CompressedStorageReader

    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(64, 33, generator=g), "b": torch.randn(7, generator=g).bfloat16(), "step": 3}
    path = _saved(tmp_path, state)
    target = {"w": torch.zeros(64, 33), "b": torch.zeros(7, dtype=torch.bfloat16), "step": 0}
    pointers = {k: v.data_ptr() for k, v in target.items() if isinstance(v, torch.Tensor)}
    delivered: list[str] = []
    real = _reader.CompressedStorageReader._deliver

    def deliver(self: object, index: object, *args: object) -> None:
        delivered.append(index.fqn)  # type: ignore[attr-defined]
        real(self, index, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(_reader.CompressedStorageReader, "_deliver", deliver)
    dcp.load(target, storage_reader=CompressedStorageReader(path), no_dist=True)
    assert torch.equal(target["w"].view(torch.uint8), state["w"].view(torch.uint8))
    assert torch.equal(target["b"].view(torch.uint8), state["b"].view(torch.uint8))
    assert target["step"] == 3
    assert {k: v.data_ptr() for k, v in target.items() if isinstance(v, torch.Tensor)} == pointers
    assert delivered == ["step"]  # tensors were decoded in place; only the object was delivered

    other = {"w": torch.zeros(64, 33, dtype=torch.float64), "b": torch.zeros(7, dtype=torch.bfloat16), "step": 0}
    delivered.clear()
    dcp.load(other, storage_reader=CompressedStorageReader(path), no_dist=True)  # another dtype: copied
    assert torch.equal(other["w"], state["w"].double()) and sorted(delivered) == ["step", "w"]
