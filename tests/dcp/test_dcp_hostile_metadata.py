"""ckptzip.dcp against hostile but hash-valid metadata (issue #13): every field a reader trusts
for an allocation is checked first, and damaged metadata surfaces where docs/DCP.md says."""

from __future__ import annotations

import copy
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckptzip
from ckptzip.dcp import CompressedStorageReader, CompressedStorageWriter, dcp_to_ckz
from ckptzip.dcp._metadata import METADATA_FILE
from ckptzip.errors import CorruptCheckpointError

STATE = {
    "ids": torch.arange(11, dtype=torch.int64),
    "half": torch.arange(35, dtype=torch.float32).reshape(5, 7),
    "groups": [{"lr": torch.tensor(0.5)}, {"lr": torch.tensor(0.25)}],
    "step": 7,
}


@pytest.fixture
def path(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    dcp.save(copy.deepcopy(STATE), storage_writer=CompressedStorageWriter(path), no_dist=True)
    return path


def _edit(path: Path, edit: Any) -> None:
    """Change the metadata document and write it back as a valid (hash-consistent) .ckz file."""
    document = ckptzip.load(path / METADATA_FILE)
    edit(document)
    ckptzip.save(document, path / METADATA_FILE)


def _item(document: dict[str, Any], fqn: str) -> dict[str, Any]:
    (item,) = [item for item in document["items"] if item["fqn"] == fqn]
    return item


def _refused(path: Path, message: str) -> None:
    """Both the reader and the converter refuse, quickly, before allocating anything."""
    start = time.perf_counter()
    with pytest.raises(CorruptCheckpointError, match=message):
        CompressedStorageReader(path).read_metadata()
    with pytest.raises(CorruptCheckpointError, match=message):
        dcp_to_ckz(path, path.parent / "out.ckz")
    assert time.perf_counter() - start < 5
    assert not (path.parent / "out.ckz").exists()


def test_list_positions_in_planner_paths_are_bounded(path: Path) -> None:
    assert ckptzip.load(path / METADATA_FILE)["planner_data"]["groups.1.lr"] == ["groups", 1, "lr"]
    _edit(path, lambda d: d["planner_data"].update({"groups.1.lr": ["groups", 30_000_000, "lr"]}))
    _refused(path, r"planner_data\['groups\.1\.lr'\] must be a path whose list positions fit the 2 keys stored under that list, found 30000000")


def test_a_huge_declared_size_is_refused_before_allocation(path: Path) -> None:
    _edit(path, lambda d: d["state_dict"]["ids"].update(size=[2**33]))
    _refused(path, r"state_dict\['ids'\]\.chunks must be chunks covering its 8589934592 elements, found 11;")


def test_a_size_larger_than_its_chunks_is_refused(path: Path) -> None:
    _edit(path, lambda d: d["state_dict"]["half"].update(size=[6, 7]))
    _refused(path, r"state_dict\['half'\]\.chunks must be chunks covering its 42 elements, found 35;")


def test_overlapping_chunks_are_refused(path: Path) -> None:
    def overlap(document: dict[str, Any]) -> None:
        entry = document["state_dict"]["half"]
        entry.update(size=[6, 7], chunks=[{"offsets": [0, 0], "sizes": [3, 7]}, {"offsets": [2, 0], "sizes": [3, 7]}])
        document["items"].append({**_item(document, "half"), "offset": [2, 0]})

    _edit(path, overlap)
    _refused(path, r"state_dict\['half'\]\.chunks must be chunks that do not overlap, found \(\[0, 0\], \[2, 0\]\)")


def test_a_chunk_outside_its_tensor_is_refused(path: Path) -> None:
    _edit(path, lambda d: d["state_dict"]["half"]["chunks"][0].update(sizes=[5, 8]))
    _refused(path, r"state_dict\['half'\]\.chunks\[0\] must be inside the tensor's size \[5, 7\]")


def test_a_chunk_without_a_stored_item_is_refused(path: Path) -> None:
    _edit(path, lambda d: d["items"].remove(_item(d, "half")))
    _refused(path, r"state_dict\['half'\]\.chunks\[0\]\.offsets must be the offsets of a stored item, found \[0, 0\];")


def test_an_item_past_the_end_of_its_data_file_is_refused_before_reading(path: Path) -> None:
    _edit(path, lambda d: _item(d, "ids").update(tensor=2**62))
    start = time.perf_counter()
    with pytest.raises(CorruptCheckpointError, match=rf"^item 'ids' \(chunk at offsets \[0\]\): the checkpoint metadata places it at tensor {2**62} of "):
        dcp_to_ckz(path, path.parent / "out.ckz")
    assert time.perf_counter() - start < 5


def test_damaged_metadata_where_the_docs_say(path: Path) -> None:
    data = bytearray((path / METADATA_FILE).read_bytes())
    data[200] ^= 0x01
    (path / METADATA_FILE).write_bytes(bytes(data))
    message = rf"checkpoint metadata '.*{METADATA_FILE}' is damaged: "
    with pytest.raises(CorruptCheckpointError, match="^" + message):
        dcp_to_ckz(path, path.parent / "out.ckz")
    # dcp.load itself: DCP catches read_metadata's error and raises an AssertionError quoting it
    # (in one process; a CheckpointException holding that AssertionError when distributed).
    with pytest.raises((AssertionError, CheckpointException)) as info:
        dcp.load(copy.deepcopy(STATE), storage_reader=CompressedStorageReader(path), no_dist=True)
    error = info.value
    if isinstance(error, CheckpointException):
        ((error, _trace),) = error.failures.values()
    assert type(error) is AssertionError
    assert re.search("global metadata read failed: " + message, str(error))


def test_valid_checkpoints_still_load(path: Path) -> None:
    target = copy.deepcopy(STATE)
    for value in (target["ids"], target["half"]):
        value.zero_()
    dcp.load(target, storage_reader=CompressedStorageReader(path), no_dist=True)
    assert torch.equal(target["half"], STATE["half"]) and torch.equal(target["ids"], STATE["ids"])


def _leaves(node: Any, path: tuple = ()) -> list[tuple]:
    """Paths to every value in a nested document of dicts and lists."""
    out = [path]
    if isinstance(node, dict):
        for key, value in node.items():
            out += _leaves(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += _leaves(value, (*path, i))
    return out


_REPLACEMENTS = [None, -1, 0, 2**62, 2**64, 1.5, True, "", "x" * 300, "../etc", [], {}, [2**40], {"a": 1}]


def test_fuzzed_metadata_loads_or_is_refused_with_a_ckptzip_error(path: Path) -> None:
    """Seeded random edits of a valid metadata document (values replaced, keys dropped), written
    back hash-consistent: converting the checkpoint either succeeds or raises a CkptzipError,
    promptly (dcp-convert reads exactly what the metadata says, with no target state to guide it)."""
    import random

    original = ckptzip.load(path / METADATA_FILE)
    rng = random.Random(0)
    outcomes = {"loaded": 0, "refused": 0}
    for _ in range(150):
        document = copy.deepcopy(original)
        where = rng.choice(_leaves(document)[1:])
        parent = document
        for key in where[:-1]:
            parent = parent[key]
        if isinstance(parent, dict) and rng.random() < 0.3:
            del parent[where[-1]]
        else:
            parent[where[-1]] = copy.deepcopy(rng.choice(_REPLACEMENTS))
        ckptzip.save(document, path / METADATA_FILE)
        start = time.perf_counter()
        out = path.parent / "out.ckz"
        try:
            dcp_to_ckz(path, out, trusted_objects=False)
            outcomes["loaded"] += 1
        except ckptzip.CkptzipError:
            outcomes["refused"] += 1
        out.unlink(missing_ok=True)
        assert time.perf_counter() - start < 10
    assert outcomes["refused"] > 50


def test_planner_data_must_map_every_stored_key(path: Path) -> None:
    _edit(path, lambda d: d["planner_data"].pop("groups.0.lr"))
    _refused(path, r"planner_data must be a path for every stored state_dict entry, found \"none for \['groups\.0\.lr'\]\"")


def test_a_data_file_name_longer_than_a_file_system_allows_is_refused(path: Path) -> None:
    _edit(path, lambda d: _item(d, "ids").update(file="x" * 300))
    _refused(path, r"data file name 'x+' is not a plain file name")
