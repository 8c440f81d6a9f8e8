"""ckptzip.integrations.torch_checkpointing with torch_checkpointing's own CheckpointManager: its
synchronous saver and its asynchronous one (staging, a writer process), bit-exact round trips,
the state changing as soon as save returns, several saves through one manager, files that a
plain torch_checkpointing manager and torch.load read, a reshard through its resharder, and
items ckptzip cannot store left to torch_checkpointing."""

from __future__ import annotations

import copy
import os
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torch_checkpointing")

from helpers import assert_same  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402
from torch_checkpointing import CheckpointManager, ItemSpec  # noqa: E402
from torch_checkpointing.default_resharder import DefaultResharder  # noqa: E402
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig  # noqa: E402

import ckptzip  # noqa: E402
from ckptzip.errors import UnsupportedObjectError  # noqa: E402
from ckptzip.integrations.torch_checkpointing import CompressedCheckpointManager, CompressedItem  # noqa: E402
from ckptzip_bench.launch import launch  # noqa: E402

SAVERS = ("sync", "async")


def _config(saver: str, **fields: Any) -> CheckpointManager.Config:
    config = CheckpointManager.Config.with_sync_save() if saver == "sync" else CheckpointManager.Config.with_async_save()
    for name, value in fields.items():
        setattr(config, name, value)
    return config


def _payload(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(384, 256, generator=g)
    return {
        "model": {"w": w, "tied": w, "b": torch.randn(256, generator=g).bfloat16(),
                  "nan": torch.tensor([float("nan"), -0.0, 1.0]).bfloat16(), "empty": torch.empty(0, 2)},
        "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(384, 256, generator=g)}},
                      "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0], "foreach": None}]},
        "step": 12,
    }


def _copy(value: Any, zeros: bool = False) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v, zeros) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v, zeros) for v in value]
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value) if zeros else value.clone()
    return 0 if zeros and type(value) is int else value


def _mutate(payload: dict[str, Any]) -> None:
    for t in (payload["model"]["w"], payload["model"]["b"], payload["optimizer"]["state"][0]["exp_avg"]):
        t.add_(1)


def _tied(target: dict[str, Any]) -> dict[str, Any]:
    target["model"]["tied"] = target["model"]["w"]
    return target


@pytest.mark.slow
@pytest.mark.parametrize("saver", SAVERS)
def test_saves_are_bit_exact_and_taken_when_save_returns(tmp_path: Path, saver: str) -> None:
    payload = _payload()
    manager = CompressedCheckpointManager(_config(saver))
    try:
        for k in range(3):  # the staging buffers are reused from save to save
            before = _copy(payload)
            future = manager.save(str(tmp_path / f"step_{k}"), payload)
            _mutate(payload)  # training goes on at once
            if future is not None:
                future.result()
            target = _tied(_copy(before, zeros=True))
            loaded = manager.load(str(tmp_path / f"step_{k}"), into=target)
            assert_same(loaded["model"], before["model"], f"save {k}")
            assert_same(loaded["optimizer"], before["optimizer"], f"save {k}")
            assert loaded["step"] == 12
            assert target["model"]["w"] is loaded["model"]["w"]  # loaded in place
    finally:
        manager.close()
    assert sorted(os.listdir(tmp_path / "step_2")) == ["model_0.pt", "optimizer_0.pt", "step_0.pt"]


@pytest.mark.slow
def test_the_files_are_torch_save_archives_of_one_ckptzip_container(tmp_path: Path) -> None:
    payload = _payload()
    manager = CompressedCheckpointManager(_config("async"))
    try:
        future = manager.save(str(tmp_path / "c"), payload)
        assert future is not None
        future.result()
    finally:
        manager.close()
    model_file = tmp_path / "c" / "model_0.pt"
    with zipfile.ZipFile(model_file) as archive:
        records = [n for n in archive.namelist() if "/data/" in n]
        assert len(records) == 1  # the container
        with ckptzip.open(archive.read(records[0])) as container:
            assert {e.name for e in container.entries()} >= {"w", "b", "nan", "empty"}
    assert_same(torch.load(model_file, weights_only=False), payload["model"])  # torch.load reads it (ckptzip decodes)
    plain = CheckpointManager(_config("sync", storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))
    try:
        target = _tied(_copy(payload, zeros=True))
        loaded = plain.load(str(tmp_path / "c"), into=target)
        assert_same(loaded["optimizer"], payload["optimizer"])
    finally:
        plain.close()
    # smaller than what torch_checkpointing writes itself, for the bf16 and fp32 state above
    default = CheckpointManager(_config("sync", storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))
    try:
        default.save(str(tmp_path / "d"), payload)
    finally:
        default.close()
    assert model_file.stat().st_size < (tmp_path / "d" / "model_0.pt").stat().st_size


def test_items_are_staged_as_snapshots_that_staging_does_not_copy(tmp_path: Path) -> None:
    payload = _payload()
    manager = CompressedCheckpointManager(_config("sync"))
    try:
        item = manager._item("model", payload["model"])
        assert isinstance(item, CompressedItem)
        assert item["w"] is payload["model"]["w"]  # the live values, for torch_checkpointing's metadata
        assert copy.deepcopy(item) is item
        assert manager._item("step", 12) == 12  # not a mapping of tensors: torch_checkpointing's
        manager._item("model", payload["model"]).staged.release()
        item.staged.release()
    finally:
        manager.close()


class Opaque:
    """A value ckptzip does not store (pickle does)."""


def test_an_item_ckptzip_cannot_store_is_left_to_torch_checkpointing(tmp_path: Path) -> None:
    payload = {"model": {"w": torch.ones(4), "hook": Opaque()}}
    manager = CompressedCheckpointManager(_config("sync"))
    try:
        with pytest.warns(UserWarning, match="item 'model' is saved by torch_checkpointing itself"):
            manager.save(str(tmp_path / "c"), payload)
        assert isinstance(torch.load(tmp_path / "c" / "model_0.pt", weights_only=False)["hook"], Opaque)
    finally:
        manager.close()
    named = CompressedCheckpointManager(_config("sync"), coded=["model"])
    try:
        with pytest.raises(UnsupportedObjectError, match="item 'model'"):
            named.save(str(tmp_path / "n"), payload)
    finally:
        named.close()


def _reshard(rank: int, world: int, root: Path, saver: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8).bfloat16()
    items = {"model": ItemSpec(resharder=DefaultResharder())}
    saving = CompressedCheckpointManager(_config(saver, items=items))
    try:
        future = saving.save(str(root / "c"), {"model": {"w": distribute_tensor(full, mesh, [Shard(0)]),
                                                         "b": torch.ones(3)}})
        if future is not None:
            future.result()
    finally:
        saving.close()
    # a different placement: torch_checkpointing's resharder reads the file whole (ckptzip's
    # items have no tensor offsets) and places the slices
    target = {"w": distribute_tensor(torch.zeros_like(full), mesh, [Replicate()]), "b": torch.zeros(3)}
    loading = CompressedCheckpointManager(_config(saver, items=items))
    try:
        loading.load(str(root / "c"), into={"model": target})
    finally:
        loading.close()
    assert isinstance(target["w"], DTensor)
    assert torch.equal(target["w"].full_tensor().view(torch.uint8), full.view(torch.uint8))
    assert torch.equal(target["b"], torch.ones(3))


@pytest.mark.slow
@pytest.mark.parametrize("saver", SAVERS)
def test_a_dtensor_item_reshards_through_torch_checkpointings_resharder(tmp_path: Path, saver: str) -> None:
    # one rank: torch_checkpointing gathers the metadata of several ranks on CUDA devices only
    launch(_reshard, 1, tmp_path, saver)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("saver", SAVERS)
def test_gpu_state_is_coded_on_the_gpu_before_staging(tmp_path: Path, saver: str) -> None:
    payload = _payload()
    payload["model"] = {k: v.cuda() for k, v in payload["model"].items()}
    payload["model"]["tied"] = payload["model"]["w"]
    payload["optimizer"]["state"][0]["exp_avg"] = payload["optimizer"]["state"][0]["exp_avg"].cuda()
    manager = CompressedCheckpointManager(_config(saver))
    try:
        for k in range(2):
            before = _copy(payload)
            item = manager._item("model", payload["model"])
            assert item.staged.state.jobs  # coded on the GPU, its stored bytes staged
            item.staged.release()
            future = manager.save(str(tmp_path / f"s{k}"), payload)
            _mutate(payload)
            if future is not None:
                future.result()
            target = _tied(_copy(before, zeros=True))
            loaded = manager.load(str(tmp_path / f"s{k}"), into=target)
            assert_same(loaded["model"], before["model"], f"save {k}", device=True)
            assert_same(loaded["optimizer"], before["optimizer"], f"save {k}", device=True)
            with zipfile.ZipFile(tmp_path / f"s{k}" / "model_0.pt") as archive:
                (record,) = [n for n in archive.namelist() if "/data/" in n]
                with ckptzip.open(archive.read(record)) as container:
                    codecs = {s.codec["id"] for e in container.entries() for s in e.streams}
            assert "gdeflate" in codecs  # coded by nvCOMP on the GPU
        torch.cuda.synchronize()
    finally:
        manager.close()
    assert manager._pool.reserved == 0  # every staging buffer came back, so the pool could be cleared


def test_a_committed_archive_of_format_1_keeps_loading() -> None:
    from golden_state import golden_state_2_1

    archive = Path(__file__).parents[1] / "golden" / "torch_checkpointing_v1.pt"
    assert_same(torch.load(archive, weights_only=False), golden_state_2_1())
