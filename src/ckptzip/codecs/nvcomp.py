"""GPU codecs on NVIDIA nvCOMP (``nvidia-nvcomp-cu12/cu13`` >= 6.0, ``from nvidia import nvcomp``).

Every codec stores nvCOMP's ``RAW`` bitstream: each chunk is one bare stream of its format, with no
nvCOMP header. So ``zstd`` chunks are standard zstd frames, ``deflate`` chunks raw RFC 1951 streams
and ``lz4`` chunks LZ4 *blocks*, interchangeable with the CPU codecs; ``ans``, ``bitcomp``,
``gdeflate`` and ``cascaded`` are NVIDIA formats that only nvCOMP decodes. Options a RAW decoder
needs (such as ``data_type``) live in the codec config, which the container stores.

Contract, beyond :class:`~ckptzip.codecs.base.Codec`:

- One ``encode``/``decode`` call hands nvCOMP the whole batch (one ``BatchArray``) on the current
  torch CUDA stream. ``encode`` waits for the compressed sizes; ``decode`` waits for nvCOMP's
  result so it can report a bad chunk. Nothing else synchronises with the host.
- Chunks must be non-empty (``ValueError`` otherwise) and at most ``max_chunk_bytes``; with a
  multi-byte ``data_type`` their sizes must be whole elements.
- The returned chunks are views into one buffer allocated per call, which stays alive while any
  of them does; copy them (e.g. to the host) to release it.
- nvCOMP's zstd, deflate, gdeflate, bitcomp and cascaded decoders are only defined on valid input
  (nvCOMP known issue): verify stored bytes before decoding them.
- nvCOMP codec objects are costly to create and not thread-safe; they are cached per thread, per
  algorithm, options, chunk capacity, device and stream.
- ``nvidia.nvcomp`` is imported (and CUDA asked for) when a GPU codec is first asked for
  (:func:`~ckptzip.codecs.registry.declare`), never by importing ckptzip.
"""

from __future__ import annotations

import atexit
import importlib.util
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from ..errors import CodecUnavailableError, CorruptCheckpointError, CorruptChunkError
from .base import Codec
from .registry import declare, mark_unavailable, register

_MIN_NVCOMP_MAJOR = 6
_INSTALL_HINT = "pip install {}ckptzip[gpu], or ckptzip[gpu-cu13] for CUDA 13"

_ITEMSIZE = {"|u1": 1, "<u2": 2, "<u4": 4, "<f2": 2, "<f4": 4}
_MIN_CHUNK_CAPACITY = 1 << 16
_SLOT_ALIGN = 256  # output slots of encode_segments start at multiples of this  # nvCOMP's default uncomp_chunk_size
_MAX_CACHED_ENGINES = 16


def _why_unavailable(cuda_available: bool, nvcomp_problem: str | None) -> str | None:
    """Why the GPU codecs cannot run here, or None when they can."""
    problems = [nvcomp_problem] if nvcomp_problem else []
    if not cuda_available:
        problems.append("no CUDA device is visible (torch.cuda.is_available() is False)")
    return " and ".join(problems) or None


def _load_nvcomp(import_it: bool) -> tuple[Any, str | None]:
    """Import ``nvidia.nvcomp`` (or only look for it); return the module and what is wrong with it."""
    try:
        installed = importlib.util.find_spec("nvidia.nvcomp") is not None
    except (ImportError, ValueError):  # no ``nvidia`` package, or a stand-in without a spec
        installed = False
    if not installed:
        return None, f"nvidia.nvcomp is not installed ({_INSTALL_HINT.format('')})"
    if not import_it:
        return None, None
    try:
        from nvidia import nvcomp as module
    except Exception as exc:  # a broken wheel or missing libnvcomp raises more than ImportError
        why = f"{type(exc).__name__}: {exc}"
        return None, f"nvidia.nvcomp fails to import ({why}); reinstall it ({_INSTALL_HINT.format('')})"
    version = str(getattr(module, "__version__", "0"))
    major = version.split(".")[0]
    if not major.isdigit() or int(major) < _MIN_NVCOMP_MAJOR:
        return None, (
            f"nvidia.nvcomp {version} is older than the {_MIN_NVCOMP_MAJOR}.0 ckptzip needs; "
            f"upgrade it ({_INSTALL_HINT.format('-U ')})"
        )
    return module, None


_nv: Any = None
_LOADING = threading.Lock()
_loaded = False
_reason: str | None = None  # once loaded: why the GPU codecs cannot run here, or None


def _load() -> str | None:
    """Import nvCOMP where CUDA runs, once, and register the GPU codecs or mark them unavailable;
    return why they cannot run here (None: they can)."""
    global _nv, _loaded, _reason
    with _LOADING:
        if not _loaded:
            cuda = torch.cuda.is_available()
            _nv, problem = _load_nvcomp(import_it=cuda)
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


class _TorchBuffer:
    """Device memory nvCOMP asked for, taken from torch's caching allocator on the calling
    thread's current stream (nvCOMP's own, which the engine binds to it)."""

    __slots__ = ("_tensor", "ptr")

    def __init__(self, nbytes: int, stream: Any) -> None:
        self._tensor = torch.empty(max(1, int(nbytes)), dtype=torch.uint8, device="cuda")
        self.ptr = self._tensor.data_ptr()


_ROUTED = threading.Lock()
_routed = False


def _route_allocations() -> None:
    """Make nvCOMP allocate through torch's caching allocator (once per process). Its default,
    cudaMalloc, fails while torch caches the free memory, and cudaFree synchronises the device;
    through torch, its scratch and outputs come from the memory torch can hand out, on the stream
    the engine works on (:mod:`ckptzip.engine.memory`)."""
    global _routed
    with _ROUTED:
        if not _routed:
            _nv.set_device_allocator(_TorchBuffer)
            atexit.register(_unroute)
            _routed = True


def _unroute() -> None:
    """At exit, drop this thread's codec objects while torch can still take their memory back."""
    lru = getattr(_ENGINES, "lru", None)
    if lru is not None:
        lru.clear()


class _Engine:
    """One ``nvcomp.Codec`` bound to a device, a stream and a chunk capacity (not thread-safe)."""

    def __init__(self, algorithm: str, options: dict[str, Any], capacity: int, device: int, stream: int) -> None:
        _route_allocations()
        self.stream = stream
        self.codec = _nv.Codec(
            algorithm=algorithm,
            device_id=device,
            cuda_stream=stream,
            uncomp_chunk_size=capacity,
            bitstream_kind=_nv.BitstreamKind.RAW,
            **options,
        )
        self.capacity = capacity
        self.device = device
        self._slot_bytes: int | None = None

    def slot_bytes(self) -> int:
        """Output room nvCOMP requires for every chunk of a batch: the compressed-size bound of a
        full ``capacity`` chunk, whatever the chunk's own size (nvCOMP 6 checks each output
        against it)."""
        if self._slot_bytes is None:
            probe = torch.empty(self.capacity, dtype=torch.uint8, device=f"cuda:{self.device}")
            array = _nv.as_array(probe, cuda_stream=self.stream)
            self._slot_bytes = int(self.codec.get_max_comp_buffer_size(array))
        return self._slot_bytes


_ENGINES = threading.local()


def _engine(key: tuple[Any, ...], make: Callable[[], _Engine]) -> _Engine:
    """The calling thread's engine for ``key``, created on first use (small LRU)."""
    engines: OrderedDict[tuple[Any, ...], _Engine] | None = getattr(_ENGINES, "lru", None)
    if engines is None:
        engines = _ENGINES.lru = OrderedDict()
    engine = engines.get(key)
    if engine is None:
        engine = engines[key] = make()
        if len(engines) > _MAX_CACHED_ENGINES:
            engines.popitem(last=False)
    else:
        engines.move_to_end(key)
    return engine


def _slots(sizes: Sequence[int], alignment: int) -> tuple[list[int], int]:
    """Offsets that place ``sizes`` back to back at ``alignment``, and the total length."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // alignment) * alignment
    return offsets, end


def _retry_out_of_memory(call: Callable[[], Any]) -> Any:
    """``call()``; once more after emptying PyTorch's cache if nvCOMP ran out of device memory
    (an allocation nvCOMP makes itself, outside :class:`_TorchBuffer`, cannot take blocks PyTorch
    caches)."""
    try:
        return call()
    except RuntimeError as exc:
        if "out of memory" not in str(exc):
            raise
        torch.cuda.empty_cache()
        return call()


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


def _as_batch(chunks: Sequence[torch.Tensor], sizes: Sequence[int], alignment: int, stream: int) -> Any:
    """An nvCOMP ``BatchArray`` over the chunks: zero-copy when they share one allocation at aligned
    addresses (chunks split from one stream), else over an aligned packed copy."""
    storage = chunks[0].untyped_storage()
    base_ptr = storage.data_ptr()
    if all(c.untyped_storage().data_ptr() == base_ptr and c.data_ptr() % alignment == 0 for c in chunks):
        base = torch.empty(0, dtype=torch.uint8, device=chunks[0].device).set_(storage)
        return _nv.as_arrays(base, [c.data_ptr() - base_ptr for c in chunks], list(sizes), cuda_stream=stream)
    packed, offsets = _pack(chunks, sizes, alignment)
    return _nv.as_arrays(packed, offsets, list(sizes), cuda_stream=stream)


def _describe(t: torch.Tensor) -> str:
    layout = "" if t.is_contiguous() else ", non-contiguous"
    return f"a {t.dim()}-D {t.dtype} tensor on {t.device}{layout}"


def _choice(codec_id: str, name: str, value: Any, allowed: Sequence[int] | Sequence[str]) -> Any:
    """``value`` if it is one of ``allowed`` (same type: no bools or floats for ints), else ``ValueError``."""
    if type(value) is not type(allowed[0]) or value not in allowed:
        raise ValueError(f"codec {codec_id!r} option {name} must be one of {list(allowed)}, got {value!r}")
    return value


class _NvcompCodec(Codec):
    """Batched nvCOMP codec on CUDA tensors; subclasses name the format and validate options."""

    backend: ClassVar[str] = "cuda"
    algorithm: ClassVar[str]  # nvCOMP's algorithm name
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

    def encode(self, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Compress each chunk; returns exact-size views into one new buffer."""
        chunks = list(chunks)
        if not chunks:
            return []
        self._require_nvcomp()
        device = self._check_chunks(chunks)
        sizes = [c.numel() for c in chunks]
        self._check_sizes(sizes, ValueError, "has")
        with torch.cuda.device(device):
            engine = self._engine_for(device, max(sizes))
            source = _as_batch(chunks, sizes, self.alignment, engine.stream)
            bounds = [engine.slot_bytes()] * len(chunks)
            offsets, total = _slots(bounds, self.alignment)
            out = torch.zeros(total, dtype=torch.uint8, device=device)  # see encode_segments
            target = _nv.as_arrays(out, offsets, bounds, cuda_stream=engine.stream)
            encoded = engine.codec.encode(source, out=target)
            compressed = [int(n) for n in encoded.buffer_sizes]  # waits for the sizes
        return _views(out, offsets, compressed)

    def decode(self, chunks: Sequence[torch.Tensor], raw_sizes: Sequence[int]) -> list[torch.Tensor]:
        """Decompress each chunk to exactly ``raw_sizes[i]`` bytes; views into one new buffer.

        Raises ``CorruptCheckpointError`` naming the chunk when nvCOMP rejects one or reports
        another decoded size.
        """
        chunks, raw_sizes = list(chunks), [int(n) for n in raw_sizes]
        if len(chunks) != len(raw_sizes):
            raise ValueError(f"codec {self.codec_id!r}: {len(chunks)} chunks but {len(raw_sizes)} raw sizes")
        if not chunks:
            return []
        self._require_nvcomp()
        device = self._check_chunks(chunks)
        self._check_sizes(raw_sizes, CorruptCheckpointError, "decodes to")
        for index, chunk in enumerate(chunks):
            if chunk.numel() == 0:
                raise CorruptCheckpointError(f"{self.codec_id} chunk {index} is empty; a compressed chunk has bytes")
        def run() -> tuple[tuple[torch.Tensor, list[int]], list[int]]:
            out, offsets, decoded = self._decode_batch(device, chunks, raw_sizes)
            return (out, offsets), decoded

        with torch.cuda.device(device):
            out, offsets = self._decode_checked(device, lambda: chunks, raw_sizes, run)
        return _views(out, offsets, raw_sizes)

    def encode_segments(self, base: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray
                        ) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """One nvCOMP launch over chunks of ``base`` read in place (they must start at the codec's
        alignment); the outputs lie in slots of the compressed-size bound, one sync for the sizes."""
        if not len(lengths):
            return base.new_empty(0), offsets, lengths
        self._require_nvcomp()
        device = self._check_chunks([base])
        sizes = lengths.tolist()
        self._check_sizes(sizes, ValueError, "has")
        self._check_aligned(base, offsets)
        with torch.cuda.device(device):
            engine = self._engine_for(device, max(sizes))
            source = _nv.as_arrays(base, offsets.tolist(), sizes, cuda_stream=engine.stream)
            slot = -(-engine.slot_bytes() // _SLOT_ALIGN) * _SLOT_ALIGN
            out_offsets = np.arange(len(sizes), dtype=np.int64) * slot
            # Zeroed: whatever nvCOMP leaves unwritten within a chunk's reported size would
            # otherwise carry stale device memory into the file, and files would differ with the
            # process's allocation history (a memset: ~0.5 ms per GiB on an H200).
            out = torch.zeros(slot * len(sizes), dtype=torch.uint8, device=device)
            target = _nv.as_arrays(out, out_offsets.tolist(), [engine.slot_bytes()] * len(sizes),
                                   cuda_stream=engine.stream)
            encoded = _retry_out_of_memory(lambda: engine.codec.encode(source, out=target))
            compressed = np.array(encoded.buffer_sizes, dtype=np.int64)  # waits for the sizes
        return out, out_offsets, compressed

    def decode_segments(self, src: torch.Tensor, src_offsets: np.ndarray, src_lengths: np.ndarray,
                        dst: torch.Tensor, dst_offsets: np.ndarray, raw_lengths: np.ndarray) -> None:
        """One nvCOMP launch from chunks of ``src`` into ``dst``, both read and written in place at
        the codec's alignment; chunk sizes checked against ``raw_lengths``."""
        if not len(raw_lengths):
            return
        self._require_nvcomp()
        device = self._check_chunks([src, dst])
        raw = raw_lengths.tolist()
        self._check_sizes(raw, CorruptCheckpointError, "decodes to")
        if (src_lengths <= 0).any():
            index = int(np.argmax(src_lengths <= 0))
            raise CorruptCheckpointError(f"{self.codec_id} chunk {index} is empty; a compressed chunk has bytes")
        self._check_aligned(src, src_offsets)
        self._check_aligned(dst, dst_offsets)
        with torch.cuda.device(device):
            engine = self._engine_for(device, max(raw))
            source = _nv.as_arrays(src, src_offsets.tolist(), src_lengths.tolist(), cuda_stream=engine.stream)
            target = _nv.as_arrays(dst, dst_offsets.tolist(), raw, cuda_stream=engine.stream)
            self._decode_checked(
                device,
                lambda: [src[o : o + n] for o, n in zip(src_offsets.tolist(), src_lengths.tolist())],
                raw,
                lambda: (None, self._run_decode(engine, source, target, raw)),
            )

    def _decode_checked(self, device: torch.device, chunks: Callable[[], list[torch.Tensor]], raw_sizes: list[int],
                        run: Callable[[], tuple[Any, list[int]]]) -> Any:
        """``run()`` a batched decode returning (value, decoded sizes); return the value. A batch
        nvCOMP rejects is decoded chunk by chunk to name the bad chunk; a chunk that decodes to
        another size than ``raw_sizes`` says is named too (``CorruptChunkError``)."""
        try:
            value, decoded = run()
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, ValueError) as exc:  # what nvCOMP raises for a stream it rejects
            culprit = self._find_corrupt(device, chunks(), raw_sizes)
            if culprit is None:
                raise
            raise culprit from exc
        for index, (got, expected) in enumerate(zip(decoded, raw_sizes)):
            if got != expected:
                raise CorruptChunkError(
                    f"{self.codec_id} chunk {index} decoded to {got} bytes on the GPU, expected {expected}", index
                )
        return value

    def _check_aligned(self, base: torch.Tensor, offsets: np.ndarray) -> None:
        misaligned = (base.data_ptr() + offsets) % self.alignment != 0
        if misaligned.any():
            index = int(np.argmax(misaligned))
            raise ValueError(
                f"codec {self.codec_id!r} (cuda) reads and writes chunks at {self.alignment}-byte aligned "
                f"addresses; chunk {index} is at offset {int(offsets[index])}"
            )

    def _run_decode(self, engine: _Engine, source: Any, target: Any, raw_sizes: list[int]) -> list[int]:
        if self.sizes_in_stream:
            # nvCOMP parses the sizes the streams declare, so a size that differs from the index is caught.
            decoded = _retry_out_of_memory(lambda: engine.codec.decode(source, out=target))
        else:
            # A config built from the raw sizes spares nvCOMP a synchronising parse of every stream;
            # the output sizes still bound every write, and the tensor checksum checks the content.
            config = engine.codec.decompression_config(engine.codec.compression_config(raw_sizes))
            decoded = _retry_out_of_memory(lambda: engine.codec.decode(source, out=target, decompression_config=config))
        return [int(n) for n in decoded.buffer_sizes]  # waits for nvCOMP's result

    def _decode_batch(
        self, device: torch.device, chunks: list[torch.Tensor], raw_sizes: list[int]
    ) -> tuple[torch.Tensor, list[int], list[int]]:
        """Decode into one new buffer; return it, the chunk offsets and the sizes nvCOMP reports."""
        engine = self._engine_for(device, max(raw_sizes))
        source = _as_batch(chunks, [c.numel() for c in chunks], self.alignment, engine.stream)
        offsets, total = _slots(raw_sizes, self.alignment)
        out = torch.empty(total, dtype=torch.uint8, device=device)
        target = _nv.as_arrays(out, offsets, raw_sizes, cuda_stream=engine.stream)
        return out, offsets, self._run_decode(engine, source, target, raw_sizes)

    def _find_corrupt(
        self, device: torch.device, chunks: list[torch.Tensor], raw_sizes: list[int]
    ) -> CorruptChunkError | None:
        """After a failed batch, decode chunk by chunk to name the bad one (None: none fails alone)."""
        for index, (chunk, raw_size) in enumerate(zip(chunks, raw_sizes)):
            try:
                _, _, (got,) = self._decode_batch(device, [chunk], [raw_size])
            except torch.OutOfMemoryError:
                raise
            except (RuntimeError, ValueError) as exc:
                return CorruptChunkError(f"{self.codec_id} chunk {index} does not decode on the GPU: {exc}", index)
            if got != raw_size:
                return CorruptChunkError(
                    f"{self.codec_id} chunk {index} decoded to {got} bytes on the GPU, expected {raw_size}", index
                )
        return None

    def _require_nvcomp(self) -> None:
        reason = _load()
        if reason is not None:
            raise CodecUnavailableError(f"codec {self.codec_id!r} cannot run on the GPU here: {reason}.")

    def _engine_for(self, device: torch.device, largest: int) -> _Engine:
        """The cached engine for this codec on the current stream, sized for chunks of ``largest`` bytes."""
        capacity = min(max(_MIN_CHUNK_CAPACITY, 1 << (largest - 1).bit_length()), self.max_chunk_bytes)
        stream = torch.cuda.current_stream(device).cuda_stream
        key = (self.algorithm, tuple(sorted(self._options.items())), capacity, device.index, stream)
        return _engine(key, lambda: _Engine(self.algorithm, self._options, capacity, device.index, stream))

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

    def _check_sizes(self, sizes: list[int], error: type[ValueError], verb: str) -> None:
        """Reject empty, oversized or partial-element chunk sizes with ``error``."""
        itemsize = self._itemsize
        for index, size in enumerate(sizes):
            if size <= 0:
                raise error(f"codec {self.codec_id!r} (cuda) needs non-empty chunks; chunk {index} {verb} {size} bytes")
            if size > self.max_chunk_bytes:
                raise error(
                    f"codec {self.codec_id!r} (cuda) takes chunks of at most {self.max_chunk_bytes} bytes; "
                    f"chunk {index} {verb} {size}: use smaller chunks"
                )
            if size % itemsize:
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


class NvcompLz4Codec(_NvcompCodec):
    """LZ4 block format on the GPU; interchangeable with the CPU ``lz4`` codec."""

    codec_id = "lz4"
    algorithm = "LZ4"
    max_chunk_bytes = 1 << 24
    alignment = 4


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


class NvcompGdeflateCodec(_NvcompCodec):
    """nvCOMP's GDeflate, a GPU-friendly DEFLATE variant (GPU only).

    ``algorithm_type``: 0 (fastest, Huffman only) to 5 (best ratio); 1 is nvCOMP's default.
    """

    codec_id = "gdeflate"
    algorithm = "GDeflate"
    # On an H200 (exponent-like plane, Huffman only): 256 KiB chunks encode at 118 GB/s against 93
    # at 64 KiB and 73 at 1 MiB, at the best ratio of the three. CPU gdeflate decodes any size.
    chunk_bytes = 256 << 10
    max_chunk_bytes = 1 << 31
    alignment = 8
    option_names = ("algorithm_type",)

    def __init__(self, algorithm_type: int = 1) -> None:
        self._options = {"algorithm_type": _choice(self.codec_id, "algorithm_type", algorithm_type, range(6))}

    def decoder_config(self) -> dict[str, Any]:
        return {"id": self.codec_id}  # the algorithm type steers the encoder: one bitstream, one decoder


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
