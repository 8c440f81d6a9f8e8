"""Tree walk hardening (issue #13): shared sub-objects, cycles, what save accepts, dtype lookup."""

from __future__ import annotations

import collections
import io
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import DTYPES, assert_same, mixed_state, random_tensor, roundtrip, save_bytes, tensor_from_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptzip
from ckptzip import CorruptCheckpointError, UnsupportedObjectError
from ckptzip.manager import CheckpointManager
from ckptzip.format import TORCH_DTYPES
from ckptzip.tree import MAX_DIMS, flatten, unflatten


def _unflatten(tree: object, tensors: list[torch.Tensor] | None = None) -> object:
    tensors = tensors or []
    return unflatten(tree, tensors.__getitem__, len(tensors))


# --- shared sub-objects and cycles -------------------------------------------------------------


def _doubling(levels: int) -> list:
    obj: list = [torch.arange(3)]
    for _ in range(levels):
        obj = [obj, obj]
    return obj


def test_doubling_list_of_2_to_the_26_leaves_saves_and_loads_quickly_with_its_aliasing(tmp_path: Path) -> None:
    obj = _doubling(26)
    torch.save(obj, tmp_path / "bomb.pt")
    assert (tmp_path / "bomb.pt").stat().st_size < 4096
    start = time.perf_counter()
    ckptzip.save(torch.load(tmp_path / "bomb.pt", weights_only=True), tmp_path / "bomb.ckz")
    back = ckptzip.load(tmp_path / "bomb.ckz")
    assert time.perf_counter() - start < 10
    node = back
    for _ in range(26):
        assert type(node) is list and len(node) == 2 and node[0] is node[1]
        node = node[0]
    assert_same(node, [torch.arange(3)])


def test_alias_encoding_numbers_containers_in_pre_order() -> None:
    inner = {"k": 1}
    pair = (inner,)
    tree = flatten({"x": pair, "y": inner, "z": pair, "w": [inner]}).tree
    assert tree == {
        "dict": [
            ["x", {"tuple": [{"dict": [["k", 1]]}]}],  # root dict is 0, the tuple 1, inner 2
            ["y", {"alias": 2}],
            ["z", {"alias": 1}],
            ["w", [{"alias": 2}]],
        ]
    }
    out = _unflatten(tree)
    assert out["y"] is out["x"][0] is out["w"][0] and out["z"] is out["x"]
    assert_same(out, {"x": pair, "y": inner, "z": pair, "w": [inner]})


def test_dict_keys_and_ordered_dict_metadata_are_numbered_like_the_encoder() -> None:
    key = (1, 2)
    od = collections.OrderedDict(a=[key])
    od._metadata = {"m": key}  # type: ignore[attr-defined]
    state = {key: od, "again": key}
    out = roundtrip(state)
    assert_same(out, state)
    got_key = next(iter(out))
    assert out["again"] is got_key and out[got_key]["a"][0] is got_key and out[got_key]._metadata["m"] is got_key


def test_ordinary_states_encode_without_alias_tags() -> None:
    assert "alias" not in json.dumps(flatten(mixed_state()).tree)


def test_indirect_cycle_is_refused_naming_its_path() -> None:
    inner: list = []
    outer = {"a": {"b": inner}}
    inner.append(outer)
    with pytest.raises(
        UnsupportedObjectError, match=r"value at 'a\.b\.0' is the dict at '<root>' that contains it \(a reference cycle\)"
    ):
        save_bytes(outer)


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ({"alias": 0}, r"tree refers to container 0, expected an index in \[0, 0\)"),
        ([[], {"alias": 2}], r"tree refers to container 2, expected an index in \[0, 2\)"),
        ([{"alias": 0}], "tree refers to container 0 from inside itself"),
        ({"tuple": [[{"alias": 0}]]}, "tree refers to container 0 from inside itself"),
        ([[], {"alias": True}], "tree refers to container True"),
        ([[], {"alias": "0"}], "tree refers to container '0'"),
        ({"alias": 0, "x": 1}, r"keys \['alias', 'x'\], expected \['alias'\]"),
    ],
)
def test_bad_aliases_are_corrupt(tree: object, message: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=message):
        _unflatten(tree)


# --- dtype names never import --------------------------------------------------------------------


def test_decoding_a_dtype_tag_never_imports_a_module() -> None:
    code = (
        "import sys, ckptzip.tree as t\n"
        "assert 'torch._inductor' not in sys.modules\n"
        "try:\n"
        "    t.unflatten({'dtype': '_inductor'}, [].__getitem__, 0)\n"
        "except t.CorruptCheckpointError as e:\n"
        "    print(e)\n"
        "assert 'torch._inductor' not in sys.modules, 'imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "malformed 'dtype' value: unknown torch dtype '_inductor'" in done.stdout


# --- what save accepts, load accepts -------------------------------------------------------------

_UNSUPPORTED = sorted(n for n, d in TORCH_DTYPES.items() if d not in DTYPES)


@pytest.mark.parametrize("name", _UNSUPPORTED)
def test_dtypes_outside_the_format_are_refused_at_save(name: str) -> None:
    t = torch.zeros(4, dtype=torch.uint8).view(TORCH_DTYPES[name])
    with pytest.raises(UnsupportedObjectError, match=r"tensor at 'w\.0'") as info:
        save_bytes({"w": [t]})
    assert "quantized" in str(info.value) or f"has dtype torch.{name}, which the ckptzip format cannot store" in str(
        info.value
    )


def test_more_than_max_dims_is_refused_and_max_dims_round_trips() -> None:
    assert MAX_DIMS == 64
    ok = torch.arange(2, dtype=torch.int16).reshape([1] * 63 + [2])
    assert_same(roundtrip({"t": ok}), {"t": ok})
    with pytest.raises(UnsupportedObjectError, match=r"tensor at 't' has 65 dimensions; .* at most 64\. Reshape"):
        save_bytes({"t": ok.reshape([1] * 64 + [2])})


def test_meta_tensor_is_refused_with_what_to_do() -> None:
    with pytest.raises(UnsupportedObjectError, match=r"tensor at 'm' is on the meta device .* materialize it"):
        save_bytes({"m": torch.empty(3, device="meta")})


def test_big_endian_numpy_arrays_load_back_little_endian_with_the_same_values() -> None:
    big = np.arange(12, dtype=">f4").reshape(3, 4)[:, ::2]
    back = roundtrip({"a": big, "s": np.array(-5, dtype=">i8")})
    assert back["a"].dtype == np.dtype("<f4") and back["s"].dtype == np.dtype("<i8")
    assert np.array_equal(back["a"], big) and back["s"] == -5
    assert back["a"].tobytes() == big.astype("<f4").tobytes()


@pytest.mark.parametrize("async_save", [True, False])
def test_manager_refuses_unstorable_state_at_the_call_and_commits_nothing(tmp_path: Path, async_save: bool) -> None:
    with CheckpointManager(tmp_path, keep_last=1, async_save=async_save) as manager:
        manager.save(1, {"w": torch.ones(2)})
        manager.wait()
        for bad in (torch.empty(2, device="meta"), torch.zeros(1).reshape([1] * 65)):
            with pytest.raises(UnsupportedObjectError, match="tensor at 'w'"):
                manager.save(2, {"w": bad})
        manager.wait()
        assert manager.all_steps() == [1]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".ckptzip.lock") == [
        "step_00000001.ckz"
    ]
    assert_same(CheckpointManager(tmp_path).restore(), {"w": torch.ones(2)})


# --- property: save accepts => load round-trips; else UnsupportedObjectError --------------------

_ALL_DTYPES = list(TORCH_DTYPES.values())


@st.composite
def _tensors(draw: st.DrawFn) -> torch.Tensor:
    ndim = draw(st.integers(0, 70))
    shape = [1] * ndim
    for _ in range(min(ndim, draw(st.integers(0, 3)))):
        shape[draw(st.integers(0, ndim - 1))] = draw(st.integers(0, 3))
    dtype = draw(st.sampled_from(_ALL_DTYPES))
    numel = int(np.prod(shape))
    data = draw(st.binary(min_size=numel * dtype.itemsize, max_size=numel * dtype.itemsize))
    if dtype in DTYPES:
        return tensor_from_bytes(data, dtype, tuple(shape))
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


@st.composite
def _arrays(draw: st.DrawFn) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(["<f4", ">f4", ">i8", "<u2", ">c8", "|b1", ">f2"])))
    shape = draw(st.lists(st.integers(0, 3), max_size=4))
    count = int(np.prod(shape))
    raw = np.frombuffer(draw(st.binary(min_size=count * dtype.itemsize, max_size=count * dtype.itemsize)), np.uint8)
    if dtype.kind == "b":
        raw = raw & 1
    return raw.view(dtype).reshape(shape).copy()


_names = st.text(st.characters(codec=None, exclude_categories=()), max_size=8)
_leaves = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | _names | st.binary(max_size=8)
    | _tensors() | _arrays()
)


def _share(x: Any) -> Any:
    return [x, x] if isinstance(x, (list, dict, tuple)) else x


_states = st.recursive(
    _leaves,
    lambda kids: (
        st.lists(kids, max_size=3)
        | st.lists(kids, max_size=3).map(tuple)
        | st.dictionaries(_names | st.integers(), kids, max_size=3)
    ).map(_share),
    max_leaves=8,
)


def _native(obj: Any) -> Any:
    """What load returns for ``obj``: NumPy arrays in native byte order, containers rebuilt."""
    if isinstance(obj, np.ndarray):
        return obj.astype(obj.dtype.newbyteorder("="))
    if isinstance(obj, list):
        return [_native(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_native(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _native(v) for k, v in obj.items()}
    return obj


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_states)
def test_whatever_save_accepts_load_returns_bit_exactly(state: Any) -> None:
    buf = io.BytesIO()
    try:
        ckptzip.save(state, buf)
    except UnsupportedObjectError:
        return
    assert_same(ckptzip.load(io.BytesIO(buf.getvalue())), _native(state))


def test_property_strategy_reaches_both_outcomes() -> None:
    assert_same(roundtrip({"x": random_tensor(torch.float32, (1,) * 64)}), {"x": random_tensor(torch.float32, (1,) * 64)})
    with pytest.raises(UnsupportedObjectError):
        save_bytes({"x": torch.zeros(1).reshape((1,) * 70)})


# --- one walker: shared sub-objects stay shared, expansion is counted first ---------------------


def _dag(levels: int) -> dict:
    """A dict whose values share the level below twice, ``levels`` deep: 2**levels paths."""
    obj: Any = {"w": torch.arange(3)}
    for _ in range(levels):
        obj = {"a": obj, "b": obj}
    return obj


def test_a_40_level_dag_of_aliases_loads_resaves_and_is_refused_by_dcp_convert(tmp_path: Path) -> None:
    from ckptzip.cli import main
    from ckptzip.dcp._convert import MAX_DCP_ITEMS

    ckptzip.save(_dag(40), tmp_path / "dag.ckz")
    assert (tmp_path / "dag.ckz").stat().st_size < 4096
    start = time.perf_counter()
    back = ckptzip.load(tmp_path / "dag.ckz")
    assert back["a"] is back["b"]
    ckptzip.save(back, tmp_path / "again.ckz")
    with pytest.raises(ckptzip.CkptzipError, match=rf"'.*dag.ckz' shares containers so that DCP, which stores every "
                                                   rf"path of a shared container again, would write {2**40} items, "
                                                   rf"more than {MAX_DCP_ITEMS}; nothing was written"):
        from ckptzip.dcp import ckz_to_dcp
        ckz_to_dcp(tmp_path / "dag.ckz", tmp_path / "dcp")
    assert main(["dcp-convert", str(tmp_path / "dag.ckz"), str(tmp_path / "dcp2")]) == 1
    assert time.perf_counter() - start < 10
    assert not (tmp_path / "dcp").exists() or not any((tmp_path / "dcp").iterdir())


def test_a_shallow_dag_within_the_bound_converts_to_dcp_expanded(tmp_path: Path) -> None:
    from ckptzip.dcp import ckz_to_dcp, dcp_to_ckz

    ckptzip.save(_dag(3), tmp_path / "dag.ckz")
    ckz_to_dcp(tmp_path / "dag.ckz", tmp_path / "dcp")
    dcp_to_ckz(tmp_path / "dcp", tmp_path / "back.ckz")
    assert_same(ckptzip.load(tmp_path / "back.ckz"), _dag(3))  # the same values, no longer shared


def test_walks_of_a_shared_tree_cost_its_nodes_and_keep_it_shared() -> None:
    from ckptzip.tree import expanded_leaves, iter_leaves, map_tree

    dag = _dag(60)
    assert expanded_leaves(dag) == 2**60 and expanded_leaves({"e": {}, "l": [], "x": 1}) == 3
    assert [path for path, _ in iter_leaves(dag)] == [".".join(["a"] * 60 + ["w"])]  # once, at its first path
    calls: list[str] = []
    mapped = map_tree(dag, lambda v, path: calls.append(path) or v.float())
    assert len(calls) == 1 and mapped["a"] is mapped["b"] and mapped["a"]["a"] is mapped["a"]["b"]
    assert map_tree(dag, lambda v, _: v) is dag  # nothing changed: nothing rebuilt


@pytest.mark.parametrize("size", [[2**63], [2**64], [3, 2**70], [-1]])
def test_a_size_outside_int64_is_corrupt(size: list[int]) -> None:
    with pytest.raises(CorruptCheckpointError, match=r"tree holds a malformed 'size' value: expected a list of "
                                                     r"integers in \[0, 2\*\*63\)"):
        _unflatten({"size": size})
    assert _unflatten({"size": [2**63 - 1, 0]}) == torch.Size([2**63 - 1, 0])


def test_an_index_entry_on_the_meta_device_is_refused() -> None:
    from helpers import load_bytes, rewrite_index

    def to_meta(index: dict) -> None:
        index["tensors"][0]["device"] = "meta"

    blob = rewrite_index(save_bytes({"w": torch.ones(4)}), to_meta)
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'w' has device 'meta', expected a torch device "
                                                     r"string of a device that holds data \(not 'meta'\)"):
        load_bytes(blob)
