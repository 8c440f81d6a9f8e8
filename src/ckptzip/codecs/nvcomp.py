"""GPU codecs on NVIDIA nvCOMP 6 (``libnvcomp``, from the ``nvidia-libnvcomp-cu12/cu13`` wheels).

Every codec stores nvCOMP's raw batched bitstream: each chunk is one bare stream of its format,
with no nvCOMP header. So ``zstd`` chunks are standard zstd frames, ``deflate`` chunks raw RFC 1951
streams and ``lz4`` chunks LZ4 *blocks*, interchangeable with the CPU codecs; ``ans``, ``bitcomp``,
``gdeflate`` and ``cascaded`` are NVIDIA formats that only nvCOMP decodes. Options a decoder needs
(such as ``data_type``) live in the codec config, which the container stores.

Contract, beyond :class:`~ckptzip.codecs.base.Codec`:

- One call codes a whole batch with one nvCOMP launch on the current torch CUDA stream, through
  nvCOMP's C API (:mod:`._nvcomp_lib`): the chunks' addresses and sizes go to the device in one
  copy, and nothing is done per chunk in Python. Encoding waits for the compressed sizes (queued,
  ``queue_segments``: only when its result is asked for, and only for the copy of the sizes);
  decoding waits for the decoded sizes and statuses, so it names a bad chunk. Nothing else
  synchronises.
- nvCOMP's scratch and outputs come from torch's caching allocator, on the current stream: from
  the memory torch can hand out (:mod:`ckptzip.memory.gpu`), never a private ``cudaMalloc``.
- Chunks must be non-empty (``ValueError`` otherwise) and at most ``max_chunk_bytes``; with a
  multi-byte ``data_type`` their sizes must be whole elements.
- The returned chunks are views into one buffer allocated per call, which stays alive while any
  of them does; copy them (e.g. to the host) to release it.
- nvCOMP's zstd, deflate, gdeflate, bitcomp and cascaded decoders are only defined on valid input
  (nvCOMP known issue): verify stored bytes before decoding them.
- ``libnvcomp`` is loaded (and CUDA asked for) when a GPU codec is first asked for
  (:func:`~ckptzip.codecs.registry.declare`), never by importing ckptzip.
"""

from __future__ import annotations

import functools
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from ..errors import CodecUnavailableError, CorruptCheckpointError, CorruptChunkError
from ..memory import blocks
from ..memory.tables import to_device
from . import _nvcomp_lib
from .base import Codec, Segments
from .registry import declare, mark_unavailable, register

_INSTALL_HINT = "pip install ckptzip[gpu], or ckptzip[gpu-cu13] for CUDA 13"

_ITEMSIZE = {"|u1": 1, "<u2": 2, "<u4": 4, "<f2": 2, "<f4": 4}
_NVCOMP_TYPE = {"|u1": 1, "<u2": 3, "<u4": 5, "<f2": 10, "<f4": 11}  # nvcompType_t (UCHAR … FLOAT32)
_ANY_TYPE = 0xFF  # NVCOMP_TYPE_BITS: a decoder that reads the type from the stream
_MIN_CHUNK_CAPACITY = 1 << 16
_SLOT_ALIGN = 256  # output slots of encode_segments start at multiples of this
# nvCOMP's scratch for one launch grows with its chunks for some formats (zstd: gigabytes for a
# batch of thousands of chunks; gdeflate and ans ask none; results: "Codecs per byte plane"). A
# launch whose scratch would pass this, or a quarter of the room torch can have on the device, is
# cut into launches that fit, one after another on the stream through the same scratch.
_SCRATCH_STEP = 128 << 20


def _why_unavailable(cuda_available: bool, nvcomp_problem: str | None) -> str | None:
    """Why the GPU codecs cannot run here, or None when they can."""
    problems = [nvcomp_problem] if nvcomp_problem else []
    if not cuda_available:
        problems.append("no CUDA device is visible (torch.cuda.is_available() is False)")
    return " and ".join(problems) or None


def _load_library() -> tuple[_nvcomp_lib.Library | None, str | None]:
    """libnvcomp, or what is wrong with it (with the fix)."""
    lib, problem = _nvcomp_lib.load()
    return lib, None if problem is None else f"{problem}; {_INSTALL_HINT}"


_lib: _nvcomp_lib.Library | None = None
_LOADING = threading.Lock()
_loaded = False
_reason: str | None = None  # once loaded: why the GPU codecs cannot run here, or None


def _load() -> str | None:
    """Load nvCOMP, once, and register the GPU codecs or mark them unavailable; return why they
    cannot run here (None: they can)."""
    global _lib, _loaded, _reason
    with _LOADING:
        if not _loaded:
            cuda = torch.cuda.is_available()
            _lib, problem = _load_library()
            _reason = _why_unavailable(cuda, problem)
            for cls in CODECS:
                if _reason is None:
                    register(cls)
                else:
                    mark_unavailable(cls.codec_id, "cuda", _reason)
            _loaded = True
    return _reason


def __getattr__(name: str) -> Any:
    """``UNAVAILABLE_REASON``: why the GPU codecs cannot run here, or None (loads them)."""
    if name == "UNAVAILABLE_REASON":
        return _load()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _library(codec_id: str) -> _nvcomp_lib.Library:
    """The loaded library; ``CodecUnavailableError`` saying why the codec cannot run here."""
    reason = _load()
    if reason is not None or _lib is None:
        raise CodecUnavailableError(f"codec {codec_id!r} cannot run on the GPU here: {reason}.")
    return _lib


@functools.lru_cache(maxsize=64)
def _slot_bytes(lib: _nvcomp_lib.Library, fmt: _nvcomp_lib.Format, capacity: int) -> int:
    """Output room nvCOMP requires for every chunk of a batch coded with chunks of up to
    ``capacity`` bytes: the compressed-size bound of a full chunk, whatever the chunk's own size."""
    return lib.max_output_chunk_bytes(fmt, capacity)


def _slots(sizes: Sequence[int], alignment: int) -> tuple[list[int], int]:
    """Offsets that place ``sizes`` back to back at ``alignment``, and the total length."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // alignment) * alignment
    return offsets, end


def _views(buffer: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> list[torch.Tensor]:
    """``buffer[offsets[i] : offsets[i] + sizes[i]]`` for every i, in one split."""
    ends = [*offsets[1:], buffer.numel()]
    pieces = [n for off, end, size in zip(offsets, ends, sizes) for n in (size, end - off - size)]
    return list(buffer.split(pieces))[::2]


def _pack(chunks: Sequence[torch.Tensor], sizes: Sequence[int], alignment: int) -> tuple[torch.Tensor, list[int]]:
    """Copy chunks into one new buffer at aligned offsets (one concatenation)."""
    offsets, total = _slots(sizes, alignment)
    ends = [*offsets[1:], total]
    gaps = [end - off - size for off, end, size in zip(offsets, ends, sizes)]
    zeros = torch.zeros(sum(gaps), dtype=torch.uint8, device=chunks[0].device).split(gaps)
    return torch.cat([t for pair in zip(chunks, zeros) for t in pair]), offsets


def _addresses(chunks: Sequence[torch.Tensor], sizes: Sequence[int], alignment: int
               ) -> tuple[torch.Tensor | None, np.ndarray]:
    """Device addresses of the chunks: where they are when all are aligned, else in an aligned
    packed copy (returned, to be kept alive while nvCOMP reads it)."""
    ptrs = np.array([c.data_ptr() for c in chunks], dtype=np.uint64)
    if not (ptrs % alignment).any():
        return None, ptrs
    packed, offsets = _pack(chunks, sizes, alignment)
    return packed, _at(packed, np.array(offsets, dtype=np.int64))


def _describe(t: torch.Tensor) -> str:
    layout = "" if t.is_contiguous() else ", non-contiguous"
    return f"a {t.dim()}-D {t.dtype} tensor on {t.device}{layout}"


def _choice(codec_id: str, name: str, value: Any, allowed: Sequence[int] | Sequence[str]) -> Any:
    """``value`` if it is one of ``allowed`` (same type: no bools or floats for ints), else ``ValueError``."""
    if type(value) is not type(allowed[0]) or value not in allowed:
        raise ValueError(f"codec {codec_id!r} option {name} must be one of {list(allowed)}, got {value!r}")
    return value


def _read(results: torch.Tensor, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(sizes, statuses) of a launch's chunks (:meth:`_NvcompCodec._launch`): the one wait for the GPU."""
    return _split_results(results.cpu().numpy(), count)


def _read_later(results: torch.Tensor, count: int) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
    """:func:`_read`, the copy queued now on the current stream and waited for when called."""
    host = torch.empty(results.shape, dtype=results.dtype, pin_memory=True)
    host.copy_(results, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(results.device))

    def read() -> tuple[np.ndarray, np.ndarray]:
        copied.synchronize()
        return _split_results(host.numpy(), count)

    return read


def _split_results(host: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    return host[:count], host[count:].view(np.int32)[:count]


def _at(tensor: torch.Tensor, offsets: np.ndarray) -> np.ndarray:
    """Device addresses ``tensor.data_ptr() + offsets``."""
    addresses: np.ndarray = offsets.astype(np.uint64) + np.uint64(tensor.data_ptr())
    return addresses


class _NvcompCodec(Codec):
    """Batched nvCOMP codec on CUDA tensors; subclasses name the format, validate options and
    lay out nvCOMP's option structs (nvCOMP 6.0 headers)."""

    backend: ClassVar[str] = "cuda"
    algorithm: ClassVar[str]  # the format's name in nvCOMP's C functions
    # Each format declares its own (nvCOMP 6.0 headers): max_chunk_bytes, the largest chunk it
    # accepts (nvcomp<Format>CompressionMaxAllowedChunkSize); alignment, the larger of its
    # compression and decompression alignment for every input and output chunk
    # (nvcomp<Format>Required*Alignment).
    option_names: ClassVar[tuple[str, ...]] = ()
    sizes_in_stream: ClassVar[bool] = False  # raw chunks; zstd frames declare theirs
    # Options of the interchangeable CPU codec that only steer its encoder: accepted, then dropped.
    cpu_encoder_options: ClassVar[frozenset[str]] = frozenset()

    _options: dict[str, Any]

    def __init__(self) -> None:
        self._options = {}

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id, **self._options}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Codec:
        options = {k: v for k, v in config.items() if k != "id" and k not in cls.cpu_encoder_options}
        unknown = sorted(set(options) - set(cls.option_names))
        if unknown:
            raise ValueError(
                f"codec {cls.codec_id!r} on the GPU has no option(s) {unknown}; "
                f"it takes {list(cls.option_names) or 'no options'}"
            )
        return cls(**options)

    @property
    def _itemsize(self) -> int:
        return _ITEMSIZE[self._options.get("data_type", "|u1")]

    def _compress_opts(self) -> bytes:
        """nvCOMP's compression options for this configuration (its 64-byte struct)."""
        return bytes(64)

    def _decompress_opts(self) -> bytes:
        """nvCOMP's decompression options (the default backend; formats with more fields override)."""
        return struct.pack("<i60x", 0)

    @functools.cached_property
    def _format(self) -> _nvcomp_lib.Format:
        return _nvcomp_lib.Format(self.algorithm, self._compress_opts(), self._decompress_opts())

    def encode(self, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Compress each chunk; returns exact-size views into one new buffer."""
        chunks = list(chunks)
        if not chunks:
            return []
        lib = _library(self.codec_id)
        device = self._check_chunks(chunks)
        sizes = np.array([c.numel() for c in chunks], dtype=np.int64)
        self._check_sizes(sizes, ValueError, "has")
        with torch.cuda.device(device):
            _packed, ptrs = _addresses(chunks, sizes.tolist(), self.alignment)  # kept until the sizes are read
            out, offsets, compressed = self._compress(lib, device, ptrs, sizes)()
        return _views(out, offsets.tolist(), compressed.tolist())

    def decode(self, chunks: Sequence[torch.Tensor], raw_sizes: Sequence[int]) -> list[torch.Tensor]:
        """Decompress each chunk to exactly ``raw_sizes[i]`` bytes; views into one new buffer.

        Raises ``CorruptChunkError`` naming the chunk when nvCOMP rejects one or reports another
        decoded size.
        """
        chunks = list(chunks)
        raw = np.array([int(n) for n in raw_sizes], dtype=np.int64)
        if len(chunks) != raw.size:
            raise ValueError(f"codec {self.codec_id!r}: {len(chunks)} chunks but {raw.size} raw sizes")
        if not chunks:
            return []
        lib = _library(self.codec_id)
        device = self._check_chunks(chunks)
        self._check_sizes(raw, CorruptCheckpointError, "decodes to")
        lengths = np.array([c.numel() for c in chunks], dtype=np.int64)
        self._check_nonempty(lengths)
        offsets, total = _slots(raw.tolist(), self.alignment)
        with torch.cuda.device(device):
            _packed, ptrs = _addresses(chunks, lengths.tolist(), self.alignment)  # kept until decoded
            out = torch.empty(total, dtype=torch.uint8, device=device)
            self._decompress(lib, device, ptrs, lengths, _at(out, np.array(offsets, dtype=np.int64)), raw)
        return _views(out, offsets, raw.tolist())

    def encode_segments(self, base: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray
                        ) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """One nvCOMP launch over chunks of ``base`` read in place (they must start at the codec's
        alignment); the outputs lie in slots of the compressed-size bound, one sync for the sizes."""
        return self.queue_segments(base, offsets, lengths)()

    def queue_segments(self, base: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray) -> Segments:
        """:meth:`encode_segments` queued on the current stream: the sizes are copied to pinned
        memory behind the launch, and the host waits for that copy, not for what is queued after
        it, when the result is asked for."""
        if not len(lengths):
            empty = (base.new_empty(0), offsets, lengths)
            return lambda: empty
        lib = _library(self.codec_id)
        device = self._check_chunks([base])
        self._check_sizes(lengths, ValueError, "has")
        self._check_within(base, offsets, lengths, ValueError, "input")
        self._check_aligned(base, offsets)
        with torch.cuda.device(device):
            return self._compress(lib, device, _at(base, offsets), lengths)

    def decode_segments(self, src: torch.Tensor, src_offsets: np.ndarray, src_lengths: np.ndarray,
                        dst: torch.Tensor, dst_offsets: np.ndarray, raw_lengths: np.ndarray) -> None:
        """One nvCOMP launch from chunks of ``src`` into ``dst``, both read and written in place at
        the codec's alignment; chunk sizes checked against ``raw_lengths``."""
        if not len(raw_lengths):
            return
        lib = _library(self.codec_id)
        device = self._check_chunks([src, dst])
        self._check_sizes(raw_lengths, CorruptCheckpointError, "decodes to")
        self._check_nonempty(src_lengths)
        self._check_within(src, src_offsets, src_lengths, ValueError, "input")
        self._check_within(dst, dst_offsets, raw_lengths, ValueError, "output")
        self._check_aligned(src, src_offsets)
        self._check_aligned(dst, dst_offsets)
        with torch.cuda.device(device):
            self._decompress(lib, device, _at(src, src_offsets), src_lengths, _at(dst, dst_offsets), raw_lengths)

    def _compress(self, lib: _nvcomp_lib.Library, device: torch.device, ins: np.ndarray, sizes: np.ndarray
                  ) -> Segments:
        """One launch over chunks at the device addresses ``ins``, queued; called, the result is
        (output buffer, each chunk's offset in it, compressed sizes). Outputs lie in slots of the compressed-size bound,
        zeroed: whatever nvCOMP leaves unwritten within a chunk's reported size would otherwise
        carry stale device memory into the file, and files would differ with the process's
        allocation history (a memset, cheap beside the coding)."""
        capacity = self._capacity(int(sizes.max()))
        slot = -(-_slot_bytes(lib, self._format, capacity) // _SLOT_ALIGN) * _SLOT_ALIGN
        out_offsets = np.arange(sizes.size, dtype=np.int64) * slot
        out = blocks.zeros(slot * sizes.size, device)
        results = self._launch(lib, device, False, [ins, sizes, _at(out, out_offsets)], capacity, int(sizes.sum()))
        read = _read_later(results, sizes.size)

        def result() -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
            compressed, statuses = read()
            failed = np.flatnonzero(statuses)
            if failed.size:
                index = int(failed[0])
                raise _nvcomp_lib.LibraryError(
                    f"nvCOMP {self.codec_id} could not compress chunk {index} of {int(sizes[index])} bytes: "
                    f"{_nvcomp_lib.status_name(int(statuses[index]))}")
            return out, out_offsets, compressed.copy()

        return result

    def _decompress(self, lib: _nvcomp_lib.Library, device: torch.device, ins: np.ndarray, in_sizes: np.ndarray, outs: np.ndarray,
                    raw: np.ndarray) -> None:
        """One launch decoding the chunks at ``ins`` into room of exactly ``raw`` bytes each at
        ``outs``; a chunk nvCOMP rejects, or that decodes to another size, is a ``CorruptChunkError``."""
        results = self._launch(lib, device, True, [ins, in_sizes, raw, outs], int(raw.max()), int(raw.sum()))
        decoded, statuses = _read(results, raw.size)
        failed = np.flatnonzero(statuses)
        if failed.size:
            index = int(failed[0])
            why = _nvcomp_lib.status_name(int(statuses[index]))
            raise CorruptChunkError(f"{self.codec_id} chunk {index} does not decode on the GPU: nvCOMP says {why}",
                                    index)
        wrong = np.flatnonzero(decoded != raw)
        if wrong.size:
            index = int(wrong[0])
            raise CorruptChunkError(f"{self.codec_id} chunk {index} decoded to {int(decoded[index])} bytes on the GPU, "
                                    f"expected {int(raw[index])}", index)

    def _launch(self, lib: _nvcomp_lib.Library, device: torch.device, decompress: bool, columns: list[np.ndarray],
                max_chunk: int, total: int) -> torch.Tensor:
        """Queue one batched call on the current stream. ``columns`` (addresses and sizes, one
        entry per chunk, in the order of nvCOMP's arguments) reach the device in one copy from
        pinned memory; returns the device buffer nvCOMP writes each chunk's size and status into
        (:func:`_read`). Every buffer is allocated on this stream, so torch reuses none of them
        before the call has run; the table's pinned staging is reused only once its copy ran."""
        count = columns[0].size
        table = to_device(np.stack([c.astype(np.uint64, copy=False) for c in columns]).view(np.int64), device)
        results = torch.zeros(2 * count, dtype=torch.int64, device=device)
        step, temp_bytes = self._launch_size(lib, device, decompress, count, max_chunk, total)
        temp = torch.empty(max(temp_bytes, 1), dtype=torch.uint8, device=device)
        stream = torch.cuda.current_stream(device).cuda_stream
        for first in range(0, count, step):  # each launch's columns and results start at its first chunk
            n = min(step, count - first)
            at = [table.data_ptr() + 8 * (count * k + first) for k in range(len(columns))]
            sizes, statuses = results.data_ptr() + 8 * first, results.data_ptr() + 8 * (count + first)
            if decompress:
                lib.decompress(self._format, at[0], at[1], at[2], sizes, n, temp.data_ptr(), temp_bytes, at[3],
                               statuses, stream)
            else:
                lib.compress(self._format, at[0], at[1], max_chunk, n, temp.data_ptr(), temp_bytes, at[2], sizes,
                             statuses, stream)
        return results

    def _launch_size(self, lib: _nvcomp_lib.Library, device: torch.device, decompress: bool, count: int,
                     max_chunk: int, total: int) -> tuple[int, int]:
        """How many of ``count`` chunks one launch codes, and the scratch it needs: all of them,
        unless their scratch would pass :data:`_SCRATCH_STEP` beside one chunk's, and a quarter of
        the room on ``device``; then as many as stay within that."""
        temp = lib.temp_bytes(self._format, decompress, count, max_chunk, total)
        if temp <= _SCRATCH_STEP:
            return count, temp
        free, _ = torch.cuda.mem_get_info(device)
        room = int(free) + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        allowed = max(room // 4, self.scratch_bytes(max_chunk, decompress) + _SCRATCH_STEP)
        if temp <= allowed:
            return count, temp
        low, high = 1, count  # scratch grows with the chunks: the most whose scratch is allowed
        while low < high:
            mid = (low + high + 1) // 2
            if lib.temp_bytes(self._format, decompress, mid, max_chunk, mid * max_chunk) <= allowed:
                low = mid
            else:
                high = mid - 1
        return low, lib.temp_bytes(self._format, decompress, low, max_chunk, low * max_chunk)

    def scratch_bytes(self, chunk_bytes: int, decompress: bool = False) -> int:
        """GPU scratch nvCOMP asks for a launch of one chunk of ``chunk_bytes``: what coding with
        this codec needs on the device beside its buffers, however few chunks a launch holds."""
        capacity = self._capacity(chunk_bytes)
        return _library(self.codec_id).temp_bytes(self._format, decompress, 1, capacity, capacity)

    def _capacity(self, largest: int) -> int:
        """The chunk capacity nvCOMP is configured with for chunks of up to ``largest`` bytes (a
        power of two, so few distinct bounds are asked for)."""
        return min(max(_MIN_CHUNK_CAPACITY, 1 << (largest - 1).bit_length()), self.max_chunk_bytes)

    def _check_aligned(self, base: torch.Tensor, offsets: np.ndarray) -> None:
        misaligned = (base.data_ptr() + offsets) % self.alignment != 0
        if misaligned.any():
            index = int(np.argmax(misaligned))
            raise ValueError(
                f"codec {self.codec_id!r} (cuda) reads and writes chunks at {self.alignment}-byte aligned "
                f"addresses; chunk {index} is at offset {int(offsets[index])}"
            )

    def _check_within(self, buffer: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray,
                      error: type[ValueError], what: str) -> None:
        """Every chunk ``[offsets[i], offsets[i] + lengths[i])`` lies inside ``buffer``."""
        outside = (offsets < 0) | (offsets + lengths > buffer.numel())
        if outside.any():
            index = int(np.argmax(outside))
            raise error(f"codec {self.codec_id!r} (cuda): {what} chunk {index} at offset {int(offsets[index])} "
                        f"({int(lengths[index])} bytes) lies outside its buffer of {buffer.numel()} bytes")

    def _check_nonempty(self, lengths: np.ndarray) -> None:
        if (lengths <= 0).any():
            index = int(np.argmax(lengths <= 0))
            raise CorruptCheckpointError(f"{self.codec_id} chunk {index} is empty; a compressed chunk has bytes")

    def _check_chunks(self, chunks: list[torch.Tensor]) -> torch.device:
        """The one CUDA device of the chunks; ``ValueError`` unless all are 1-D contiguous uint8 on it."""
        device = chunks[0].device
        for index, c in enumerate(chunks):
            if not (c.is_cuda and c.dtype == torch.uint8 and c.dim() == 1 and c.is_contiguous() and c.device == device):
                raise ValueError(
                    f"codec {self.codec_id!r} (cuda) takes 1-D contiguous torch.uint8 tensors on one CUDA "
                    f"device ({device} for chunk 0); chunk {index} is {_describe(c)}"
                )
        return device

    def _check_sizes(self, sizes: np.ndarray, error: type[ValueError], verb: str) -> None:
        """Reject empty, oversized or partial-element chunk sizes with ``error`` (the first one)."""
        itemsize = self._itemsize
        bad = (sizes <= 0) | (sizes > self.max_chunk_bytes) | (sizes % itemsize != 0)
        if not bad.any():
            return
        index = int(np.argmax(bad))
        size = int(sizes[index])
        if size <= 0:
            raise error(f"codec {self.codec_id!r} (cuda) needs non-empty chunks; chunk {index} {verb} {size} bytes")
        if size > self.max_chunk_bytes:
            raise error(
                f"codec {self.codec_id!r} (cuda) takes chunks of at most {self.max_chunk_bytes} bytes; "
                f"chunk {index} {verb} {size}: use smaller chunks"
            )
        raise error(
            f"codec {self.codec_id!r} (cuda) with data_type {self._options['data_type']!r} needs chunks of "
            f"whole {itemsize}-byte elements; chunk {index} {verb} {size} bytes"
        )


class NvcompZstdCodec(_NvcompCodec):
    """Zstandard frames on the GPU; interchangeable with the CPU ``zstd`` codec (its ``level`` is ignored)."""

    codec_id = "zstd"
    algorithm = "Zstd"
    chunk_bytes = 256 << 10  # larger chunks slow nvCOMP's zstd decoder
    max_chunk_bytes = 1 << 30  # 2 GiB - 1 allowed; capped so the chunk capacity configured is a power of two
    alignment = 8
    sizes_in_stream = True
    cpu_encoder_options = frozenset({"level", "long_matches_only"})


class NvcompDeflateCodec(_NvcompCodec):
    """Raw DEFLATE (RFC 1951) on the GPU; interchangeable with the CPU ``deflate`` codec.

    ``algorithm_type``: nvCOMP's effort, 0 (fastest, Huffman only) to 5 (best ratio); 1 is nvCOMP's default.
    """

    codec_id = "deflate"
    algorithm = "Deflate"
    max_chunk_bytes = 1 << 31
    alignment = 8
    option_names = ("algorithm_type",)
    cpu_encoder_options = frozenset({"level"})

    def __init__(self, algorithm_type: int = 1) -> None:
        self._options = {"algorithm_type": _choice(self.codec_id, "algorithm_type", algorithm_type, range(6))}

    def _compress_opts(self) -> bytes:
        return struct.pack("<i60x", self._options["algorithm_type"])

    def _decompress_opts(self) -> bytes:
        return struct.pack("<ii56x", 0, 0)  # default backend, no sorting for hardware decompression


class NvcompLz4Codec(_NvcompCodec):
    """LZ4 block format on the GPU; interchangeable with the CPU ``lz4`` codec."""

    codec_id = "lz4"
    algorithm = "LZ4"
    max_chunk_bytes = 1 << 24
    alignment = 4

    def _compress_opts(self) -> bytes:
        return struct.pack("<ii56x", 0, 0)  # bytes (NVCOMP_TYPE_CHAR), no bitshuffle

    def _decompress_opts(self) -> bytes:
        return struct.pack("<iiii48x", 0, 0, 0, 0)


class NvcompAnsCodec(_NvcompCodec):
    """nvCOMP's ANS entropy coder (GPU only).

    ``data_type``: "|u1" codes bytes; "<f2"/"<f4" code 16/32-bit little-endian floats (whole elements).
    """

    codec_id = "ans"
    algorithm = "ANS"
    chunk_bytes = 1 << 20
    max_chunk_bytes = 1 << 24
    alignment = 16
    option_names = ("data_type",)

    def __init__(self, data_type: str = "|u1") -> None:
        self._options = {"data_type": _choice(self.codec_id, "data_type", data_type, ("|u1", "<f2", "<f4"))}

    def _compress_opts(self) -> bytes:  # rANS, the data type, nvCOMP's defaults for the rest
        return struct.pack("<iiBBB53x", 0, _NVCOMP_TYPE[self._options["data_type"]], 0, 0, 0)

    def _decompress_opts(self) -> bytes:
        return struct.pack("<iiBBB53x", 0, _ANY_TYPE, 0, 0, 0)


class NvcompBitcompCodec(_NvcompCodec):
    """nvCOMP's Bitcomp, lossless (GPU only).

    ``algorithm_type``: 0 default, 1 sparse (many zeros). ``data_type``: element type of the chunks.
    """

    codec_id = "bitcomp"
    algorithm = "Bitcomp"
    chunk_bytes = 1 << 20
    max_chunk_bytes = 1 << 24
    alignment = 8
    option_names = ("algorithm_type", "data_type")

    def __init__(self, algorithm_type: int = 0, data_type: str = "|u1") -> None:
        self._options = {
            "algorithm_type": _choice(self.codec_id, "algorithm_type", algorithm_type, (0, 1)),
            "data_type": _choice(self.codec_id, "data_type", data_type, tuple(_ITEMSIZE)),
        }

    def _compress_opts(self) -> bytes:  # algorithm, data type, delta (lossy only), lossless mode
        return struct.pack("<iidi44x", self._options["algorithm_type"], _NVCOMP_TYPE[self._options["data_type"]], 0.0, 0)


class NvcompGdeflateCodec(_NvcompCodec):
    """nvCOMP's GDeflate, a GPU-friendly DEFLATE variant (GPU only).

    ``algorithm_type``: 0 (fastest, Huffman only) to 5 (best ratio); 1 is nvCOMP's default.
    """

    codec_id = "gdeflate"
    algorithm = "Gdeflate"
    # 256 KiB: of 64 KiB to 1 MiB, the size that encodes exponent-like planes fastest (Huffman
    # only), at about the best ratio (results: "Codecs per byte plane"). CPU gdeflate decodes any size.
    chunk_bytes = 256 << 10
    # A launch of fewer chunks than run at once costs one chunk's latency, which is shorter for a
    # smaller chunk: small batches (a filled GPU's) save faster in 128 KiB, larger ones in 256 KiB
    # (results: "A filled GPU, a training job's conditions").
    small_batch_chunk_bytes = 128 << 10
    max_chunk_bytes = 1 << 31
    alignment = 8
    option_names = ("algorithm_type",)

    def __init__(self, algorithm_type: int = 1) -> None:
        self._options = {"algorithm_type": _choice(self.codec_id, "algorithm_type", algorithm_type, range(6))}

    def decoder_config(self) -> dict[str, Any]:
        return {"id": self.codec_id}  # the algorithm type steers the encoder: one bitstream, one decoder

    def _compress_opts(self) -> bytes:
        return struct.pack("<i60x", self._options["algorithm_type"])


class NvcompCascadedCodec(_NvcompCodec):
    """nvCOMP's Cascaded (RLE, delta, bit packing) for integer-like data (GPU only).

    ``data_type``: unsigned integer element type of the chunks.
    """

    codec_id = "cascaded"
    algorithm = "Cascaded"
    max_chunk_bytes = 1 << 24
    alignment = 8
    option_names = ("data_type",)

    def __init__(self, data_type: str = "|u1") -> None:
        self._options = {"data_type": _choice(self.codec_id, "data_type", data_type, ("|u1", "<u2", "<u4"))}

    def _compress_opts(self) -> bytes:
        # data type; nvCOMP's defaults: asymmetric mode, bit packing last, no coarse encoding,
        # every fine-grained encoding (delta, RLE, frame of reference), compression level 3
        return struct.pack("<iiQQQB31x", _NVCOMP_TYPE[self._options["data_type"]], 1, 1, 0, 7, 3)

    def _decompress_opts(self) -> bytes:  # default backend; type and mode read from the stream
        return struct.pack("<i4xiiQQ32x", 0, _ANY_TYPE, 0, 0, 0)


CODECS: tuple[type[_NvcompCodec], ...] = (
    NvcompZstdCodec,
    NvcompDeflateCodec,
    NvcompLz4Codec,
    NvcompAnsCodec,
    NvcompBitcompCodec,
    NvcompGdeflateCodec,
    NvcompCascadedCodec,
)

declare([cls.codec_id for cls in CODECS], "cuda", _load)
