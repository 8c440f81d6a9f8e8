"""ckptzip.dcp in one process (DCP's no_dist mode): round trips, file layout, damage detection,
safety checks, fsspec URLs, and conversion to and from a single .ckz file.

Multi-rank behaviour (sharding, resharding, async_save) is in test_dcp_dist.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_same, assert_same_tensor
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict

import ckptzip
from ckptzip.cli.dcp import configure, run
from ckptzip.dcp import CompressedStorageReader, CompressedStorageWriter, ckz_to_dcp, dcp_to_ckz
from ckptzip.dcp._metadata import METADATA_FILE, decode_metadata, encode_metadata
from ckptzip.errors import (
    CheckpointNotFoundError,
    CheckpointWriteError,
    CkptzipError,
    CorruptCheckpointError,
    UnsupportedFormatError,
    UnsupportedObjectError,
)


class Opaque:
    """A user class: DCP pickles it by reference, so unpickling it imports and runs code."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.value == self.value


def _trained_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 64)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    model_sd, optim_sd = get_state_dict(model, optimizer)  # DCP's keys: parameter names
    return {
        "model": model_sd,
        "optim": optim_sd,
        "half": torch.randn(5, 7).to(torch.bfloat16) * seed,
        "ids": torch.arange(seed, seed + 11, dtype=torch.int64),
        "mask": torch.arange(6) % (seed + 2) == 0,
        "empty": torch.empty(0, 3),
        "step": seed,
        "note": f"seed {seed}",
    }


def _save(state: dict[str, Any], path: Any, **kwargs: Any) -> None:
    dcp.save(state, storage_writer=CompressedStorageWriter(path, **kwargs), no_dist=True)


def _load(state: dict[str, Any], path: Any, **kwargs: Any) -> None:
    dcp.load(state, storage_reader=CompressedStorageReader(path, **kwargs), no_dist=True)


def _failure(excinfo: pytest.ExceptionInfo[CheckpointException]) -> BaseException:
    """The one rank's error inside DCP's CheckpointException."""
    (error, _trace), = excinfo.value.failures.values()
    return error


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    state = _trained_state(1)
    path = tmp_path / "ckpt"
    _save(state, path)
    return path, state


def _stored(path: Path, fqn: str) -> Any:
    metadata = CompressedStorageReader(path).read_metadata()
    (item,) = [item for index, item in metadata.storage_data.items() if index.fqn == fqn]
    return item


def test_roundtrip_is_bit_exact(saved: tuple[Path, dict[str, Any]]) -> None:
    path, state = saved
    target = _trained_state(2)
    _load(target, path)
    assert_same(target, state)


def test_layout_one_data_file_of_all_items_and_a_ckz_metadata_file(saved: tuple[Path, dict[str, Any]]) -> None:
    path, state = saved
    assert sorted(p.name for p in path.iterdir()) == [METADATA_FILE, "__0.ckzd"]
    metadata = CompressedStorageReader(path).read_metadata()
    weight = _stored(path, "model.0.weight")
    with ckptzip.open(path / "__0.ckzd") as container:  # the data file is a .ckz container of the items
        assert len(container) == len(metadata.storage_data)
        assert sorted(item.tensor for item in metadata.storage_data.values()) == list(range(len(container)))
        entry = container.entries()[weight.tensor]
        assert entry.name == "model.0.weight@0,0"
        assert_same_tensor(container["model.0.weight@0,0"], state["model"]["0.weight"])
    assert weight.pipeline["transforms"] == entry.transforms
    assert weight.checksum == entry.checksum
    # Every file ckptzip wrote is a .ckz container; the metadata one holds a plain tree.
    assert set(ckptzip.load(path / METADATA_FILE)) >= {"format", "version", "state_dict", "items"}


def _chunk_of(path: Path, name: str) -> Any:
    with ckptzip.open(path / "__0.ckzd") as container:
        return next(e for e in container.entries() if e.name == name).streams[0].chunks[0]


def test_save_returns_the_metadata_it_wrote(tmp_path: Path) -> None:
    returned = dcp.save(_trained_state(1), storage_writer=CompressedStorageWriter(tmp_path), no_dist=True)
    stored = CompressedStorageReader(tmp_path).read_metadata()
    assert returned.storage_data == stored.storage_data
    assert returned.storage_meta.save_id == stored.storage_meta.save_id


def test_empty_state_writes_only_metadata(tmp_path: Path) -> None:
    _save({}, tmp_path / "ckpt")
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == [METADATA_FILE]
    _load({}, tmp_path / "ckpt")


def test_metadata_roundtrip(saved: tuple[Path, dict[str, Any]]) -> None:
    path, _ = saved
    metadata = CompressedStorageReader(path).read_metadata()
    again = decode_metadata(encode_metadata(metadata, metadata.storage_data), "test")
    assert again.state_dict_metadata == metadata.state_dict_metadata
    assert again.planner_data == metadata.planner_data
    assert again.storage_data == metadata.storage_data
    assert again.planner_data["optim.param_groups.0.lr"] == ("optim", "param_groups", 0, "lr")


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["payload", "container index"])
def test_damaged_item_is_reported_with_its_name(saved: tuple[Path, dict[str, Any]], where: str) -> None:
    path, _ = saved
    data_file = path / "__0.ckzd"
    chunk = _chunk_of(path, "model.0.weight@0,0")
    _flip(data_file, chunk.offset + 1 if where == "payload" else data_file.stat().st_size - 60)
    with pytest.raises(CheckpointException) as excinfo:
        _load(_trained_state(2), path)
    error = _failure(excinfo)
    assert type(error) is CorruptCheckpointError
    expected = "tensor 'model.0.weight@0,0' stream 0 chunk 0" if where == "payload" else "the index checksum does not match"
    assert str(error).startswith(f"data file '{data_file}': {expected}"), str(error)


def test_damage_in_a_non_tensor_item_is_reported(saved: tuple[Path, dict[str, Any]]) -> None:
    path, _ = saved
    _flip(path / "__0.ckzd", _chunk_of(path, "note").offset)
    with pytest.raises(CorruptCheckpointError, match=r"^data file '.*__0\.ckzd': tensor 'note' stream 0 chunk 0 .* is damaged"):
        dcp_to_ckz(path, path.parent / "out.ckz")


def test_truncated_data_file(saved: tuple[Path, dict[str, Any]]) -> None:
    path, _ = saved
    data = (path / "__0.ckzd").read_bytes()
    (path / "__0.ckzd").write_bytes(data[:-100])
    with pytest.raises(CorruptCheckpointError, match=r"^data file '.*__0\.ckzd': .*it is truncated"):
        dcp_to_ckz(path, path.parent / "out.ckz")


def test_missing_data_file(saved: tuple[Path, dict[str, Any]]) -> None:
    path, _ = saved
    (path / "__0.ckzd").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"data file '.*__0\.ckzd' of the checkpoint is missing"):
        dcp_to_ckz(path, path.parent / "out.ckz")


def _rewrite_metadata(path: Path, change: Any) -> None:
    metadata = CompressedStorageReader(path).read_metadata()
    items = change(dict(metadata.storage_data))
    (path / METADATA_FILE).write_bytes(encode_metadata(metadata, items))


def test_location_pointing_at_another_items_blob_is_detected(saved: tuple[Path, dict[str, Any]]) -> None:
    path, _ = saved

    def misplace(items: dict[Any, Any]) -> dict[Any, Any]:
        a = next(i for i in items if i.fqn == "model.0.weight")
        b = next(i for i in items if i.fqn == "optim.state.0.weight.exp_avg")  # same shape and dtype
        items[a] = dataclasses.replace(items[a], tensor=items[b].tensor)
        return items

    _rewrite_metadata(path, misplace)
    with pytest.raises(CorruptCheckpointError, match=r"^item 'model\.0\.weight' .* is not the one the checkpoint metadata recorded"):
        dcp_to_ckz(path, path.parent / "out.ckz")


def test_data_file_of_another_checkpoint_is_detected(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path, _ = saved
    _save(_trained_state(3), tmp_path / "other")
    (path / "__0.ckzd").write_bytes((tmp_path / "other" / "__0.ckzd").read_bytes())
    with pytest.raises(CorruptCheckpointError, match=r"^item '"):
        dcp_to_ckz(path, path.parent / "out.ckz")


def test_damaged_metadata_file(saved: tuple[Path, dict[str, Any]]) -> None:
    path, _ = saved
    _flip(path / METADATA_FILE, 200)
    with pytest.raises(CorruptCheckpointError, match=rf"^checkpoint metadata '.*{METADATA_FILE}' is damaged: "):
        CompressedStorageReader(path).read_metadata()


def _document(path: Path) -> dict[str, Any]:
    return ckptzip.load(path / METADATA_FILE)


@pytest.mark.parametrize(
    ("edit", "error", "message"),
    [
        (lambda d: d["items"][0].update(file="../escape"), CorruptCheckpointError, r"data file name '\.\./escape' is not a plain file name"),
        (lambda d: d["items"][0].update(start=-1), CorruptCheckpointError, r"items\[0\]\.start must be a non-negative integer, found -1"),
        (lambda d: d["state_dict"]["ids"].update(dtype="float99"), CorruptCheckpointError, r"state_dict\['ids'\]\.dtype must be a torch dtype name, found 'float99'"),
        (lambda d: d.pop("items"), CorruptCheckpointError, r"document\.items must be present"),
        (lambda d: d.update(format="other"), CorruptCheckpointError, r"field 'format' must be 'ckptzip-dcp', found 'other'"),
        (lambda d: d.update(extra=1), CorruptCheckpointError, r"must be an object with keys"),
        (lambda d: d.update(version=3), UnsupportedFormatError, r"has ckptzip-dcp version 3; this ckptzip reads versions 1 and 2"),
        (lambda d: d["items"][0].update(tensor=-1), CorruptCheckpointError, r"items\[0\]\.tensor must be a non-negative integer, found -1"),
    ],
)
def test_invalid_metadata_is_refused(saved: tuple[Path, dict[str, Any]], edit: Any, error: type, message: str) -> None:
    path, _ = saved
    document = _document(path)
    edit(document)
    ckptzip.save(document, path / METADATA_FILE)
    with pytest.raises(error, match=message) as excinfo:
        CompressedStorageReader(path).read_metadata()
    assert type(excinfo.value) is error


def test_missing_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match=r"the checkpoint does not exist or its save did not finish"):
        CompressedStorageReader(tmp_path / "nothing").read_metadata()


def test_plain_dcp_checkpoint_is_pointed_to_filesystem_reader(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(3)}, storage_writer=FileSystemWriter(tmp_path / "plain"), no_dist=True)
    with pytest.raises(CheckpointNotFoundError, match=r"holds a plain DCP checkpoint .*; load it with torch\.distributed\.checkpoint\.FileSystemReader"):
        CompressedStorageReader(tmp_path / "plain").read_metadata()


def test_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _save(_trained_state(1), path)
    with pytest.raises(CheckpointException) as excinfo:
        _save(_trained_state(2), path, overwrite=False)
    error = _failure(excinfo)
    assert type(error) is CheckpointWriteError
    assert str(error).startswith(f"a checkpoint already exists at '{path}' ({METADATA_FILE}) and overwrite=False")
    _save(_trained_state(3), path)
    target = _trained_state(4)
    _load(target, path)
    assert_same(target, _trained_state(3))


def test_pickled_object_is_refused_unless_trusted(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _save({"obj": Opaque(5), "w": torch.ones(2)}, path)
    target: dict[str, Any] = {"obj": None, "w": torch.zeros(2)}
    with pytest.raises(CheckpointException) as excinfo:
        _load(target, path)
    error = _failure(excinfo)
    assert type(error) is UnsupportedObjectError
    assert str(error).startswith(f"item 'obj' in '{path / '__0.ckzd'}' is a pickled Python object")
    assert "(Unsupported global: GLOBAL test_dcp.Opaque was not an allowed global by default)" in str(error)
    assert "trusted_objects=True" in str(error)
    _load(target, path, trusted_objects=True)
    assert target["obj"] == Opaque(5)


def test_planner_data_that_needs_pickle_is_refused(tmp_path: Path) -> None:
    class OddPlanner(DefaultSavePlanner):
        def create_local_plan(self) -> Any:
            return dataclasses.replace(super().create_local_plan(), planner_data=object())

    with pytest.raises(CheckpointException) as excinfo:
        dcp.save({"w": torch.ones(2)}, storage_writer=CompressedStorageWriter(tmp_path), planner=OddPlanner(), no_dist=True)
    error = _failure(excinfo)
    assert type(error) is UnsupportedObjectError
    assert "planner_data of type object" in str(error)


def test_tensor_ckptzip_cannot_store_is_refused_with_its_name(tmp_path: Path) -> None:
    with pytest.raises(CheckpointException) as excinfo:
        _save({"sparse": torch.eye(3).to_sparse()}, tmp_path / "ckpt")
    error = _failure(excinfo)
    assert type(error) is UnsupportedObjectError
    assert str(error).startswith("item 'sparse' (chunk at offsets [0, 0]): ")
    assert "layout torch.sparse_coo" in str(error)


def test_unknown_codec_is_refused_at_construction(tmp_path: Path) -> None:
    with pytest.raises(CkptzipError, match=r"codec='nope' is neither a preset"):
        CompressedStorageWriter(tmp_path, codec="nope")


def test_codec_choice_is_recorded(tmp_path: Path) -> None:
    state = {"w": torch.randn(64, 64)}
    _save(state, tmp_path / "ckpt", codec="raw")
    assert _stored(tmp_path / "ckpt", "w").pipeline["codecs"] == [{"id": "raw"}]


def test_fsspec_url(saved: tuple[Path, dict[str, Any]]) -> None:
    fsspec = pytest.importorskip("fsspec")
    _, state = saved
    url = "memory://ckptzip-dcp-test/ckpt"
    try:
        _save(state, url)
        assert CompressedStorageReader.validate_checkpoint_id(url)
        target = _trained_state(2)
        _load(target, url)
        assert_same(target, state)
    finally:
        fsspec.filesystem("memory").rm("/ckptzip-dcp-test", recursive=True)


@pytest.mark.skipif(
    "use_collectives" not in inspect.signature(dcp.save).parameters, reason="DCP without use_collectives"
)
def test_save_without_collectives_writes_rank_metadata(tmp_path: Path) -> None:
    state = _trained_state(1)
    dcp.save(state, storage_writer=CompressedStorageWriter(tmp_path), no_dist=True, use_collectives=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["__0.ckzd", f"__0{METADATA_FILE}"]
    metadata = CompressedStorageReader(tmp_path).read_metadata(rank=0)
    assert {index.fqn for index in metadata.storage_data} >= {"model.0.weight", "note"}
    target = _trained_state(2)
    _load(target, tmp_path)  # DCP falls back to the rank's own metadata file
    assert_same(target, state)


def test_validate_checkpoint_id(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path, _ = saved
    assert CompressedStorageReader.validate_checkpoint_id(path)
    assert not CompressedStorageReader.validate_checkpoint_id(tmp_path / "nothing")
    assert CompressedStorageWriter.validate_checkpoint_id(tmp_path / "new")


def test_convert_to_ckz_and_back(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path, state = saved
    dcp_to_ckz(path, tmp_path / "one.ckz")
    assert_same(ckptzip.load(tmp_path / "one.ckz"), state, dict_type=False)  # rebuilt from DCP items as plain dicts
    ckz_to_dcp(tmp_path / "one.ckz", tmp_path / "again")
    target = _trained_state(2)
    _load(target, tmp_path / "again")
    assert_same(target, state)


@pytest.mark.parametrize("writer", ["ckptzip", "FileSystemWriter"])
def test_convert_to_ckz_keeps_an_optimizers_integer_keys_so_its_moments_attach(
    tmp_path: Path, writer: str, recwarn: pytest.WarningsRecorder
) -> None:
    """Issue #44: DCP stores every key as a string; an optimizer.state_dict() keyed "0", "1", ...
    loaded without error and attached no Adam moments."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.LayerNorm(8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(4, 16)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 3}
    storage = CompressedStorageWriter(tmp_path / "dcp") if writer == "ckptzip" else FileSystemWriter(tmp_path / "dcp")
    dcp.save(state, storage_writer=storage, no_dist=True)
    dcp_to_ckz(tmp_path / "dcp", tmp_path / "one.ckz", trusted_objects=writer != "ckptzip")
    loaded = ckptzip.load(tmp_path / "one.ckz")
    assert list(loaded["optim"]["state"]) == [0, 1, 2, 3]

    torch.manual_seed(1)
    resumed = nn.Sequential(nn.Linear(16, 8), nn.LayerNorm(8))
    resumed.load_state_dict(loaded["model"])
    again = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    again.load_state_dict(loaded["optim"])
    assert len(again.state) == 4
    for new, old in zip(resumed.parameters(), model.parameters()):
        assert set(again.state[new]) == {"step", "exp_avg", "exp_avg_sq"}
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert_same_tensor(again.state[new][key], optimizer.state[old][key], key)
    assert not [w for w in recwarn if "DCP stores every dict key as a string" in str(w.message)]


def test_convert_to_ckz_warns_of_other_dicts_whose_keys_read_as_integers(tmp_path: Path) -> None:
    state = {"per_layer": {"0": torch.ones(2), "1": torch.zeros(2)}, "named": {"07": torch.ones(1)},
             "optim": {"state": {"5": {"exp_avg": torch.ones(2)}}, "param_groups": [{"params": [0, 1]}]}}
    dcp.save(state, storage_writer=CompressedStorageWriter(tmp_path / "dcp"), no_dist=True)
    with pytest.warns(UserWarning, match=r"may have had integer keys; they keep string keys in the \.ckz: "
                      r"per_layer, optim\.state$"):
        dcp_to_ckz(tmp_path / "dcp", tmp_path / "one.ckz")
    loaded = ckptzip.load(tmp_path / "one.ckz")
    assert list(loaded["per_layer"]) == ["0", "1"] and list(loaded["optim"]["state"]) == ["5"]  # 5 is no parameter


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ckptzip")
    configure(parser.add_subparsers(dest="command").add_parser("dcp-convert"))
    return run(parser.parse_args(argv))


def test_cli_direction_follows_the_source(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, state = saved
    assert _cli(["dcp-convert", str(path), str(tmp_path / "one.ckz"), "--codec", "portable"]) == 0
    assert "(DCP directory -> .ckz)" in capsys.readouterr().out
    assert _cli(["dcp-convert", str(tmp_path / "one.ckz"), str(tmp_path / "back")]) == 0
    assert "(.ckz -> DCP directory)" in capsys.readouterr().out
    target = _trained_state(2)
    _load(target, tmp_path / "back")
    assert_same(target, state)


def test_cli_refuses_a_directory_that_is_not_a_ckptzip_dcp_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match=r"is a directory without ckptzip DCP metadata"):
        _cli(["dcp-convert", str(tmp_path), str(tmp_path / "x.ckz")])


def test_ckz_of_a_non_dict_cannot_become_a_dcp_checkpoint(tmp_path: Path) -> None:
    ckptzip.save([torch.ones(2)], tmp_path / "list.ckz")
    with pytest.raises(CkptzipError, match=r"holds a list; a DCP checkpoint is made from a dict state"):
        ckz_to_dcp(tmp_path / "list.ckz", tmp_path / "out")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_shards_roundtrip_on_their_device(tmp_path: Path) -> None:
    state = {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.randn(1024, device="cuda").half()}
    _save(state, tmp_path / "ckpt")
    target = {"w": torch.zeros(1024, 1024, device="cuda"), "b": torch.zeros(1024, device="cuda").half()}
    _load(target, tmp_path / "ckpt")
    assert target["w"].is_cuda
    assert_same(target, state)

