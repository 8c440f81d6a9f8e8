"""The ways people save training state today, behind one interface, so the benchmark can time them.

Every baseline has a ``name``, ``available() -> (ok, reason)``, ``save(state, directory) ->
SaveResult`` (wall time including ``fsync`` of every file and the directory), ``load(directory,
device) -> (state, seconds)`` and ``expected(state)``: what a correct ``load`` returns, which
:func:`ckptzip.demo.compare.assert_state_equal` checks bit for bit.

Raw-bytes baselines (CPU zstd, nvCOMP, ZipNN) share one layout: ``blobs.bin`` holds each tensor's
encoded bytes back to back, ``index.pt`` the state with every tensor replaced by a meta tensor
(shape and dtype only) plus the blob sizes, read back with ``torch.load(weights_only=True)``.
The GPU baselines also report codec throughput on the device (:meth:`NvcompZstd.throughput`).
"""

from __future__ import annotations

import abc
import importlib
import importlib.util
import inspect
import io
import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, ClassVar, TypeVar

import numpy as np
import torch
from torch.utils.dlpack import from_dlpack

from .measure import flat_tensors, iter_tensors, tensor_nbytes
from ckptzip.errors import CheckpointWriteError, CodecUnavailableError, CorruptCheckpointError
from ckptzip.tree import map_tree

__all__ = [
    "BASELINES",
    "Baseline",
    "CodecThroughput",
    "CpuZstd",
    "Dcp",
    "DcpZstd",
    "NvcompAns",
    "NvcompAnsTyped",
    "NvcompZstd",
    "Safetensors",
    "SaveResult",
    "StreamIO",
    "TorchSave",
    "ZipNN",
    "get_baseline",
]

T = TypeVar("T")
StreamIO = tuple[Callable[[Any, BinaryIO], None], Callable[[BinaryIO, torch.device], Any]]


@dataclass(frozen=True)
class SaveResult:
    bytes_written: int
    seconds: float


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, buffers: Sequence[Any]) -> None:
    """Write bytes-like buffers back to back and fsync."""
    with open(path, "wb") as f:
        for buffer in buffers:
            f.write(buffer)
        f.flush()
        os.fsync(f.fileno())


class Baseline(abc.ABC):
    """One way of saving and loading a whole training state (see the module docstring)."""

    name: ClassVar[str]
    summary: ClassVar[str]

    def available(self) -> tuple[bool, str]:
        """``(True, "")`` or ``(False, why and what to install)``."""
        return True, ""

    def expected(self, state: Any) -> Any:
        """What :meth:`load` returns for a saved ``state`` (the state itself unless overridden)."""
        return state

    def stream_io(self) -> StreamIO | None:
        """``(save(state, file), load(file, device))`` for a method that writes one file object and
        reads it back (what the bench's pipeline section times); ``None`` for the others."""
        return None

    def save(self, state: Any, directory: str | Path) -> SaveResult:
        """Save into ``directory`` (created; must be empty) and fsync; time includes the fsync."""
        self._require()
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if any(directory.iterdir()):
            raise CheckpointWriteError(
                f"baseline {self.name!r} needs an empty directory so the bytes it writes can be "
                f"counted, but {str(directory)!r} is not empty; pass a fresh directory"
            )
        _synchronize()
        start = time.perf_counter()
        self._save(state, directory)
        _fsync_path(directory)
        seconds = time.perf_counter() - start
        written = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
        return SaveResult(bytes_written=written, seconds=seconds)

    def load(self, directory: str | Path, device: str | torch.device = "cpu") -> tuple[Any, float]:
        """Load what :meth:`save` wrote onto ``device``; returns the state and the seconds taken."""
        self._require()
        start = time.perf_counter()
        state = self._load(Path(directory), torch.device(device))
        _synchronize()
        return state, time.perf_counter() - start

    def _require(self) -> None:
        ok, why = self.available()
        if not ok:
            raise CodecUnavailableError(f"baseline {self.name!r} cannot run here: {why}")

    @abc.abstractmethod
    def _save(self, state: Any, directory: Path) -> None: ...

    @abc.abstractmethod
    def _load(self, directory: Path, device: torch.device) -> Any: ...


def _map_tensors(state: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``state`` with ``fn`` applied to its tensors (in :func:`iter_tensors` order), containers
    rebuilt where something changed."""
    return map_tree(state, lambda value, _: fn(value) if isinstance(value, torch.Tensor) else value)


# ------------------------------------------------------------------------------ torch.save


class TorchSave(Baseline):
    name = "torch.save"
    summary = "torch.save of the whole state (zip of pickle + raw tensor bytes)"

    def _save(self, state: Any, directory: Path) -> None:
        path = directory / "state.pt"
        torch.save(state, path)
        _fsync_path(path)

    def stream_io(self) -> StreamIO:
        return torch.save, lambda f, device: torch.load(f, map_location=device, weights_only=True)

    def _load(self, directory: Path, device: torch.device) -> Any:
        return torch.load(directory / "state.pt", map_location=device, weights_only=True)


# ----------------------------------------------------------------------------- safetensors


class Safetensors(Baseline):
    name = "safetensors"
    summary = (
        "safetensors of the tensors only, under dotted paths; it cannot hold the rest "
        "(step, param_groups, scheduler), so that is not stored"
    )

    def available(self) -> tuple[bool, str]:
        if importlib.util.find_spec("safetensors") is None:
            return False, "needs the safetensors package: pip install safetensors"
        return True, ""

    def expected(self, state: Any) -> dict[str, torch.Tensor]:
        return flat_tensors(state)

    def _save(self, state: Any, directory: Path) -> None:
        from safetensors.torch import save_file

        path = directory / "tensors.safetensors"
        save_file({k: t.contiguous() for k, t in flat_tensors(state).items()}, str(path))
        _fsync_path(path)

    def _load(self, directory: Path, device: torch.device) -> Any:
        from safetensors.torch import load_file

        return load_file(directory / "tensors.safetensors", device=str(device))


# ------------------------------------------------------------------- torch.distributed.checkpoint


@contextmanager
def _single_process() -> Iterator[None]:
    """Silence DCP's notice that it runs without a process group: that is this baseline's setup."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        yield


def _string_keys(state: Any) -> Any:
    return map_tree(state, lambda value, _: value, lambda key, _: str(key))


class Dcp(Baseline):
    name = "dcp"
    summary = "torch.distributed.checkpoint FileSystemWriter, one process, no process group"

    def available(self) -> tuple[bool, str]:
        loader = importlib.import_module("torch.distributed.checkpoint.state_dict_loader")
        if not hasattr(loader, "_load_state_dict_from_keys"):
            return False, (
                f"torch {torch.__version__} lacks torch.distributed.checkpoint's template-free "
                "loader; use torch >= 2.5"
            )
        return True, ""

    def expected(self, state: Any) -> Any:
        """Loaded without a template, DCP gives plain dicts with string keys (``state.0`` not ``state[0]``)."""
        return _string_keys(state)

    def _writer_options(self) -> dict[str, Any]:
        return {}

    def _save(self, state: Any, directory: Path) -> None:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import save

        writer = FileSystemWriter(directory, sync_files=True, **self._writer_options())
        with _single_process():
            save(state, storage_writer=writer)

    def _load(self, directory: Path, device: torch.device) -> Any:
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

        with _single_process():
            state = _load_state_dict_from_keys(storage_reader=FileSystemReader(directory))
        return _map_tensors(state, lambda t: t.to(device))


class DcpZstd(Dcp):
    name = "dcp+zstd"
    summary = "DCP FileSystemWriter with its experimental zstd stream extension (CPU, one thread)"

    def available(self) -> tuple[bool, str]:
        ok, why = super().available()
        if not ok:
            return ok, why
        try:
            from torch.distributed.checkpoint._extension import ZStandard
            from torch.distributed.checkpoint.filesystem import FileSystemWriter
        except ImportError:
            return False, f"torch {torch.__version__} has no DCP ZStandard stream extension"
        if "_extensions" not in inspect.signature(FileSystemWriter.__init__).parameters:
            return False, f"torch {torch.__version__}'s FileSystemWriter takes no _extensions"
        if not ZStandard.is_available():
            return False, "DCP's ZStandard extension needs zstandard: pip install zstandard"
        return True, ""

    def _writer_options(self) -> dict[str, Any]:
        from torch.distributed.checkpoint._extension import ZStandard

        return {"_extensions": [ZStandard()]}


# ------------------------------------------------------------------------- raw-bytes baselines


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor`` as a 1-D ``uint8`` tensor on its device."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _host_bytes(tensor: torch.Tensor) -> np.ndarray:
    return _raw(tensor.detach().cpu()).numpy()


def _from_raw(data: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Reinterpret 1-D ``uint8`` ``data`` as a tensor shaped like ``like``; checks the size."""
    nbytes = like.numel() * like.element_size()
    if data.numel() != nbytes:
        raise CorruptCheckpointError(
            f"decoded {data.numel()} bytes for a {like.dtype} tensor of shape {tuple(like.shape)}, "
            f"expected {nbytes}; the baseline's files are damaged, save again"
        )
    return data.view(like.dtype).reshape(like.shape)


def _split(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """The state with tensors replaced by meta tensors, and the tensors in :func:`iter_tensors` order."""
    tensors: list[torch.Tensor] = []

    def to_meta(t: torch.Tensor) -> torch.Tensor:
        tensors.append(t)
        return torch.empty(t.shape, dtype=t.dtype, device="meta")

    return _map_tensors(state, to_meta), tensors


class _BlobBaseline(Baseline):
    """Each tensor's raw bytes through one codec; layout in the module docstring."""

    _pin_memory: ClassVar[bool] = False

    @abc.abstractmethod
    def _encode(self, tensors: list[torch.Tensor]) -> list[Any]:
        """One buffer (bytes-like) per tensor; an empty tensor must give an empty buffer."""

    @abc.abstractmethod
    def _decode(
        self, blobs: list[torch.Tensor], like: list[torch.Tensor], device: torch.device
    ) -> list[torch.Tensor]:
        """Tensors shaped like ``like`` (meta tensors) on ``device`` from 1-D ``uint8`` CPU blobs."""

    def _save(self, state: Any, directory: Path) -> None:
        skeleton, tensors = _split(state)
        blobs = self._encode(tensors)
        _write_file(directory / "blobs.bin", blobs)
        index = io.BytesIO()
        torch.save({"skeleton": skeleton, "sizes": [memoryview(b).nbytes for b in blobs]}, index)
        _write_file(directory / "index.pt", [index.getbuffer()])

    def _load(self, directory: Path, device: torch.device) -> Any:
        index = torch.load(directory / "index.pt", weights_only=True)
        skeleton, sizes = index["skeleton"], index["sizes"]
        like = [t for _, t in iter_tensors(skeleton)]
        if len(like) != len(sizes):
            raise CorruptCheckpointError(
                f"index.pt in {str(directory)!r} lists {len(sizes)} blobs for {len(like)} tensors; "
                "the baseline's files are damaged, save again"
            )
        decoded = iter(self._decode(self._read_blobs(directory / "blobs.bin", sizes), like, device))
        return _map_tensors(skeleton, lambda _: next(decoded))

    def _read_blobs(self, path: Path, sizes: list[int]) -> list[torch.Tensor]:
        total = sum(sizes)
        if path.stat().st_size != total:
            raise CorruptCheckpointError(
                f"{str(path)!r} has {path.stat().st_size} bytes, index.pt expects {total}; "
                "the baseline's files are damaged, save again"
            )
        buffer = torch.empty(total, dtype=torch.uint8, pin_memory=self._pin_memory)
        view = buffer.numpy().data
        with open(path, "rb", buffering=0) as f:
            filled = 0
            while filled < total:
                filled += f.readinto(view[filled:]) or 0
        return list(buffer.split(sizes))


class CpuZstd(_BlobBaseline):
    name = "zstd-cpu"
    summary = "zstandard on each tensor's raw bytes, multi-threaded compression, parallel decompression"

    def __init__(self, level: int = 3, threads: int | None = None) -> None:
        self.level = level
        self.threads = threads or os.cpu_count() or 1

    def available(self) -> tuple[bool, str]:
        if importlib.util.find_spec("zstandard") is None:
            return False, "needs zstandard: pip install zstandard"
        return True, ""

    def _encode(self, tensors: list[torch.Tensor]) -> list[Any]:
        import zstandard

        compressor = zstandard.ZstdCompressor(level=self.level, threads=self.threads)
        return [compressor.compress(_host_bytes(t).data) if t.numel() else b"" for t in tensors]

    def _decode(
        self, blobs: list[torch.Tensor], like: list[torch.Tensor], device: torch.device
    ) -> list[torch.Tensor]:
        import zstandard

        def one(blob: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
            out = torch.empty(meta.numel() * meta.element_size(), dtype=torch.uint8)
            if out.numel():
                # zstd decompresses a frame on one thread; the pool spreads frames over cores.
                with zstandard.ZstdDecompressor().stream_reader(blob.numpy().data) as reader:
                    view, filled = out.numpy().data, 0
                    while filled < out.numel() and (n := reader.readinto(view[filled:])):
                        filled += n
                    if filled != out.numel() or reader.read(1):
                        raise CorruptCheckpointError(
                            f"a zstd frame did not decode to {out.numel()} bytes; "
                            "the baseline's files are damaged, save again"
                        )
            return _from_raw(out, meta).to(device)

        with ThreadPoolExecutor(self.threads) as pool:
            return list(pool.map(one, blobs, like))


def _zipnn_coder() -> Any:
    """The ``zipnn.ZipNN`` class; raises ``ImportError`` where ZipNN is not installed."""
    from zipnn import ZipNN

    return ZipNN


class ZipNN(_BlobBaseline):
    name = "zipnn"
    summary = "ZipNN (byte grouping + Huffman/zstd) on each float tensor's bytes; other dtypes raw"

    _DTYPES: ClassVar[dict[torch.dtype, str]] = {
        torch.float32: "float32",
        torch.bfloat16: "bfloat16",
        torch.float16: "float16",
    }

    def available(self) -> tuple[bool, str]:
        try:
            _zipnn_coder()
        except ImportError:
            return False, "needs ZipNN: pip install zipnn"
        return True, ""

    def _coders(self) -> dict[torch.dtype, Any]:
        coder = _zipnn_coder()
        return {
            dtype: coder(input_format="byte", bytearray_dtype=name) for dtype, name in self._DTYPES.items()
        }

    def _encode(self, tensors: list[torch.Tensor]) -> list[Any]:
        coders = self._coders()
        return [
            # tobytes() copies: ZipNN's compress rewrites its input buffer in place.
            coders[t.dtype].compress(_host_bytes(t).tobytes())
            if t.dtype in coders and t.numel()
            else _host_bytes(t)
            for t in tensors
        ]

    def _decode(
        self, blobs: list[torch.Tensor], like: list[torch.Tensor], device: torch.device
    ) -> list[torch.Tensor]:
        coders = self._coders()
        out = []
        for blob, meta in zip(blobs, like, strict=True):
            if meta.dtype in coders and meta.numel():
                data = torch.frombuffer(
                    bytearray(coders[meta.dtype].decompress(blob.numpy())), dtype=torch.uint8
                )
            else:
                data = blob.clone()
            out.append(_from_raw(data, meta).to(device))
        return out


# -------------------------------------------------------------------------------------- nvCOMP


@dataclass(frozen=True)
class CodecThroughput:
    """Device-side codec speed on a whole state (uncompressed bytes per second), checked bit for bit."""

    name: str
    raw_bytes: int
    compressed_bytes: int
    encode_seconds: float
    decode_seconds: float
    mismatch: str | None  # path of the first tensor that did not round-trip, or None

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.compressed_bytes if self.compressed_bytes else float("inf")

    @property
    def encode_gbps(self) -> float:
        return self.raw_bytes / self.encode_seconds / 1e9

    @property
    def decode_gbps(self) -> float:
        return self.raw_bytes / self.decode_seconds / 1e9


def _cuda_timed(fn: Callable[[], T]) -> tuple[T, float]:
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    result = fn()
    end.record()
    end.synchronize()
    return result, start.elapsed_time(end) / 1e3


_NVCOMP_DATA_TYPES = {torch.float32: "<f4", torch.bfloat16: "<f2", torch.float16: "<f2"}


def _nvcomp() -> Any:
    """NVIDIA's ``nvidia.nvcomp`` module (call only where :meth:`_Nvcomp.available` holds)."""
    from nvidia import nvcomp

    return nvcomp


class _Nvcomp(_BlobBaseline):
    """nvCOMP's Python API on each tensor's raw bytes, default chunking and native bitstream."""

    algorithm: ClassVar[str]
    typed: ClassVar[bool] = False  # pass each tensor's element type as nvCOMP ``data_type``
    _pin_memory = True

    def available(self) -> tuple[bool, str]:
        if not torch.cuda.is_available():
            return False, "nvCOMP's baselines need a GPU: no CUDA device is visible"
        try:
            installed = importlib.util.find_spec("nvidia.nvcomp") is not None
        except (ImportError, ValueError):  # no ``nvidia`` namespace package at all
            installed = False
        return installed, "" if installed else "nvCOMP's Python module (nvidia-nvcomp-cu12/13) is not installed"

    def _codec(self, dtype: torch.dtype | None = None) -> Any:
        options: dict[str, Any] = {}
        if self.typed and dtype is not None:
            options["data_type"] = _NVCOMP_DATA_TYPES.get(dtype, "|u1")
        return _nvcomp().Codec(
            algorithm=self.algorithm, cuda_stream=torch.cuda.current_stream().cuda_stream, **options
        )

    def encode_on_device(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Compressed bytes of each CUDA tensor as a 1-D ``uint8`` CUDA tensor."""
        nvcomp = _nvcomp()
        stream = torch.cuda.current_stream().cuda_stream
        codecs: dict[torch.dtype | None, Any] = {}
        out = []
        for tensor in tensors:
            data = _raw(tensor)
            if data.numel() == 0:
                out.append(data)
                continue
            key = tensor.dtype if self.typed else None
            codec = codecs.get(key) or codecs.setdefault(key, self._codec(key))
            encoded = codec.encode(nvcomp.as_array(data, cuda_stream=stream))
            # The exported buffer has the worst-case size; the real size is buffer_size. nvCOMP
            # frees its buffer with the array object, so copy the bytes into torch's memory.
            out.append(from_dlpack(encoded).reshape(-1).view(torch.uint8)[: encoded.buffer_size].clone())
        return out

    def decode_on_device(self, blobs: list[torch.Tensor], like: list[torch.Tensor]) -> list[torch.Tensor]:
        """Inverse of :meth:`encode_on_device`; ``like`` gives each tensor's shape and dtype."""
        nvcomp = _nvcomp()
        stream = torch.cuda.current_stream().cuda_stream
        codecs: dict[torch.dtype | None, Any] = {}
        out = []
        for blob, meta in zip(blobs, like, strict=True):
            if blob.numel() == 0:
                out.append(_from_raw(blob, meta))
                continue
            key = meta.dtype if self.typed else None  # decode with the data_type it was encoded with
            codec = codecs.get(key) or codecs.setdefault(key, self._codec(key))
            decoded = codec.decode(nvcomp.as_array(blob, cuda_stream=stream))
            out.append(_from_raw(from_dlpack(decoded).reshape(-1).view(torch.uint8).clone(), meta))
        return out

    def _encode(self, tensors: list[torch.Tensor]) -> list[Any]:
        encoded = self.encode_on_device([t.detach().to("cuda") for t in tensors])
        host = torch.empty(sum(b.numel() for b in encoded), dtype=torch.uint8, pin_memory=True)
        parts = host.split([b.numel() for b in encoded])
        for part, blob in zip(parts, encoded, strict=True):
            part.copy_(blob, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        return [part.numpy() for part in parts]

    def _decode(
        self, blobs: list[torch.Tensor], like: list[torch.Tensor], device: torch.device
    ) -> list[torch.Tensor]:
        # One allocation per blob: nvCOMP reads compressed buffers at aligned addresses.
        on_device = [b.to("cuda", non_blocking=True) for b in blobs]
        return [t.to(device) for t in self.decode_on_device(on_device, like)]

    def throughput(self, state: Any) -> CodecThroughput:
        """Time encode and decode of every tensor of ``state`` on the GPU (CUDA events), verify bit-exactness."""
        self._require()
        named = [(path, t.detach().to("cuda")) for path, t in iter_tensors(state)]
        tensors = [t for _, t in named]
        warm = [t for t in tensors if t.numel()][:1]
        self.decode_on_device(self.encode_on_device(warm), warm)
        torch.cuda.synchronize()
        encoded, encode_seconds = _cuda_timed(lambda: self.encode_on_device(tensors))
        decoded, decode_seconds = _cuda_timed(lambda: self.decode_on_device(encoded, tensors))
        mismatch = next(
            (path for (path, a), b in zip(named, decoded, strict=True) if not torch.equal(_raw(a), _raw(b))),
            None,
        )
        return CodecThroughput(
            name=self.name,
            raw_bytes=tensor_nbytes(tensors),
            compressed_bytes=sum(b.numel() for b in encoded),
            encode_seconds=encode_seconds,
            decode_seconds=decode_seconds,
            mismatch=mismatch,
        )


class NvcompZstd(_Nvcomp):
    name = "nvcomp-zstd"
    summary = "nvCOMP zstd on each tensor's raw bytes (default 64 KiB chunks)"
    algorithm = "Zstd"


class NvcompAns(_Nvcomp):
    name = "nvcomp-ans"
    summary = "nvCOMP gANS on each tensor's raw bytes as uint8 (default 64 KiB chunks)"
    algorithm = "ANS"


class NvcompAnsTyped(_Nvcomp):
    name = "nvcomp-ans-typed"
    summary = "nvCOMP gANS on each tensor's raw bytes with data_type from its dtype (<f4, <f2, ...)"
    algorithm = "ANS"
    typed = True


BASELINES: tuple[type[Baseline], ...] = (
    TorchSave,
    Safetensors,
    Dcp,
    DcpZstd,
    CpuZstd,
    ZipNN,
    NvcompZstd,
    NvcompAns,
    NvcompAnsTyped,
)


def get_baseline(name: str) -> Baseline:
    """A fresh baseline by its ``name``; raises ``ValueError`` listing the known names."""
    for cls in BASELINES:
        if cls.name == name:
            return cls()
    raise ValueError(f"unknown baseline {name!r}; expected one of {', '.join(cls.name for cls in BASELINES)}")
