"""save → load gives back the same object: structure, Python types, tensor bits."""

from __future__ import annotations

import collections
import copy
import io
import math
import struct
from typing import Any

import numpy as np
import pytest
import torch
from helpers import (
    CPU_CODECS,
    DTYPES,
    PRESETS,
    adamw_state,
    assert_same,
    assert_same_tensor,
    float_from_bits,
    load_bytes,
    mixed_state,
    random_tensor,
    roundtrip,
    save_bytes,
    SMALL_CHUNK_BYTES,
    small_chunks,
    small_model,
    tensor_from_bytes,
    train_steps,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptzip
from ckptzip import CkptzipError

CODECS = PRESETS + CPU_CODECS
SHAPES = [(), (0,), (3, 0), (1,), (7,), (5, 3), (2, 3, 4), (4099,)]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_and_codec_is_bit_exact(dtype: torch.dtype, codec: str) -> None:
    obj = {f"t{i}": random_tensor(dtype, shape, seed=i) for i, shape in enumerate(SHAPES)}
    got = roundtrip(obj, codec=codec)
    assert list(got) == list(obj)
    assert_same(got, obj)


# -0.0, +inf, -inf, the smallest subnormal, a signalling NaN with a payload, a negative quiet NaN
# with a payload, the largest finite value.
SPECIAL_FLOAT_BITS = {
    torch.float64: (
        8,
        [1 << 63, 0x7FF << 52, 0xFFF << 52, 1, (0x7FF << 52) | 1, 0xFFF8_0000_0000_BEEF, 0x7FEF_FFFF_FFFF_FFFF],
    ),
    torch.float32: (4, [1 << 31, 0x7F80_0000, 0xFF80_0000, 1, 0x7F80_0001, 0xFFC0_BEEF, 0x7F7F_FFFF]),
    torch.float16: (2, [1 << 15, 0x7C00, 0xFC00, 1, 0x7C01, 0xFE0F, 0x7BFF]),
    torch.bfloat16: (2, [1 << 15, 0x7F80, 0xFF80, 1, 0x7F81, 0xFFC1, 0x7F7F]),
}


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", list(SPECIAL_FLOAT_BITS), ids=str)
def test_special_float_bits_survive(dtype: torch.dtype, codec: str) -> None:
    size, patterns = SPECIAL_FLOAT_BITS[dtype]
    pattern = b"".join(p.to_bytes(size, "little") for p in patterns)
    t = tensor_from_bytes(pattern * 1000, dtype, (1000 * len(patterns),))  # > 4 KiB: byte planes under presets
    got = roundtrip({"t": t}, codec=codec)["t"]
    assert_same_tensor(got, t)
    assert torch.signbit(got[0]) and got[0] == 0
    assert torch.isnan(got[4]) and torch.isnan(got[5]) and torch.isinf(got[1])


def test_python_values_keep_type_and_bits() -> None:
    nan_with_payload = float_from_bits(0x7FF8_DEAD_BEEF_0001)
    obj: dict[str, Any] = {
        "int": 7,
        "negative": -(2**70),
        "big": 2**200 + 1,
        "zero": 0,
        "float": 0.1,
        "neg_zero": -0.0,
        "inf": math.inf,
        "ninf": -math.inf,
        "nan": nan_with_payload,
        "signalling_nan": float_from_bits(0x7FF0_0000_0000_0001),
        "tiny": 5e-324,
        "true": True,
        "false": False,
        "none": None,
        "str": "ünïcødé \x00 \ud800 \U0001f600",
        "empty_str": "",
        "bytes": bytes(range(256)),
        "empty_bytes": b"",
        "list": [1, [2, [3]]],
        "tuple": (1, (2.5, "x"), ()),
        "empty_dict": {},
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "size": torch.Size([2, 3]),
    }
    got = roundtrip(obj)
    assert_same(got, obj)
    assert struct.pack(">d", got["nan"]) == struct.pack(">d", nan_with_payload)


def test_dict_order_and_key_types_are_kept() -> None:
    obj = {"z": 1, "a": 2, 3: "int key", (1, "t"): "tuple key", None: "none key", 2.5: "float key", False: 0}
    got = roundtrip(obj)
    assert list(got) == list(obj)
    assert_same(got, obj)


def test_ordered_dict_metadata_is_kept() -> None:
    sd = small_model().state_dict()
    assert isinstance(sd, collections.OrderedDict) and sd._metadata  # type: ignore[attr-defined]
    got = roundtrip(sd)
    assert type(got) is collections.OrderedDict
    assert got._metadata == sd._metadata  # type: ignore[attr-defined]
    assert_same(got, sd)
    plain = collections.OrderedDict(a=1)
    assert not hasattr(roundtrip(plain), "_metadata")


def test_numpy_arrays_and_scalars() -> None:
    obj = {
        "array": np.arange(12, dtype=np.int16).reshape(3, 4),
        "strided": np.arange(20.0)[::3],
        "f64": np.float64(1.5),
        "f16": np.float16(-0.0),
        "i32": np.int32(-5),
        "u64": np.uint64(2**64 - 1),
        "bool": np.bool_(True),
        "str": np.str_("np"),
        "c64": np.complex64(1 + 2j),
    }
    got = roundtrip(obj)
    assert_same(got, {**obj, "strided": np.ascontiguousarray(obj["strided"])})


def test_non_contiguous_views_come_back_contiguous() -> None:
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    views = {
        "transposed": base.transpose(0, 2),
        "stepped": base[:, ::2, 1::3],
        "expanded": torch.tensor([1.0, 2.0]).expand(1000, 2),
        "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "offset": base.reshape(-1)[7:19],
        "conj": torch.randn(6, dtype=torch.complex64).conj(),
        "neg_imag": torch.randn(6, dtype=torch.complex64).conj().imag,
    }
    got = roundtrip(views)
    for name, view in views.items():
        assert got[name].is_contiguous(), name
        assert not got[name].is_conj() and not got[name].is_neg(), name
        assert_same_tensor(got[name], view.resolve_conj().resolve_neg().contiguous(), name)


def test_tied_tensors_load_as_one_tensor() -> None:
    w = torch.randn(8, 4)
    obj = {"encoder": w, "decoder": w, "nested": [w, (w,)], "other": w.clone(), "row": w[1]}
    data = save_bytes(obj)
    with ckptzip.open(io.BytesIO(data)) as reader:
        assert reader.keys() == ["encoder", "other", "row"]  # stored once, by first path
    got = load_bytes(data)
    assert got["encoder"] is got["decoder"] is got["nested"][0] is got["nested"][1][0]
    assert got["other"] is not got["encoder"]
    assert_same_tensor(got["encoder"], w)
    assert_same_tensor(got["row"], w[1])


def test_tied_weights_of_a_model() -> None:
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    got = roundtrip(model.state_dict())
    assert got["emb.weight"] is got["head.weight"]


def test_parameters_and_grad_tensors_load_as_plain_tensors() -> None:
    p = torch.nn.Parameter(torch.randn(3, 3))
    y = p * 2  # requires grad, has a grad_fn
    got = roundtrip({"p": p, "y": y})
    assert_same_tensor(got["p"], p.detach())
    assert_same_tensor(got["y"], y.detach())
    assert not got["p"].requires_grad


@pytest.mark.parametrize("codec", CODECS)
def test_tensors_spanning_many_chunks(codec: str) -> None:
    smooth = torch.linspace(-1, 1, 5000, dtype=torch.float32)  # compressible exponent plane
    obj = {
        "smooth": smooth,
        "random": random_tensor(torch.float64, (1001,), seed=5),
        "ints": torch.arange(3333, dtype=torch.int32) % 17,
        "exact": torch.zeros(SMALL_CHUNK_BYTES, dtype=torch.uint8),  # exactly one chunk
        "one_more": torch.ones(SMALL_CHUNK_BYTES + 1, dtype=torch.uint8),
    }
    data = save_bytes(obj, codec=small_chunks(codec))
    with ckptzip.open(io.BytesIO(data)) as reader:
        entries = {e.name: e for e in reader.entries()}
    for entry in entries.values():
        for stream in entry.streams:
            assert all(c.raw_length <= SMALL_CHUNK_BYTES for c in stream.chunks)
            assert sum(c.raw_length for c in stream.chunks) == stream.nbytes
    assert len(entries["random"].streams[0].chunks) > 1
    assert len(entries["exact"].streams[0].chunks) == 1
    assert len(entries["one_more"].streams[0].chunks) == 2
    assert_same(load_bytes(data), obj)


@pytest.mark.parametrize("codec", CPU_CODECS)
def test_codec_id_is_used_for_every_compressible_stream(codec: str) -> None:
    data = save_bytes({"a": torch.zeros(5000), "b": torch.arange(3000) % 3}, codec=codec)
    with ckptzip.open(io.BytesIO(data)) as reader:
        for entry in reader.entries():
            assert entry.transforms == []
            assert entry.codecs == [codec], entry.name
        if codec != "raw":
            assert reader.ratio > 10


@pytest.mark.parametrize("codec", CPU_CODECS)
def test_incompressible_streams_are_stored_raw_not_expanded(codec: str) -> None:
    t = random_tensor(torch.uint8, (20000,), seed=9)
    data = save_bytes({"t": t}, codec=codec)
    with ckptzip.open(io.BytesIO(data)) as reader:
        (entry,) = reader.entries()
    assert entry.codecs == ["raw"]
    assert entry.compressed_nbytes == t.numel()


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_split_floats_into_byte_planes(preset: str) -> None:
    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(4096, generator=gen)
    data = save_bytes(
        {"w": weights, "tiny": torch.randn(10), "bytes": torch.zeros(8192, dtype=torch.uint8)}, codec=preset
    )
    with ckptzip.open(io.BytesIO(data)) as reader:
        entries = {e.name: e for e in reader.entries()}
    assert entries["w"].transforms == [{"id": "byteplanes", "itemsize": 4}]
    assert entries["w"].codecs[:3] == ["raw", "raw", "raw"]  # near-random mantissa bytes
    assert entries["w"].codecs[3] == "zstd"  # sign and exponent
    assert entries["tiny"].transforms == [] and entries["bytes"].transforms == []
    assert entries["bytes"].codecs == ["zstd"]
    assert_same(load_bytes(data)["w"], weights)


def test_unknown_codec_argument_lists_choices() -> None:
    with pytest.raises(CkptzipError, match=r"codec='brotli' is neither a preset \['auto', 'fast', 'portable', 'huff'\]"):
        save_bytes({"t": torch.zeros(1)}, codec="brotli")


@pytest.mark.parametrize("as_str", [True, False])
def test_paths_and_file_objects(tmp_path, as_str: bool) -> None:
    obj = mixed_state()
    path = tmp_path / "ckpt.ckz"
    ckptzip.save(obj, str(path) if as_str else path)
    assert_same(ckptzip.load(str(path) if as_str else path), obj)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.ckz"]  # no temporary file left
    with path.open("rb") as f:
        assert_same(ckptzip.load(f), obj)
    buf = io.BytesIO(b"prefix is not part of it")
    buf.seek(0, io.SEEK_END)
    ckptzip.save(obj, buf)
    assert buf.getvalue().startswith(b"prefix")
    assert_same(load_bytes(buf.getvalue()[len(b"prefix is not part of it") :]), obj)


def test_save_overwrites_an_existing_checkpoint(tmp_path) -> None:
    path = tmp_path / "ckpt.ckz"
    ckptzip.save({"v": 1}, path)
    ckptzip.save({"v": 2}, path)
    assert ckptzip.load(path) == {"v": 2}


@pytest.mark.parametrize("map_location", ["cpu", torch.device("cpu"), {"cpu": "cpu"}, {"cuda:0": "cpu"}, None])
def test_map_location(map_location) -> None:
    obj = {"t": torch.randn(3)}
    got = load_bytes(save_bytes(obj), map_location=map_location)
    assert got["t"].device == torch.device("cpu")
    assert_same(got, obj)


def test_map_location_meta_keeps_dtype_and_shape() -> None:
    got = load_bytes(save_bytes({"t": torch.randn(3, 2, dtype=torch.float16)}), map_location="meta")
    assert (got["t"].device.type, got["t"].dtype, got["t"].shape) == ("meta", torch.float16, (3, 2))


def test_missing_file_raises_checkpoint_not_found(tmp_path) -> None:
    with pytest.raises(ckptzip.CheckpointNotFoundError, match="no checkpoint at") as info:
        ckptzip.load(tmp_path / "absent.ckz")
    assert isinstance(info.value, FileNotFoundError)


def test_adamw_state_dict_resumes_identically() -> None:
    model, optimizer = adamw_state(steps=3)
    got = roundtrip({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 1})
    assert_same(got["model"], model.state_dict())
    assert_same(got["optimizer"], optimizer.state_dict())
    assert type(got["optimizer"]["param_groups"][0]["betas"]) is tuple

    resumed = small_model(seed=42)  # different initial weights, all overwritten by the load
    resumed.load_state_dict(got["model"])
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=0.5)
    resumed_opt.load_state_dict(got["optimizer"])

    original = copy.deepcopy(model)
    original_opt = torch.optim.AdamW(original.parameters())
    original_opt.load_state_dict(optimizer.state_dict())
    train_steps(original, original_opt, 2, seed=7)
    train_steps(resumed, resumed_opt, 2, seed=7)
    assert_same(resumed.state_dict(), original.state_dict())
    assert_same(resumed_opt.state_dict(), original_opt.state_dict())


def test_open_reads_tensors_lazily_by_name() -> None:
    obj = mixed_state()
    with ckptzip.open(io.BytesIO(save_bytes(obj))) as reader:
        keys = reader.keys()
        assert "model.0.weight" in keys and "model.0.weight" in reader and len(reader) == len(keys)
        assert_same_tensor(reader["model.0.weight"], obj["model"]["0.weight"])
        assert_same_tensor(reader["bits"], obj["bits"])
        assert reader.nbytes == sum(e.nbytes for e in reader.entries())
        with pytest.raises(KeyError, match="no tensor or value named 'absent' in this checkpoint; keys"):
            reader["absent"]


def test_open_gives_the_values_that_are_not_tensors_by_their_dotted_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #44: ``ckptzip.open(p)["step"]`` was a KeyError."""
    _, optimizer = adamw_state(steps=2)
    groups = optimizer.state_dict()["param_groups"]
    shared = {"kind": "cosine"}
    obj = {"model": {"w": torch.ones(3)}, "optimizer": optimizer.state_dict(), "step": 1000, "empty": {},
           "sched": shared, "again": shared, "name": "run-7", "mixed": [torch.zeros(1), 2.5]}
    monkeypatch.setattr(ckptzip.api, "read_tensors", None)  # values come from the index: nothing is decoded
    with ckptzip.open(io.BytesIO(save_bytes(obj))) as reader:
        assert (reader["step"], reader["name"], reader["empty"], reader["mixed.1"]) == (1000, "run-7", {}, 2.5)
        assert reader["optimizer.param_groups.0.lr"] == groups[0]["lr"]
        assert reader["optimizer.param_groups"] == groups and reader["again"] == shared
        assert "step" in reader and "optimizer.param_groups.0" in reader and "optimizer" not in reader
        reader["optimizer.param_groups"][0]["lr"] = 0
        assert reader["optimizer.param_groups.0.lr"] == groups[0]["lr"]  # each access its own copy
        with pytest.raises(KeyError, match=r"'optimizer' is a container in this checkpoint: ckpt\[\.\.\.\] gives its "
                           r"tensors and values by their dotted paths \('optimizer\.state\.0\.step', \.\.\.\), and load\(\)"):
            reader["optimizer"]
        with pytest.raises(KeyError, match="'mixed' is a container"):
            reader["mixed"]


# --- compress / decompress -------------------------------------------------------------------


@pytest.mark.parametrize("codec", CODECS)
def test_compressed_tensor(codec: str) -> None:
    t = (torch.arange(10000) % 7).float().reshape(100, 100)
    ct = ckptzip.compress(t, codec=codec)
    assert (ct.dtype, ct.shape, ct.nbytes) == (torch.float32, torch.Size([100, 100]), 40000)
    blob = ct.to_bytes()
    assert isinstance(blob, bytes) and ct.compressed_nbytes == len(blob) == len(ct)
    assert ct.ratio == pytest.approx(ct.nbytes / ct.compressed_nbytes)
    if codec != "raw":
        assert ct.ratio > 5
    again = ckptzip.CompressedTensor.from_bytes(bytearray(blob))
    assert (again.dtype, again.shape, again.nbytes) == (ct.dtype, ct.shape, ct.nbytes)
    assert_same_tensor(ckptzip.decompress(again), t)
    assert_same_tensor(ckptzip.decompress(blob, device="cpu"), t)
    assert "CompressedTensor(dtype=torch.float32, shape=(100, 100)" in repr(ct)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compress_every_dtype(dtype: torch.dtype) -> None:
    for shape in [(), (0,), (33, 3)]:
        t = random_tensor(dtype, shape, seed=1)
        assert_same_tensor(ckptzip.decompress(ckptzip.compress(t)), t)


def test_compress_rejects_non_tensors_and_checkpoints() -> None:
    with pytest.raises(TypeError, match=r"compress\(\) takes a torch\.Tensor, got list"):
        ckptzip.compress([1, 2])  # type: ignore[arg-type]
    with pytest.raises(CkptzipError, match="holds a checkpoint of 2 tensors, expected exactly one"):
        ckptzip.CompressedTensor.from_bytes(save_bytes({"a": torch.ones(1), "b": torch.zeros(1)}))


# --- property-based -------------------------------------------------------------------------


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 6), max_size=3)))
    data = draw(st.binary(min_size=math.prod(shape) * dtype.itemsize, max_size=math.prod(shape) * dtype.itemsize))
    return tensor_from_bytes(data, dtype, shape)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(t=tensors(), codec=st.sampled_from(CODECS), big=st.booleans())
def test_property_tensor_roundtrip(t: torch.Tensor, codec: str, big: bool) -> None:
    if big:  # past SMALL_TENSOR_BYTES, so presets plan byte planes
        t = t.reshape(-1).repeat(max(1, 5000 // max(1, t.numel())))
    assert_same_tensor(roundtrip(t, codec=codec), t)


_keys = st.one_of(st.text(max_size=8), st.integers(-(2**70), 2**70), st.none(), st.booleans())
_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**128), 2**128),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(0, 2**64 - 1).map(float_from_bits),  # every bit pattern, NaN payloads included
    st.text(max_size=12),
    st.binary(max_size=12),
)
_values = st.recursive(
    _leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(_keys, inner, max_size=4),
        st.dictionaries(st.text(max_size=5), inner, max_size=4).map(collections.OrderedDict),
    ),
    max_leaves=25,
)


@settings(max_examples=100, deadline=None)
@given(obj=_values)
def test_property_python_structure_roundtrip(obj: object) -> None:
    assert_same(roundtrip(obj), obj)
