"""Format 2.1 sources (docs/FORMAT.md): bf16/fp16 tensors stored as casts of fp32 tensors,
duplicates stored once, and the index checks that guard them."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from helpers import assert_same, load_bytes, rewrite_index, save_bytes, tensor_bits, with_preamble

import ckptzip
from ckptzip.engine.derive import SAMPLES, cast
from ckptzip.errors import CorruptCheckpointError, MissingBaseError, UnsupportedFormatError


def _entries(blob: bytes) -> dict[str, Any]:
    with ckptzip.open(blob) as reader:
        return {e.name: e for e in reader.entries()}


def _version(blob: bytes) -> tuple[int, int]:
    with ckptzip.open(blob) as reader:
        return reader._reader.index.version


def _master(seed: int = 0, shape: tuple[int, ...] = (300, 257)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02


def _unsampled(n: int) -> int:
    """An element index that the sampled check does not look at."""
    sampled = set(torch.linspace(0, n - 1, min(n, SAMPLES)).long().tolist())
    return next(i for i in range(n // 3, n) if i not in sampled)


# ------------------------------------------------------------------------------------------ casts


EDGE_VALUES = [0.0, -0.0, 1.0, -1.5, 65504.0, 65519.99, 65520.0, 1e30, -1e30, 1e-8, 2**-25, 2**-24, 3 * 2**-26,
               1.5 * 2**-24, 2**-14, 2**-14 - 2**-25, 1e-40, -1e-45, float("inf"), float("-inf")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_is_round_to_nearest_even_as_torch_casts(dtype: torch.dtype) -> None:
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 18,), generator=torch.Generator().manual_seed(3), dtype=torch.int64)
    x = torch.cat([bits.to(torch.int32).view(torch.float32), torch.tensor(EDGE_VALUES)])
    x = x[~torch.isnan(x)]
    assert torch.equal(tensor_bits(cast(x, dtype)), tensor_bits(x.to(dtype)))


def test_cast_of_a_nan_keeps_sign_and_top_payload_and_is_quiet() -> None:
    nans = torch.tensor([0x7F800001, 0xFFC12345, 0x7FFFFFFF], dtype=torch.int64).to(torch.int32).view(torch.float32)
    assert cast(nans, torch.bfloat16).view(torch.int16).tolist() == [0x7FC0, 0xFFC1 - 0x10000, 0x7FFF]
    assert cast(nans, torch.float16).view(torch.int16).tolist() == [0x7E00, 0xFE09 - 0x10000, 0x7FFF]


def test_bf16_and_fp16_copies_of_fp32_masters_are_stored_as_casts() -> None:
    master = _master()
    state = {"model": {"w": master.bfloat16(), "h": master.half()}, "master": {"w": master},
             "exp_avg": torch.randn(300, 257)}
    blob = save_bytes(state)
    entries = _entries(blob)
    assert entries["model.w"].source == {"cast": 2} and entries["model.w"].compressed_nbytes == 0
    assert entries["model.h"].source == {"cast": 2} and entries["model.h"].streams == []
    assert entries["master.w"].source is None and entries["exp_avg"].source is None
    assert _version(blob) == (2, 1)
    assert_same(load_bytes(blob), state)


def test_a_bf16_tensor_that_is_not_a_cast_is_stored() -> None:
    master = _master()
    other = _master(seed=1).bfloat16()  # same shape, other values
    truncated = (master.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)  # rounds toward zero
    state = {"master": master, "other": other, "truncated": truncated}
    blob = save_bytes(state)
    entries = _entries(blob)
    assert entries["other"].source is None and entries["truncated"].source is None
    assert _version(blob) == (2, 0)  # nothing of 2.1 used: readers of 2.0 read it
    assert_same(load_bytes(blob), state)


@pytest.mark.parametrize("where", ["first", "unsampled", "last"])
def test_a_bf16_tensor_differing_from_the_cast_in_one_element_is_stored(where: str) -> None:
    master = _master()
    near = master.bfloat16()
    n = near.numel()
    k = {"first": 0, "unsampled": _unsampled(n), "last": n - 1}[where]
    near.view(-1).view(torch.int16)[k] ^= 1  # one ulp off
    blob = save_bytes({"master": master, "near": near})
    assert _entries(blob)["near"].source is None
    assert_same(load_bytes(blob), {"master": master, "near": near})


def test_casts_are_only_of_tensors_of_the_same_shape() -> None:
    master = _master()
    state = {"master": master, "flat": master.reshape(-1).bfloat16()}
    assert _entries(save_bytes(state))["flat"].source is None


def test_a_cast_loads_lazily_and_onto_its_target_device() -> None:
    master = _master()
    blob = save_bytes({"master": master, "w": master.bfloat16()})
    with ckptzip.open(blob) as reader:
        assert torch.equal(tensor_bits(reader["w"]), tensor_bits(master.bfloat16()))


def test_a_damaged_cast_checksum_is_caught() -> None:
    master = _master()
    blob = save_bytes({"master": master, "w": master.bfloat16()})

    def edit(index: dict) -> None:
        index["tensors"][1]["checksum"] = "wsum64:" + "0" * 16

    with pytest.raises(CorruptCheckpointError, match=r"tensor 'w' \(cast of another tensor\) rebuilt with checksum"):
        load_bytes(rewrite_index(blob, edit))


def test_a_cast_whose_source_was_damaged_names_the_source() -> None:
    master = _master()
    blob = bytearray(save_bytes({"master": master, "w": master.bfloat16()}))
    blob[16 + 100] ^= 0xFF  # a stored byte of master
    with pytest.raises(CorruptCheckpointError, match="'master'"):
        load_bytes(bytes(blob))


# ------------------------------------------------------------------------------------- duplicates


def test_identical_tensors_are_stored_once_and_load_as_separate_tensors() -> None:
    a = _master()
    state = {"a": a, "b": a.clone(), "c": a.clone().view(torch.int32), "tied": [a, a]}
    blob = save_bytes(state)
    entries = _entries(blob)
    assert entries["b"].source == {"copy": 0} and entries["b"].compressed_nbytes == 0
    assert entries["c"].source == {"copy": 0} and entries["c"].dtype == "int32"
    got = load_bytes(blob)
    assert_same(got, state)
    assert got["tied"][0] is got["tied"][1] is got["a"]  # tensors that were one stay one
    assert got["b"].data_ptr() != got["a"].data_ptr()
    got["b"].zero_()
    assert torch.equal(tensor_bits(got["a"]), tensor_bits(a))


def test_a_copy_of_a_cast_refers_to_the_cast() -> None:
    master = _master()
    state = {"master": master, "w": master.bfloat16(), "w2": master.bfloat16()}
    blob = save_bytes(state)
    entries = _entries(blob)
    assert entries["w"].source == {"cast": 0} and entries["w2"].source == {"copy": 1}
    assert_same(load_bytes(blob), state)


def test_tensors_differing_in_one_unsampled_byte_are_both_stored() -> None:
    a = _master()
    b = a.clone()
    b.view(-1).view(torch.uint8)[4 * _unsampled(b.numel())] ^= 1
    blob = save_bytes({"a": a, "b": b})
    assert _entries(blob)["b"].source is None
    assert_same(load_bytes(blob), {"a": a, "b": b})


def test_empty_and_non_contiguous_tensors_are_left_alone() -> None:
    a = _master()
    state = {"e1": torch.empty(0), "e2": torch.empty(0), "t": a.t(), "t2": a.t()}
    blob = save_bytes(state)
    assert all(e.source is None for e in _entries(blob).values())
    assert_same(load_bytes(blob), state)


# ---------------------------------------------------------------------------- index validation


def _refs_blob() -> bytes:
    master = _master(shape=(64, 64))
    return save_bytes({"master": master, "w": master.bfloat16(), "dup": master.clone()})


def _set_source(position: int, source: Any):  # noqa: ANN202
    def edit(index: dict) -> None:
        index["tensors"][position]["source"] = source
    return edit


@pytest.mark.parametrize(
    ("edit", "error", "message"),
    [
        (_set_source(1, {"blend": 0}), UnsupportedFormatError, "source kind 'blend'"),
        (_set_source(1, {"cast": 1}), CorruptCheckpointError, "is a cast of itself"),
        (_set_source(1, {"cast": 9}), CorruptCheckpointError, "table entry 9, which does not exist"),
        (_set_source(1, {"cast": 2}), CorruptCheckpointError, "which is a copy"),
        (_set_source(2, {"copy": 1}), CorruptCheckpointError, "whose size or checksum differs"),
        (_set_source(1, {"cast": "0"}), CorruptCheckpointError, "expected a table position"),
        (_set_source(1, {"cast": 0, "copy": 0}), CorruptCheckpointError, "expected an object of one kind"),
        (_set_source(0, {"xor": {"base": 0, "tensor": "w", "checksum": "wsum64:" + "0" * 16}}),
         CorruptCheckpointError, "delta against base 0, but the file lists 0 bases"),
    ],
)
def test_malformed_sources_are_refused(edit: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        load_bytes(rewrite_index(_refs_blob(), edit))


def test_a_cast_to_a_dtype_that_is_not_half_precision_is_refused() -> None:
    def edit(index: dict) -> None:
        index["tensors"][1]["dtype"] = "int16"

    with pytest.raises(CorruptCheckpointError, match=r"\(int16\) is a cast of 'master' \(float32\)"):
        load_bytes(rewrite_index(_refs_blob(), edit))


def test_a_source_in_a_2_0_file_is_an_unknown_key() -> None:
    blob = with_preamble(rewrite_index(_refs_blob(), lambda i: i.__setitem__("version", [2, 0])), minor=0)
    with pytest.raises(CorruptCheckpointError, match=r"unknown keys \['source'\]"):
        load_bytes(blob)


def test_a_later_minor_with_an_unknown_tensor_key_is_refused_as_unsupported() -> None:
    def edit(index: dict) -> None:
        index["version"] = [2, 9]
        index["tensors"][0]["hologram"] = True

    with pytest.raises(UnsupportedFormatError, match=r"keys \['hologram'\] of a later format version"):
        load_bytes(with_preamble(rewrite_index(_refs_blob(), edit), minor=9))


def test_malformed_bases_are_refused() -> None:
    def edit(index: dict) -> None:
        index["bases"] = [{"step": -1, "name": "x.ckz", "content_hash": "0" * 16}]

    with pytest.raises(CorruptCheckpointError, match="base 0 has step -1"):
        load_bytes(rewrite_index(_refs_blob(), edit))


def test_a_delta_file_on_its_own_names_its_base() -> None:
    from ckptzip.api import write_checkpoint
    from ckptzip.engine.policy import Policy
    from ckptzip.engine.sources import DeltaBase
    from ckptzip.format import BaseRef

    w = _master(shape=(512, 512))
    later = w + 1e-5 * _master(seed=5, shape=(512, 512))
    ref = BaseRef(100, "step_00000100.ckz", "0123456789abcdef")
    buf = io.BytesIO()
    entries = write_checkpoint(buf, {"w": later}, Policy.parse("auto"), base=DeltaBase(ref, {"w": w}))
    assert entries[0].source_kind == "xor"
    with pytest.raises(MissingBaseError, match=r"XOR delta against the base checkpoint step 100, "
                                               r"'step_00000100.ckz', content hash 0123456789abcdef"):
        ckptzip.load(buf.getvalue())
    with ckptzip.open(buf.getvalue()) as reader:
        assert torch.equal(tensor_bits(reader.load(base_tensors=[{"w": w}])["w"]), tensor_bits(later))
        # the wrong base: the rebuilt tensor fails its checksum
        with pytest.raises(CorruptCheckpointError, match=r"tensor 'w' \(xor of another tensor\)"):
            reader.load(base_tensors=[{"w": later}])


@pytest.mark.gpu
def test_casts_and_duplicates_are_found_on_the_gpu() -> None:
    master = _master().cuda()
    state = {"master": master, "w": master.bfloat16(), "dup": master.clone()}
    blob = save_bytes(state)
    entries = _entries(blob)
    assert entries["w"].source == {"cast": 0} and entries["dup"].source == {"copy": 0}
    assert_same(load_bytes(blob), state)
    assert_same(load_bytes(blob, map_location="cpu"), {k: v.cpu() for k, v in state.items()})


def test_many_equal_sized_mostly_zero_tensors_are_told_apart_by_digest_not_pairwise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptzip.engine.derive import find_duplicates

    tensors = []
    for i in range(200):  # samples all zero; each differs in one element, except the last two pairs
        t = torch.zeros(1 << 14)
        t[1 + (i % 198)] = 1.0 + (i % 198)
        tensors.append(t)
    compares = []
    real_equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: compares.append(1) or real_equal(a, b))
    assert find_duplicates(tensors) == {198: 0, 199: 1}
    assert len(compares) <= 4  # one byte compare per digest match, not one per pair (19,900)


def _count_compares(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    compares: list[int] = []
    real_equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: compares.append(1) or real_equal(a, b))
    return compares


def test_casts_whose_sources_share_their_samples_are_matched_by_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptzip.engine.derive import find_casts

    n = 300
    sources = []
    for i in range(n):  # one shape, every sample equal: each differs in one unsampled element
        t = torch.zeros(1 << 12)
        t[1 + i] = 1.0 + i
        sources.append(t)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    targets = [sources[k].to(torch.bfloat16 if k % 2 else torch.float16) for k in order]
    compares = _count_compares(monkeypatch)
    assert find_casts(sources + targets, skip=set()) == {n + m: k for m, k in enumerate(order)}
    assert len(compares) == n  # one whole compare per target, not one per pair (90,000)


def test_duplicate_and_cast_search_is_linear_in_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's example: 20k equal-size small tensors took 32 s to save (pair groups gathered
    per pair); now every tensor is hashed once and compared at most once."""
    from ckptzip.engine.derive import find_casts, find_duplicates

    n = 20_000
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(16, generator=g) for _ in range(n)]
    tensors += [tensors[i].clone() for i in range(0, n, 7)] + [tensors[i].bfloat16() for i in range(3, n, 11)]
    compares = _count_compares(monkeypatch)
    duplicates = find_duplicates(tensors)
    casts = find_casts(tensors, skip=set(duplicates))
    assert duplicates == {n + k: i for k, i in enumerate(range(0, n, 7))}
    assert casts == {n + len(duplicates) + k: i for k, i in enumerate(range(3, n, 11))}
    assert len(compares) == len(duplicates) + len(casts)


@pytest.mark.parametrize("n", [1, 2, SAMPLES - 1, SAMPLES, (1 << 24) + 3, (1 << 31) + 5])
def test_sample_positions_are_in_range_spread_and_include_both_ends(n: int) -> None:
    from ckptzip.engine.derive import _sample_at

    at = _sample_at(n, torch.device("cpu"))
    assert at.dtype == torch.int64 and at.numel() == min(n, SAMPLES)
    assert int(at[0]) == 0 and int(at[-1]) == n - 1
    assert bool((at[1:] > at[:-1]).all())  # distinct and increasing: never past the end


def _mixed_state(device: str = "cpu", drift: float = 0.0) -> dict[str, Any]:
    master = (_master(shape=(512, 512)) + drift).to(device)
    return {"master": master, "w": master.bfloat16(), "dup": master.clone(), "other": _master(seed=2).to(device)}


@pytest.mark.parametrize("delta", [False, True])
def test_a_staged_save_rewrites_its_table_as_a_save_does(delta: bool) -> None:
    """The host snapshot's path (staged_table, stage_table, then write_staged) stores casts, duplicates and XOR
    deltas exactly as ckptzip.save does: the same table and the same bytes."""
    from ckptzip.api import write_checkpoint
    from ckptzip.engine.policy import Policy
    from ckptzip.engine.sources import DeltaBase
    from ckptzip.memory.pinned import PinnedPool
    from ckptzip.engine.plan import GpuLimits
    from ckptzip.engine.staged import stage_table, staged_table, write_staged
    from ckptzip.format import BaseRef
    from ckptzip.tree import flatten

    state = _mixed_state(drift=1e-5 if delta else 0.0)
    base = None
    if delta:
        earlier = _mixed_state()
        base = DeltaBase(BaseRef(1, "step_00000001.ckz", "0123456789abcdef"), {"master": earlier["master"]})
    policy = Policy.parse("auto")
    direct = io.BytesIO()
    write_checkpoint(direct, state, policy, base=base)
    flat = flatten(state)
    tensors = [i.tensor for i in flat.tensors]
    staged = stage_table(staged_table([i.name for i in flat.tensors], tensors, base), policy,
                         GpuLimits.of(tensors, policy, None, 1 << 20), PinnedPool())
    via_stage = io.BytesIO()
    write_staged(via_stage, staged, flat.tree, policy)
    assert via_stage.getvalue() == direct.getvalue()
    kinds = {name: e.source_kind for name, e in _entries(via_stage.getvalue()).items()}
    assert kinds == {"master": "xor" if delta else None, "w": "cast", "dup": "copy", "other": None}
    if not delta:
        assert_same(load_bytes(via_stage.getvalue()), state)


def test_a_staged_table_is_rewritten_from_the_sources_not_from_copies_still_in_flight() -> None:
    """A host snapshot's raw share is being copied while the table is rewritten: the search for
    duplicates and casts reads the sources (two copies not yet filled would look alike), and the
    tensors it keeps are then written from their copies; a duplicate of a copied tensor stays a
    reference."""
    from ckptzip.engine.policy import Policy
    from ckptzip.memory.pinned import PinnedPool
    from ckptzip.engine.plan import GpuLimits
    from ckptzip.engine.staged import stage_table, staged_table, write_staged
    from ckptzip.tree import flatten

    state = _mixed_state()
    flat = flatten(state)
    names, sources = [i.name for i in flat.tensors], [i.tensor for i in flat.tensors]
    in_flight = {names.index(name): torch.zeros_like(state[name]) for name in ("dup", "other")}
    policy = Policy.parse("auto")
    table = staged_table(names, sources, None, in_flight)  # the copies start after this, as a snapshot's do
    staged = stage_table(table, policy, GpuLimits.of(sources, policy, None, 1 << 20), PinnedPool())
    for position, copy in in_flight.items():  # the copies complete before the snapshot is written
        copy.copy_(sources[position])
    f = io.BytesIO()
    write_staged(f, staged, flat.tree, policy)
    kinds = {name: e.source_kind for name, e in _entries(f.getvalue()).items()}
    assert kinds == {"master": None, "w": "cast", "dup": "copy", "other": None}
    assert_same(load_bytes(f.getvalue()), state)


def test_the_delta_decision_is_made_per_tensor_in_one_batch() -> None:
    """Slowly moving tensors of several sizes and dtypes pay as deltas, fresh noise does not;
    tensors smaller than the sample and larger ones are decided in one call."""
    from ckptzip.engine.delta import SAMPLE_BYTES, deltas_that_pay
    from ckptzip.engine.encode import tensor_bytes

    def drifted(t: torch.Tensor) -> torch.Tensor:
        return (t.float() * (1 + 1e-4)).to(t.dtype)

    earlier = [_master(seed=s, shape=shape).to(dtype) for s, (shape, dtype) in enumerate(
        [((SAMPLE_BYTES,), torch.float32), ((37,), torch.float32), ((300, 257), torch.bfloat16), ((1000,), torch.float64)])]
    later = [drifted(t) for t in earlier]
    noise = [_master(seed=100 + s, shape=tuple(t.shape)).to(t.dtype) for s, t in enumerate(earlier)]
    currents = [tensor_bytes(t) for t in later + noise]
    bases = [tensor_bytes(t) for t in earlier + earlier]
    assert deltas_that_pay(currents, bases, [t.element_size() for t in earlier + earlier]) == [True] * 4 + [False] * 4
