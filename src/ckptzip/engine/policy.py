"""The ``codec=`` argument, parsed once at the API boundary into a :class:`Policy` value.

Presets:
- ``"auto"``: byte planes for 2-, 4- and 8-byte dtypes; planes that carry structure get the best
  codec of the backend that every machine can decode, near-random planes (float mantissa bytes)
  are stored raw, since coding them costs time and gains nothing. GPU: nvCOMP gdeflate in its
  Huffman-only mode (``algorithm_type`` 0): within a few percent of ans's ratio on sign/exponent
  planes and slower to code, but a CPU decodes it too (ckptzip's own decoder,
  :mod:`ckptzip.codecs.gdeflate_cpu`; results: "Codecs per byte plane"); CPU: zstd.
- ``"fast"``: as auto, with the backend's fastest codec (GPU: nvCOMP ans, which only a GPU decodes).
- ``"portable"``: as auto, with zstd everywhere, so the file decodes wherever ckptzip installs.
- ``"huff"``: as auto, with ckptzip's own coder, ``ckz-huff``, for every coded stream on both
  backends (no trials on the CPU, no nvCOMP on the GPU): Huffman-only gdeflate's ratio at ans's
  speed on a GPU, decoded by every CPU (:mod:`ckptzip.codecs.ckzhuff`); a batch codes the same
  bytes on either. Its codes spend a bit on every byte (8x at most), so planes near constant but
  not constant (XOR deltas) shrink less than auto's LZ pass shrinks them.
A codec id (``"zstd"``, ``"ans"``, ``"gdeflate"``, ...) applies that codec to every tensor's raw bytes.

Everything below the API receives a Policy; nothing re-parses the string.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..codecs import Codec, codec_ids, get_codec, gpu_only_ids, has_codec
from ..errors import CkptzipError, UsageError
from ..format.spec import MAX_CHUNK_RAW
from ..kernels import prepare_triton

PRESETS = ("auto", "fast", "portable", "huff")
SMALL_TENSOR_BYTES = 1 << 12
# On the CPU the planner codes a sample of each structured float plane with every candidate codec
# and keeps the smallest; a near-random plane is coded when a sample shrinks by this fraction.
TRIAL_MIN_GAIN = 0.002
TRIAL_BYTES = 1 << 16
STRUCTURED_TRIAL_BYTES = 1 << 15

_PRESET_CODECS: dict[tuple[str, str], dict[str, Any]] = {
    ("auto", "cuda"): {"id": "gdeflate", "algorithm_type": 0},
    ("fast", "cuda"): {"id": "ans", "data_type": "|u1"},
    ("portable", "cuda"): {"id": "zstd", "level": 3},
    ("huff", "cuda"): {"id": "ckz-huff"},
    ("huff", "cpu"): {"id": "ckz-huff"},
    # Whole streams and integer planes on the CPU; float planes: _CPU_FLOAT_CANDIDATES.
    ("auto", "cpu"): {"id": "zstd", "level": 1},
    ("fast", "cpu"): {"id": "zstd", "level": 1},
    ("portable", "cpu"): {"id": "zstd", "level": 1},
}
# Float planes this close to constant (XOR deltas of weights that barely moved, the zero low bytes
# of bf16-valued fp32 gradients), in bits/byte of their sampled bytes: a Huffman-only coder spends
# at least a bit on every byte (8x at best), so the GPU's auto preset codes them with gdeflate's LZ
# pass too (the same bitstream: a CPU decodes it alike).
LOW_ENTROPY_BITS = 1.0
_LOW_ENTROPY_CODECS: dict[tuple[str, str], dict[str, Any]] = {("auto", "cuda"): {"id": "gdeflate", "algorithm_type": 1}}
# A sparse residue's bitmap (engine.delta) is coded as those planes are only where at most this
# share of its elements changed; above it, like its values' planes, with the plane codec: denser
# bitmaps code no smaller with LZ and several times slower, and LZ on every sparse stream made an
# RL step's deltas both larger and slower (results: "Deltas, casts and duplicates").
SPARSE_LZ_MAX_DENSITY = 1e-3
# Float planes of presets on the CPU: each is coded with whichever of these shrinks a sample most
# (the first alone for "fast"; ties go to the first, the fastest; level 3 is tried only where
# level 1 beat the first, encode._trial). On exponent planes zstd without short matches comes
# nearest the entropy (a short match costs more than the Huffman literals it replaces;
# codecs/cpu.py), level 1 wins where values repeat (exp_avg, gradients) and level 3 on Adam's
# exp_avg_sq (results: "Codecs per byte plane").
_LITERALS = {"id": "zstd", "level": 1, "long_matches_only": True}
_CPU_FLOAT_CANDIDATES = (_LITERALS, {"id": "zstd", "level": 1}, {"id": "zstd", "level": 3})


@functools.lru_cache(maxsize=64)
def _codec(config: str, backend: str) -> Codec:
    """Codec objects are immutable values: one per configuration and backend per process."""
    return get_codec(json.loads(config), backend)


def codec_for(config: dict[str, Any], backend: str) -> Codec:
    """The (cached) implementation of a codec configuration on ``backend``."""
    return _codec(json.dumps(config, sort_keys=True), backend)


@dataclass(frozen=True)
class Policy:
    """How tensors are stored: a preset name or a codec id, and the stored chunk size of every
    stream (None: each codec's own, :attr:`Codec.chunk_bytes`, or where ``small_batches``, its
    :attr:`Codec.small_batch_chunk_bytes`), validated. ``small_batches`` is the engine's: set for
    the GPUs whose memory budget keeps their batches small."""

    name: str
    chunk_bytes: int | None = None
    small_batches: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or (self.name not in PRESETS and self.name not in codec_ids()):
            raise CkptzipError(
                f"codec={self.name!r} is neither a preset {list(PRESETS)} nor a codec id {sorted(codec_ids())}"
            )
        if self.chunk_bytes is not None and (type(self.chunk_bytes) is not int
                                             or not 1 <= self.chunk_bytes <= MAX_CHUNK_RAW):
            raise UsageError(f"chunk_bytes={self.chunk_bytes!r}: stored chunks hold 1 to {MAX_CHUNK_RAW} bytes")

    @classmethod
    def parse(cls, codec: str | Policy) -> Policy:
        """The policy for a ``codec=`` argument; ``CkptzipError`` naming the choices otherwise."""
        return codec if isinstance(codec, Policy) else cls(codec)

    @property
    def is_preset(self) -> bool:
        return self.name in PRESETS

    def backend(self, device: torch.device) -> str:
        """Where tensors on ``device`` are encoded: their GPU when nvCOMP runs this policy's codec
        there, else the CPU; a GPU-only codec id always runs on a GPU (or fails saying why). A GPU
        answer starts loading the GPU kernels in the background."""
        if self.name in gpu_only_ids():
            codec_for({"id": self.name}, "cuda")  # CodecUnavailableError naming the fix when no GPU runs it
        elif device.type != "cuda":
            return "cpu"
        elif not has_codec(self.name if not self.is_preset else _PRESET_CODECS[(self.name, "cuda")]["id"], "cuda"):
            return "cpu"
        prepare_triton(device)
        return "cuda"

    def splits(self, itemsize: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Which tensors (by item size and byte size) are split into byte planes."""
        if not self.is_preset:
            return np.zeros(len(nbytes), dtype=bool)
        return (nbytes >= SMALL_TENSOR_BYTES) & np.isin(itemsize, (2, 4, 8))

    def plane_codec(self, backend: str) -> Codec:
        """The codec of structured planes (presets) or of every stream (a codec id)."""
        if not self.is_preset:
            return codec_for({"id": self.name}, backend)
        return codec_for(_PRESET_CODECS[(self.name, backend)], backend)

    def plane_candidates(self, backend: str) -> list[dict[str, Any]]:
        """Configurations a float plane is tried with: on the CPU, several for presets, where a
        trial on a sample picks one (the first alone for "fast"); else (and for "huff") the plane
        codec alone."""
        if not self.is_preset or backend != "cpu" or self.name == "huff":
            return [self.plane_codec(backend).get_config()]
        return list(_CPU_FLOAT_CANDIDATES[:1] if self.name == "fast" else _CPU_FLOAT_CANDIDATES)

    def samples_planes(self, backend: str) -> bool:
        """Whether coding on ``backend`` tries codecs on samples of planes (the CPU's presets, but
        "huff", whose file is the GPU's byte for byte)."""
        return backend == "cpu" and self.is_preset and self.name != "huff"

    def low_entropy_candidate(self, backend: str) -> dict[str, Any] | None:
        """The configuration of float planes below :data:`LOW_ENTROPY_BITS`, where it differs
        from the plane codec's (None: the plane codec's)."""
        return _LOW_ENTROPY_CODECS.get((self.name, backend)) if self.is_preset else None

    def whole_codec(self, backend: str, nbytes: int) -> Codec:
        """The codec of a tensor stored as one stream (not split into planes)."""
        if self.is_preset and nbytes < SMALL_TENSOR_BYTES and (backend == "cuda" or self.name == "huff"):
            return codec_for({"id": "raw"}, backend)  # tiny tensors: not worth a GPU codec (huff: on either)
        return self.plane_codec(backend)

    def gpu_scratch_bytes(self) -> int:
        """GPU scratch the codecs a save runs on a GPU need beside its batches, however small
        (:meth:`~ckptzip.codecs.base.Codec.scratch_bytes`: about a GiB for nvCOMP's zstd, none for ans)."""
        configs = [self.plane_codec("cuda").get_config(), self.low_entropy_candidate("cuda")]
        codecs = [codec_for(config, "cuda") for config in configs if config is not None]
        return max(codec.scratch_bytes(self.chunk_bytes_for(codec)) for codec in codecs)

    def chunk_bytes_for(self, codec: Codec) -> int:
        """Stored chunk size of streams coded with ``codec``: this policy's, else the codec's own (for
        small batches where it has one), at most the largest it encodes; a multiple of 256 on a GPU,
        where nvCOMP reads and writes chunks at aligned addresses."""
        own = (self.small_batches and codec.small_batch_chunk_bytes) or codec.chunk_bytes
        size = min(self.chunk_bytes or own, codec.max_chunk_bytes)
        return -(-size // 256) * 256 if codec.backend == "cuda" else size

    def chunk_sizes(self, configs: list[dict[str, Any]], backend: str) -> np.ndarray:
        """:meth:`chunk_bytes_for` the codec of each configuration on ``backend``, one looked up per
        codec id (the sizes are facts of the codec's class, whatever its options)."""
        one = {config["id"]: config for config in configs}
        sizes = {codec_id: self.chunk_bytes_for(codec_for(config, backend)) for codec_id, config in one.items()}
        return np.array([sizes[config["id"]] for config in configs], dtype=np.int64)

    def __str__(self) -> str:
        return self.name


RAW = {"id": "raw"}
