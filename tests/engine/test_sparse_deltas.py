"""XOR deltas coded sparse (format 2.2, docs/FORMAT.md "sparse"): round trips on the engine's
save and load paths, the density rule, and damaged sparse streams."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import torch
from helpers import CkzParts, code_large_tensors_in_ranges, random_tensor, rewrite_index, sparse_residue, tensor_bits

import ckptzip
from ckptzip.api import write_checkpoint
from ckptzip.engine import delta, encode, policy, reader as engine_reader
from ckptzip.engine.policy import Policy
from ckptzip.engine.sources import DeltaBase
from ckptzip.errors import CorruptCheckpointError
from ckptzip.format import BaseRef
from ckptzip.transforms import sparse as sparse_transform

REF = BaseRef(7, "step_00000007.ckz", "0123456789abcdef")
SHAPE = (257, 129)  # an odd element count: the bitmap's last byte is part tail


def _pair(dtype: torch.dtype, density: float, shape: tuple[int, ...] = SHAPE, seed: int = 0
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """A base tensor and a later one that differs from it in about ``density`` of the elements."""
    base = random_tensor(dtype, shape, seed)
    residue = sparse_residue(dtype, shape, density, seed + 1)
    later = (base.view(torch.uint8) ^ residue.view(torch.uint8)).view(dtype)
    return base, later


def _save(state: dict[str, torch.Tensor], base: dict[str, torch.Tensor], codec: str = "auto") -> bytes:
    buf = io.BytesIO()
    write_checkpoint(buf, state, Policy.parse(codec), base=DeltaBase(REF, base))
    return buf.getvalue()


def _load(blob: bytes, base: dict[str, torch.Tensor], map_location: str | None = None) -> dict[str, torch.Tensor]:
    with ckptzip.open(blob, map_location=map_location) as reader:
        loaded: dict[str, torch.Tensor] = reader.load(base_tensors=[base])
        return loaded


def _entry(blob: bytes, name: str = "w") -> Any:
    with ckptzip.open(blob) as reader:
        return next(e for e in reader.entries() if e.name == name), reader._reader.index.version


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("density", [0.0, 1e-4, 0.03])
def test_sparse_deltas_round_trip_bit_exact(dtype: torch.dtype, density: float) -> None:
    base, later = _pair(dtype, density)
    blob = _save({"w": later}, {"w": base})
    entry, version = _entry(blob)
    assert version == (2, 2) and entry.source_kind == "xor"
    count = int((tensor_bits(later) != tensor_bits(base)).view(-1, dtype.itemsize).any(dim=1).sum())
    assert entry.transforms == [{"id": "sparse", "itemsize": dtype.itemsize, "count": count}]
    assert [s.nbytes for s in entry.streams] == [-(-later.numel() // 8)] + [count] * dtype.itemsize
    assert torch.equal(tensor_bits(_load(blob, {"w": base})["w"]), tensor_bits(later))


def test_above_the_density_bound_deltas_stay_byte_planes() -> None:
    base, later = _pair(torch.bfloat16, 0.3)
    blob = _save({"w": later}, {"w": base})
    entry, version = _entry(blob)
    assert version == (2, 1) and entry.source_kind == "xor" and entry.transforms[0]["id"] == "byteplanes"
    assert torch.equal(tensor_bits(_load(blob, {"w": base})["w"]), tensor_bits(later))


def test_small_residues_are_not_coded_sparse() -> None:
    base, later = _pair(torch.bfloat16, 0.01, shape=(1000,))
    entry, _ = _entry(_save({"w": later}, {"w": base}))
    assert not (entry.transforms and entry.transforms[0]["id"] == "sparse")


def test_a_residue_with_every_element_changed_codes_sparse_where_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(delta, "SPARSE_MAX_DENSITY", 1.0)
    base, later = _pair(torch.float32, 1.0)
    blob = _save({"w": later}, {"w": base})
    entry, _ = _entry(blob)
    assert entry.transforms == [{"id": "sparse", "itemsize": 4, "count": later.numel()}]
    assert torch.equal(tensor_bits(_load(blob, {"w": base})["w"]), tensor_bits(later))


def test_many_sparse_tensors_of_several_dtypes_in_one_batch() -> None:
    pairs = {f"t{i}": _pair(dtype, density, (97 + i, 131), seed=i)
             for i, (dtype, density) in enumerate([(torch.bfloat16, 0.01), (torch.float32, 0.0), (torch.float16, 0.05),
                                                   (torch.bfloat16, 0.5), (torch.float64, 0.02), (torch.int32, 0.1)])}
    blob = _save({k: v for k, (_, v) in pairs.items()}, {k: b for k, (b, _) in pairs.items()})
    loaded = _load(blob, {k: b for k, (b, _) in pairs.items()})
    for name, (_, later) in pairs.items():
        assert torch.equal(tensor_bits(loaded[name]), tensor_bits(later)), name
    assert _entry(blob, "t3")[0].transforms[0]["id"] == "byteplanes"


def test_a_sparse_tensor_larger_than_a_load_slice_decodes_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_reader, "CPU_SLICE_BYTES", 1 << 12)
    base, later = _pair(torch.bfloat16, 0.02, shape=(512, 300))
    blob = _save({"w": later}, {"w": base}, codec="zstd")
    entry, _ = _entry(blob)
    assert entry.transforms[0]["id"] == "sparse" and engine_reader.stored_ranges(entry, 1 << 12) is None
    assert torch.equal(tensor_bits(_load(blob, {"w": base})["w"]), tensor_bits(later))


def test_a_sparse_residue_coded_in_element_ranges_falls_back_to_byte_planes(monkeypatch: pytest.MonkeyPatch) -> None:
    # a GPU codes a tensor over its budget in element ranges (engine/parts.py); the same code runs here on the CPU
    code_large_tensors_in_ranges(monkeypatch)
    (big_base, big), (small_base, small) = _pair(torch.bfloat16, 0.02, (3 << 14,)), _pair(torch.bfloat16, 0.02, (201, 129))
    blob = _save({"big": big, "small": small}, {"big": big_base, "small": small_base})
    assert _entry(blob, "big")[0].transforms == [{"id": "byteplanes", "itemsize": 2}]
    assert _entry(blob, "small")[0].transforms[0]["id"] == "sparse"
    loaded = _load(blob, {"big": big_base, "small": small_base})
    assert torch.equal(tensor_bits(loaded["big"]), tensor_bits(big))
    assert torch.equal(tensor_bits(loaded["small"]), tensor_bits(small))


# ------------------------------------------------------------------------------- damaged streams


def _with_bitmap(edit: Any) -> tuple[bytes, dict[str, torch.Tensor]]:
    """A raw-coded sparse delta whose bitmap ``edit`` changed (chunk digests kept valid)."""
    base, later = _pair(torch.bfloat16, 0.02)
    parts = CkzParts.parse(_save({"w": later}, {"w": base}, codec="raw"))
    chunk = parts.chunk(0, 0, 0)
    assert parts.index["tensors"][0]["transforms"][0]["id"] == "sparse" and chunk[2] == -(-later.numel() // 8)
    start = chunk[0] - len(parts.preamble)
    bitmap = np.frombuffer(parts.data[start : start + chunk[1]], dtype=np.uint8).copy()
    edit(bitmap)
    parts.replace_chunk(0, 0, 0, bitmap.tobytes())
    return parts.build(), {"w": base}


def _first_clear_bit(bitmap: np.ndarray) -> int:
    return int(np.flatnonzero(np.unpackbits(bitmap, bitorder="little") == 0)[0])


def test_a_bitmap_that_marks_more_elements_than_the_count_is_refused_naming_the_tensor() -> None:
    def set_one(bitmap: np.ndarray) -> None:
        bit = _first_clear_bit(bitmap)
        bitmap[bit // 8] |= 1 << (bit % 8)

    blob, base = _with_bitmap(set_one)
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'w': sparse: the bitmap marks \d+ non-zero elements"):
        _load(blob, base)


def test_a_bitmap_with_moved_bits_fails_the_residue_checksum() -> None:
    def move_one(bitmap: np.ndarray) -> None:
        bits = np.unpackbits(bitmap, bitorder="little")
        clear, set_ = _first_clear_bit(bitmap), int(np.flatnonzero(bits)[0])
        bits[clear], bits[set_] = 1, 0
        bitmap[:] = np.packbits(bits, bitorder="little")

    blob, base = _with_bitmap(move_one)
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'w': decoded bytes have checksum"):
        _load(blob, base)


def test_a_bitmap_with_tail_bits_set_is_refused() -> None:
    def set_tail(bitmap: np.ndarray) -> None:
        bitmap[-1] |= 0x80  # 33153 elements: the last byte holds one

    blob, base = _with_bitmap(set_tail)
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'w': sparse: the bitmap has bits set past"):
        _load(blob, base)


def test_a_count_that_does_not_match_the_streams_is_refused_naming_the_tensor() -> None:
    base, later = _pair(torch.bfloat16, 0.02)
    blob = _save({"w": later}, {"w": base})

    def edit(index: dict) -> None:
        index["tensors"][0]["transforms"][0]["count"] += 1

    with pytest.raises(CorruptCheckpointError, match=r"tensor 'w' stream 1 has nbytes \d+, expected"):
        _load(rewrite_index(blob, edit), {"w": base})

    def too_many(index: dict) -> None:
        index["tensors"][0]["transforms"][0]["count"] = later.numel() + 1

    with pytest.raises(CorruptCheckpointError, match=rf"sparse: count {later.numel() + 1} exceeds"):
        _load(rewrite_index(blob, too_many), {"w": base})


# ------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_sparse_deltas_on_the_gpu_round_trip_and_match_the_cpu_streams(dtype: torch.dtype) -> None:
    base, later = _pair(dtype, 0.02, shape=(1024, 513))
    blob = _save({"w": later.cuda()}, {"w": base.cuda()})
    entry, version = _entry(blob)
    assert version == (2, 2) and entry.transforms[0]["id"] == "sparse"
    assert entry.checksum == _entry(_save({"w": later}, {"w": base}))[0].checksum
    for device in ("cuda", "cpu"):
        back = _load(blob, {"w": base.to(device)}, map_location=device)["w"]
        assert back.device.type == device and torch.equal(tensor_bits(back.cpu()), tensor_bits(later))
    cpu_blob = _save({"w": later}, {"w": base})
    assert torch.equal(tensor_bits(_load(cpu_blob, {"w": base.cuda()}, map_location="cuda")["w"].cpu()),
                       tensor_bits(later))


@pytest.mark.gpu
@pytest.mark.parametrize("density", [2e-2, 1e-4], ids=["rl", "nearly-unchanged"])
def test_a_gpu_sparse_residue_codes_its_bitmap_with_lz_only_where_nearly_nothing_changed(density: float) -> None:
    base, later = _pair(torch.bfloat16, density, shape=(2048, 2048))
    blob = _save({"w": later.cuda()}, {"w": base.cuda()})
    entry, _ = _entry(blob)
    bitmap, *values = (s.codec for s in entry.streams)
    lz = density <= policy.SPARSE_LZ_MAX_DENSITY
    assert bitmap == {"id": "gdeflate", "algorithm_type": 1 if lz else 0}
    assert all(v in ({"id": "gdeflate", "algorithm_type": 0}, {"id": "raw"}) for v in values)  # as planes are
    back = _load(blob, {"w": base.cuda()})["w"]
    assert torch.equal(tensor_bits(back.cpu()), tensor_bits(later))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_delta_save_is_the_same_file_byte_for_byte_whether_residues_are_coded_together_or_alone(
        monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    pairs = {f"w{n}": _pair(dtype, density, shape, seed=n) for n, (dtype, density, shape) in enumerate(
        [(torch.bfloat16, 0.02, (64, 96)), (torch.float32, 0.05, SHAPE), (torch.bfloat16, 0.001, (128, 128)),
         (torch.float16, 0.1, (96, 40))])}
    base = {k: b.to(device) for k, (b, _) in pairs.items()}
    state = {k: later.to(device) for k, (_, later) in pairs.items()}
    monkeypatch.setattr(sparse_transform, "GROUPED_DEVICES", frozenset({"cpu", "cuda"}))
    together = _save(state, base)
    monkeypatch.setattr(encode, "forward_many", lambda transforms, datas: [t.forward(d) for t, d in zip(transforms, datas)])
    assert _save(state, base) == together
    assert all(_entry(together, k)[0].transforms[0]["id"] == "sparse" for k in state)  # the odd SHAPE alone
    loaded = _load(together, base)
    assert all(torch.equal(tensor_bits(loaded[k].cpu()), tensor_bits(v.cpu())) for k, v in state.items())
