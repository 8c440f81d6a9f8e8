"""DCP compatibility, one process: each case runs against DCP's FileSystemWriter/Reader and
against ckptzip's writer/reader, so a difference between them shows as a failing parameter.

Multi-process cases (DTensor and ShardedTensor resharding, DDP) are in test_dcp_compat_dist.py.
"""

from __future__ import annotations

import inspect
import io
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_storages import STORAGES, Storage
from helpers import assert_same
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import ExtensionRegistry, ZStandard
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import SerializationFormat

from ckptzip import UnsupportedObjectError, UsageError
from ckptzip.dcp import CompressedStorageReader, CompressedStorageWriter


@pytest.fixture(params=sorted(STORAGES), ids=str)
def storage(request: pytest.FixtureRequest) -> Storage:
    return STORAGES[request.param]


def _state(seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(5, 3, generator=generator).to(torch.bfloat16),
        "nested": {"i": torch.randint(-9, 9, (7,), generator=generator), "mask": torch.tensor([True, False])},
        "step": 7 + seed,
        "name": f"run-{seed}",
    }


def _empty() -> dict[str, Any]:
    """A target shaped like ``_state`` (DCP loads tensors in place, other values replace these)."""
    return {
        "w": torch.zeros(5, 3, dtype=torch.bfloat16),
        "nested": {"i": torch.zeros(7, dtype=torch.int64), "mask": torch.zeros(2, dtype=torch.bool)},
        "step": 0,
        "name": "",
    }


def _save(state: dict[str, Any], writer: Any, **kwargs: Any) -> None:
    dcp.save(state, storage_writer=writer, no_dist=True, **kwargs)


def _load(reader: Any, **kwargs: Any) -> dict[str, Any]:
    target = _empty()
    dcp.load(target, storage_reader=reader, no_dist=True, **kwargs)
    return target


def _data_files(path: Path, storage: Storage) -> list[str]:
    return sorted(name for name in os.listdir(path) if name.endswith(storage.data_suffix))


# --- constructor arguments -------------------------------------------------------------------


@pytest.mark.parametrize(("ours", "theirs"), [
    (CompressedStorageWriter, FileSystemWriter), (CompressedStorageReader, FileSystemReader),
], ids=["writer", "reader"])
def test_every_filesystem_argument_is_taken_in_its_position(ours: type, theirs: type) -> None:
    def positional(cls: type) -> list[str]:
        return [p.name for p in inspect.signature(cls).parameters.values()
                if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]

    assert positional(ours)[: len(positional(theirs))] == positional(theirs)


@pytest.mark.parametrize("single_file_per_rank", [True, False])
def test_filesystem_arguments_given_positionally(storage: Storage, tmp_path: Path, single_file_per_rank: bool) -> None:
    state = _state()
    writer = storage.writer(tmp_path, single_file_per_rank, False, 1, 1_000_000, False, True, [],
                            SerializationFormat.TORCH_SAVE)
    _save(state, writer)
    assert_same(_load(storage.reader(tmp_path, ExtensionRegistry())), state)
    # one data file for the rank, or one per item (3 tensors and the 2 other values)
    assert len(_data_files(tmp_path, storage)) == (1 if single_file_per_rank else 5)


def test_zstd_extension(storage: Storage, tmp_path: Path) -> None:
    if storage.name == "dcp":
        _save(_state(), storage.writer(tmp_path, _extensions=[ZStandard()]))
        assert_same(_load(storage.reader(tmp_path)), _state())
        return
    with pytest.raises(UsageError, match=r"^_extensions=\[ZStandard\(\)\]: ckptzip already compresses every item"):
        storage.writer(tmp_path, _extensions=[ZStandard()])


def test_other_stream_extensions_are_refused_with_the_reason(tmp_path: Path) -> None:
    class Rot13:
        @staticmethod
        def registry_name() -> str:
            return "stream.rot13"

    with pytest.raises(UsageError, match=r"^_extensions=\[Rot13\] \(stream\.rot13\): ckptzip's data files are "
                                         r"\.ckz containers read by position"):
        CompressedStorageWriter(tmp_path, _extensions=[Rot13()])


def test_safetensors_serialization_is_refused_with_the_alternative(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"not safetensors files; leave it at SerializationFormat\.TORCH_SAVE"):
        CompressedStorageWriter(tmp_path, serialization_format=SerializationFormat.SAFETENSORS)


def test_staging_arguments_are_kept(tmp_path: Path) -> None:
    writer = CompressedStorageWriter(tmp_path, cache_staged_state_dict=True, per_thread_copy_ahead=123)
    assert (writer.cache_staged_state_dict, writer.per_thread_copy_ahead) == (True, 123)
    registry = ExtensionRegistry()
    assert CompressedStorageReader(tmp_path, _extension_registry=registry).extension_registry is registry


# --- overwrite, checkpoint_id, Stateful ------------------------------------------------------


def test_overwrite(storage: Storage, tmp_path: Path) -> None:
    _save(_state(0), storage.writer(tmp_path))
    _save(_state(1), storage.writer(tmp_path, overwrite=True))
    assert_same(_load(storage.reader(tmp_path)), _state(1))
    with pytest.raises(CheckpointException) as caught:
        _save(_state(2), storage.writer(tmp_path, overwrite=False))
    assert isinstance(caught.value.failures[0][0], storage.overwrite_error)
    assert_same(_load(storage.reader(tmp_path)), _state(1))


def test_checkpoint_id_redirects_writer_and_reader(storage: Storage, tmp_path: Path) -> None:
    """``checkpoint_id=`` resets a storage built for another path (one object reused per step)."""
    first, second = tmp_path / "first", tmp_path / "second"
    writer, reader = storage.writer(first), storage.reader(first)
    for step, path in enumerate((first, second)):
        _save(_state(step), writer, checkpoint_id=path)
    assert_same(_load(reader, checkpoint_id=second), _state(1))
    assert_same(_load(reader, checkpoint_id=first), _state(0))


class _Counter:
    """A Stateful object: DCP saves what state_dict returns and hands the loaded dict back."""

    def __init__(self, count: int) -> None:
        self.count = torch.tensor(count)
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "label": f"n={int(self.count)}"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state
        self.count = state["count"]


def test_stateful_objects(storage: Storage, tmp_path: Path) -> None:
    _save({"counter": _Counter(41)}, storage.writer(tmp_path))
    counter = _Counter(0)
    dcp.load({"counter": counter}, storage_reader=storage.reader(tmp_path), no_dist=True)
    assert counter.loaded is not None
    assert_same(counter.loaded, {"count": torch.tensor(41), "label": "n=41"})


# --- values DCP serializes: io.BytesIO -------------------------------------------------------


def test_bytesio_values_load_as_dcp_loads_them(storage: Storage, tmp_path: Path) -> None:
    """torchtitan keeps data loader state as io.BytesIO: DCP replaces it by the saved buffer,
    its bytes and its position."""
    buffer = io.BytesIO(bytes(range(256)) * 3)
    buffer.seek(300)
    _save({"train": {"loader": buffer, "step": 3}}, storage.writer(tmp_path))
    target: dict[str, Any] = {"train": {"loader": io.BytesIO(), "step": 0}}
    dcp.load(target, storage_reader=storage.reader(tmp_path), no_dist=True)
    loaded = target["train"]["loader"]
    assert type(loaded) is io.BytesIO
    assert (loaded.getvalue(), loaded.tell(), target["train"]["step"]) == (bytes(range(256)) * 3, 300, 3)


class Unlisted:
    """A class torch's weights_only unpickler does not allow."""


def test_bytesio_holding_an_unlisted_object_is_refused(tmp_path: Path) -> None:
    buffer = io.BytesIO(b"state")
    buffer.attached = Unlisted()  # type: ignore[attr-defined]
    _save({"loader": buffer}, CompressedStorageWriter(tmp_path))
    with pytest.raises(CheckpointException) as caught:
        dcp.load({"loader": io.BytesIO()}, storage_reader=CompressedStorageReader(tmp_path), no_dist=True)
    error = caught.value.failures[0][0]
    assert isinstance(error, UnsupportedObjectError)
    assert re.match(r"item 'loader' in .* is a pickled Python object that torch's weights_only loader refuses "
                    r"\(Unsupported global: GLOBAL test_dcp_compat\.Unlisted", str(error)), error


# --- format utils and async_save -------------------------------------------------------------


def test_one_file_and_back(storage: Storage, tmp_path: Path) -> None:
    """dcp_to_torch_save / torch_save_to_dcp, and ckptzip's dcp_to_ckz / ckz_to_dcp."""
    state = _state()
    _save(state, storage.writer(tmp_path / "a"))
    storage.to_file(tmp_path / "a", tmp_path / "one")
    assert_same(storage.load_file(tmp_path / "one"), state, key_order=False)
    storage.from_file(tmp_path / "one", tmp_path / "b")
    assert_same(_load(storage.reader(tmp_path / "b")), state)


@pytest.mark.parametrize("cache", [False, True], ids=["fresh-staging", "cache_staged_state_dict"])
def test_async_save_twice_with_one_writer(storage: Storage, tmp_path: Path, cache: bool) -> None:
    """Each save holds the state of its call, also when the writer is reused (as trainers do)."""
    if storage.name == "dcp" and cache and not torch.accelerator.is_available():
        pytest.skip("FileSystemWriter's cached staging pins host memory, which needs an accelerator")
    writer = storage.writer(tmp_path / "0", cache_staged_state_dict=cache)
    state = _state()
    dcp.async_save(state, storage_writer=writer, no_dist=True).result()
    state["w"] += 1
    dcp.async_save(state, storage_writer=writer, checkpoint_id=tmp_path / "1", no_dist=True).result()
    assert_same(_load(storage.reader(tmp_path / "0")), _state())
    assert_same(_load(storage.reader(tmp_path / "1")), state)
