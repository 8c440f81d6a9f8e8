"""Shared test helpers: value builders, bit-exact comparison, and a .ckz rewriter.

The rewriter follows docs/FORMAT.md on its own (struct layouts, hashes) rather than importing the
writer, so a test that edits a file checks the reader against the spec, not against itself.
"""

from __future__ import annotations

import collections
import importlib.machinery
import io
import json
import math
import struct
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

import ckptzip
from ckptzip.engine.policy import Policy

PREAMBLE = struct.Struct("<8sHHI")  # magic, major, minor, flags
TRAILER = struct.Struct("<QQQ8s")  # index_offset, index_length, index_hash, end magic
MAGIC = b"\x89CKZ\r\n\x1a\n"
END_MAGIC = b"CKZINDEX"

CPU_CODECS = ("raw", "zstd", "deflate", "lz4")
PRESETS = ("auto", "fast", "portable")

# Every dtype the format names that this torch has (uint16/32/64 and the fnuz float8s are recent).
DTYPE_NAMES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint64",
    "uint32",
    "uint16",
    "uint8",
    "bool",
    "complex128",
    "complex64",
)
DTYPES: list[torch.dtype] = [
    d for d in (getattr(torch, name, None) for name in DTYPE_NAMES) if isinstance(d, torch.dtype)
]


# --- building values -------------------------------------------------------------------------


def tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` whose memory is exactly ``data`` (any bit pattern)."""
    if dtype == torch.bool:  # only 0 and 1 are valid bools
        data = bytes(b & 1 for b in data)
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Arbitrary bits (NaN payloads, subnormals, -0.0 included) of the given dtype and shape."""
    nbytes = math.prod(shape) * dtype.itemsize
    return tensor_from_bytes(np.random.default_rng(seed).bytes(nbytes), dtype, shape)


def float_from_bits(bits: int) -> float:
    """The Python float with these IEEE-754 binary64 bits."""
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


def float_bits(value: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", value))[0]


def small_model(seed: int = 0) -> torch.nn.Module:
    """A model with the parameter and buffer kinds real state dicts have (incl. int64 buffers)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.BatchNorm1d(32),
        torch.nn.GELU(),
        torch.nn.Linear(32, 8),
        torch.nn.LayerNorm(8),
    )


def train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 16, generator=gen)
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


def adamw_state(steps: int = 3) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    """A small model and an AdamW optimizer after ``steps`` training steps."""
    model = small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, amsgrad=True)
    train_steps(model, optimizer, steps)
    return model, optimizer


def state_copy(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of ``module.state_dict()`` as a plain dict, unaffected by later training."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def mixed_state() -> dict[str, Any]:
    """A small checkpoint-like object touching every kind of value and several codec paths."""
    model, optimizer = adamw_state(1)
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "zeros": torch.zeros(3000),  # compressible: zstd, byte planes under the presets
        "ids": torch.arange(2000, dtype=torch.int64),
        "bits": random_tensor(torch.bfloat16, (7, 5), seed=3),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "step": 123,
        "lr": 3e-4,
        "nan": float("nan"),
        "name": "run-α",  # noqa: RUF001 - a non-ASCII string on purpose
        "blob": b"\x00\xff",
        "shape": (2, [3, None]),
    }


# --- comparing values ------------------------------------------------------------------------


def tensor_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in C order as a flat uint8 tensor on the CPU."""
    t = t.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def assert_same_tensor(got: torch.Tensor, want: torch.Tensor, where: str = "<root>", *, device: bool = False) -> None:
    """Same type, dtype, shape and bits (NaN payloads and -0.0 included); with ``device``, same device."""
    assert type(got) is torch.Tensor, f"{where}: got {type(got).__name__}, expected a plain torch.Tensor"
    assert got.dtype == want.dtype, f"{where}: dtype {got.dtype}, expected {want.dtype}"
    assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if device:
        assert got.device == want.device, f"{where}: device {got.device}, expected {want.device}"
    assert torch.equal(tensor_bits(got), tensor_bits(want)), f"{where}: tensor bits differ"


def assert_same(
    got: Any, want: Any, where: str = "<root>", *, key_order: bool = True, dict_type: bool = True, device: bool = False
) -> None:
    """Structural equality with exact types: dict order, tuple vs list, float bits, tensor bits.

    Options, for loaders that legitimately rebuild containers: ``key_order=False`` compares dict
    keys as sets (each key still of the same type); ``dict_type=False`` lets any dict class stand
    for another (an ``OrderedDict``'s ``_metadata`` is then not compared). ``device=True`` also
    requires tensors on the same device.
    """
    options = {"key_order": key_order, "dict_type": dict_type, "device": device}
    if isinstance(want, torch.Tensor):
        assert_same_tensor(got, want, where, device=device)
        return
    if isinstance(want, dict):
        _assert_same_dict(got, want, where, **options)
        return
    assert type(got) is type(want), f"{where}: got {type(got).__name__}, expected {type(want).__name__}"
    if isinstance(want, float):
        assert float_bits(got) == float_bits(want), f"{where}: {got!r} is not bit-identical to {want!r}"
    elif isinstance(want, np.ndarray):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        assert got.tobytes() == want.tobytes(), f"{where}: array bytes differ"
    elif isinstance(want, np.generic):
        assert (got.dtype, got.tobytes()) == (want.dtype, want.tobytes()), f"{where}: {got!r} != {want!r}"
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)}, expected {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}.{i}", **options)
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _assert_same_dict(got: Any, want: dict, where: str, *, key_order: bool, dict_type: bool, device: bool) -> None:
    if dict_type:
        assert type(got) is type(want), f"{where}: got {type(got).__name__}, expected {type(want).__name__}"
    else:
        assert isinstance(got, dict), f"{where}: got {type(got).__name__}, expected a dict"
    assert len(got) == len(want), f"{where}: {len(got)} keys, expected {len(want)}"
    if key_order:
        pairs = list(zip(got, want))
    else:
        got_keys = {k: k for k in got}  # looks up the stored key object, to compare its type
        missing = [wk for wk in want if wk not in got_keys]
        assert not missing, f"{where}: keys {missing!r} missing"
        pairs = [(got_keys[wk], wk) for wk in want]
    options = {"key_order": key_order, "dict_type": dict_type, "device": device}
    for gk, wk in pairs:
        assert_same(gk, wk, f"{where}[key]", **options)
        assert_same(got[gk], want[wk], f"{where}.{wk}", **options)
    if dict_type and isinstance(want, collections.OrderedDict):
        metadata = getattr(got, "_metadata", None), getattr(want, "_metadata", None)
        assert_same(*metadata, f"{where}._metadata", **options)


# --- saving and loading ----------------------------------------------------------------------


SMALL_CHUNK_BYTES = 1000


def small_chunks(codec: str = "auto") -> Policy:
    """``codec`` with stored chunks of SMALL_CHUNK_BYTES, so small tensors span many chunks."""
    return Policy(codec, chunk_bytes=SMALL_CHUNK_BYTES)


def save_bytes(obj: Any, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    ckptzip.save(obj, buf, **kwargs)
    return buf.getvalue()


def load_bytes(data: bytes, **kwargs: Any) -> Any:
    return ckptzip.load(io.BytesIO(data), **kwargs)


def roundtrip(obj: Any, **kwargs: Any) -> Any:
    return load_bytes(save_bytes(obj, **kwargs))


# --- taking files apart and putting them back together (docs/FORMAT.md) ---------------------


def wsum64_reference(data: bytes) -> int:
    """FORMAT.md: sum mod 2**64 of w_i * (2i + 1) over little-endian u64 words, tail zero-padded."""
    padded = data + b"\0" * (-len(data) % 8)
    words = np.frombuffer(padded, dtype="<u8")
    weights = np.arange(words.size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    return int((words * weights).sum(dtype=np.uint64))


@dataclass
class CkzParts:
    """A .ckz file split into its sections; ``index`` is the parsed JSON."""

    preamble: bytes
    data: bytes
    index: Any

    @classmethod
    def parse(cls, blob: bytes) -> CkzParts:
        offset, length, _, end = TRAILER.unpack(blob[-TRAILER.size :])
        assert end == END_MAGIC and offset + length + TRAILER.size == len(blob)
        return cls(blob[: PREAMBLE.size], blob[PREAMBLE.size : offset], json.loads(blob[offset : offset + length]))

    def build(self, raw_index: bytes | None = None) -> bytes:
        """The file, with a trailer whose offsets and hash match (so only the targeted check fires)."""
        if raw_index is None:
            raw_index = json.dumps(self.index, separators=(",", ":")).encode()
        offset = len(self.preamble) + len(self.data)
        digest = xxhash.xxh3_64_intdigest(self.preamble + raw_index)
        return self.preamble + self.data + raw_index + TRAILER.pack(offset, len(raw_index), digest, END_MAGIC)

    def chunk(self, tensor: int, stream: int = 0, chunk: int = 0) -> list:
        return self.index["tensors"][tensor]["streams"][stream]["chunks"][chunk]

    def chunks(self) -> list[list]:
        """Every chunk entry in tiling order."""
        return [c for t in self.index["tensors"] for s in t["streams"] for c in s["chunks"]]

    @property
    def major(self) -> int:
        return PREAMBLE.unpack(self.preamble)[1]

    def digest(self, stored: bytes) -> str:
        """The chunk digest of the file's format: XXH3-64 (format 1) or wsum64 (format 2)."""
        if self.major == 1:
            return xxhash.xxh3_64_hexdigest(stored)
        return f"{wsum64_reference(stored):016x}"

    def replace_chunk(self, tensor: int, stream: int, chunk: int, stored: bytes) -> None:
        """Put other stored bytes in one chunk, fixing its length, its digest and the later offsets."""
        entry = self.chunk(tensor, stream, chunk)
        start = entry[0] - PREAMBLE.size
        self.data = self.data[:start] + stored + self.data[start + entry[1] :]
        shift = len(stored) - entry[1]
        entry[1], entry[3] = len(stored), self.digest(stored)
        for other in self.chunks():
            if other[0] > entry[0]:
                other[0] += shift


def rewrite_index(blob: bytes, edit: Callable[[Any], object]) -> bytes:
    """Let ``edit`` change the parsed index of a valid file in place, and rebuild the file with a
    consistent trailer (so only the check the edit targets can fire)."""
    parts = CkzParts.parse(blob)
    edit(parts.index)
    return parts.build()


def rewrite_raw_index(blob: bytes, raw_index: bytes) -> bytes:
    """Replace the index bytes verbatim (for JSON the json module will not write) and fix the trailer."""
    return CkzParts.parse(blob).build(raw_index)


def with_preamble(blob: bytes, major: int = 2, minor: int = 0, flags: int = 0, magic: bytes = MAGIC) -> bytes:
    """The file with another preamble; the index hash is recomputed so the preamble check fires."""
    parts = CkzParts.parse(blob)
    parts.preamble = PREAMBLE.pack(magic, major, minor, flags)
    return parts.build()


def sparse_residue(dtype: torch.dtype, shape: tuple[int, ...], density: float, seed: int = 0) -> torch.Tensor:
    """An XOR residue: arbitrary non-zero bits in about ``density`` of the elements, zero elsewhere."""
    bits = random_tensor(dtype, shape, seed)
    keep = torch.rand(math.prod(shape), generator=torch.Generator().manual_seed(seed)) < density
    out = torch.zeros(shape, dtype=dtype)
    rows = out.view(-1).view(torch.uint8).view(-1, dtype.itemsize)
    rows[keep] = bits.view(-1).view(torch.uint8).view(-1, dtype.itemsize)[keep]
    rows[keep, 0] |= 1  # every kept element non-zero
    return out


def code_large_tensors_in_ranges(monkeypatch: Any) -> None:
    """Make saves code tensors of 64 KiB or more in element ranges of 16 KiB on the CPU, as a GPU
    codes a tensor over its budget (engine/parts.py): the same code, run here."""
    from ckptzip.engine import parts as engine_parts
    from ckptzip.engine import plan as engine_plan

    real_key = engine_plan._key

    def in_ranges(tensor: torch.Tensor, backend: str, limits: object) -> object:
        if tensor.numel() * tensor.element_size() >= 1 << 16:
            return engine_plan.BatchKey("cpu", torch.device("cpu"), True)
        return real_key(tensor, backend, limits)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_plan, "_key", in_ranges)
    monkeypatch.setattr(engine_parts, "RANGE_ALIGN", 1 << 14)
    cpu = torch.device("cpu")
    monkeypatch.setattr(engine_plan.GpuLimits, "of", classmethod(
        lambda cls, *a, **k: cls({cpu: 1 << 14}, {cpu: 0}, {cpu: 96 << 14})))


STAND_IN_TRITON_KEY = "9.9.0-" + "ab" * 8


def stand_in_triton(root: Path, monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """A Triton install of two files under ``root`` in place of the real one (``sys.modules``),
    whose ``triton_key`` returns :data:`STAND_IN_TRITON_KEY` and counts its calls."""
    (root / "_C").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "_C" / "libtriton.so").write_bytes(b"\0" * 64)
    calls: list[int] = []

    def triton_key() -> str:
        calls.append(1)
        return STAND_IN_TRITON_KEY

    package = types.ModuleType("triton")
    package.__spec__ = importlib.machinery.ModuleSpec("triton", None)  # what find_spec answers
    package.__file__ = str(root / "__init__.py")
    package.__version__ = "9.9.0"  # type: ignore[attr-defined]
    runtime = types.ModuleType("triton.runtime")
    cache = types.ModuleType("triton.runtime.cache")
    cache.triton_key = triton_key  # type: ignore[attr-defined]
    runtime.cache = cache  # type: ignore[attr-defined]
    package.runtime = runtime  # type: ignore[attr-defined]
    for name, module in (("triton", package), ("triton.runtime", runtime), ("triton.runtime.cache", cache)):
        monkeypatch.setitem(sys.modules, name, module)
    return types.SimpleNamespace(root=root, calls=calls, cache=cache, compute=triton_key)


def shared_rss() -> int:
    """Bytes of shared memory this process has mapped in (Linux's ``RssShmem``)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssShmem:"))
