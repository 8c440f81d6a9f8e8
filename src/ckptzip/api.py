"""The public API: save / load / open / compress / decompress."""

from __future__ import annotations

import collections
import copy
import io
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, BinaryIO

import torch
from tqdm.auto import tqdm

from . import settings
from .memory.declared import check_declared, validate_max_bytes
from .engine import DeltaBase, LoadOptions, Policy, SaveOptions, read_tensors, warm_up, write_state
from .errors import CheckpointNotFoundError, CheckpointWriteError, CkptzipError, DeviceUnavailableError
from .format import BaseRef, ContainerReader, TensorEntry, content_hash
from .format.kinds import directory_kind
from .storage import atomic_file, open_for_read
from .tree import flatten, plain_values, unflatten

PathOrFile = str | os.PathLike[str] | BinaryIO
PathFileOrBytes = PathOrFile | bytes | bytearray | memoryview  # what a checkpoint is read from
CodecArg = str | Policy
MapLocation = None | str | torch.device | dict[str, Any]
BaseTensors = None | Sequence[Mapping[str, torch.Tensor]]  # per base checkpoint, its tensors by name


def _progress(total: int, enabled: bool, desc: str) -> tqdm[Any]:
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=not enabled, leave=False)


def write_checkpoint(f: BinaryIO, obj: Any, policy: Policy, *, progress: bool = False,
                     base: DeltaBase | None = None, gpu_memory: int | None = None) -> list[TensorEntry]:
    """Write ``obj`` to the binary file ``f``, tensors that pay stored as XOR deltas against
    ``base``; return the tensor table (what :func:`~ckptzip.format.content_hash` hashes)."""
    flat = flatten(obj)
    tensors = [item.tensor for item in flat.tensors]
    total = sum(t.numel() * t.element_size() for t in tensors)
    with _progress(total, progress, "compress") as bar:
        return write_state(f, [item.name for item in flat.tensors], tensors, flat.tree,
                           SaveOptions(policy, base, gpu_memory, on_progress=bar.update))


def save(obj: Any, f: PathOrFile, *, codec: CodecArg = "auto", progress: bool = False,
         gpu_memory: int | None = None) -> None:
    """Save ``obj`` (nested dict/list/tuple of tensors and plain values) to a path or binary file.

    A path is written atomically: to a temporary file, synced, then renamed. ``codec`` is a preset
    (``"auto"``, ``"fast"``, ``"portable"``, ``"huff"``) or a codec id applied to every tensor.
    ``progress`` shows a progress bar on stderr. ``gpu_memory`` caps the GPU memory the save uses
    beside the state, in bytes (default ``CKPTZIP_GPU_MEMORY_MB``, else what is free); it is given
    back when the save returns. Below 256 MiB it raises :class:`~ckptzip.errors.GpuMemoryError`.
    """
    policy = Policy.parse(codec)
    settings.gpu_memory(gpu_memory)  # a bad value (or CKPTZIP_GPU_MEMORY_MB) fails here, on any machine
    if isinstance(f, (str, os.PathLike)):
        with atomic_file(f) as fh:
            write_checkpoint(fh, obj, policy, progress=progress, gpu_memory=gpu_memory)
        return
    try:
        write_checkpoint(f, obj, policy, progress=progress, gpu_memory=gpu_memory)
    except OSError as exc:
        if isinstance(exc, CkptzipError):
            raise
        raise CheckpointWriteError(
            exc.errno, f"could not write the checkpoint to {f!r}: {exc.strerror or exc}; what was written is incomplete"
        ) from exc


def declared_needs(entries: Sequence[TensorEntry], indices: list[int], devices: list[torch.device]
                   ) -> dict[torch.device, int]:
    """Declared bytes that reading ``indices`` onto ``devices`` allocates, by device: each tensor
    once, with the entries a copy or cast is rebuilt from."""
    decoded: set[tuple[int, torch.device]] = set()
    for i, device in zip(indices, devices):
        while (i, device) not in decoded:
            decoded.add((i, device))
            if not entries[i].is_reference:
                break
            i = entries[i].source_target
    needs: dict[torch.device, int] = collections.defaultdict(int)
    for i, device in decoded:
        needs[device] += entries[i].nbytes
    return needs


def resolve_device(saved: str | None, map_location: MapLocation, argument: str = "map_location") -> torch.device:
    """Where a tensor saved from device ``saved`` goes, following torch.load's ``map_location``;
    errors name the caller's ``argument`` in their hint."""
    source = saved or "cpu"
    if isinstance(map_location, dict):
        target = map_location.get(source, source)
    elif map_location is None:
        target = source
    elif isinstance(map_location, (str, torch.device)):
        target = map_location
    else:
        raise TypeError(
            f"map_location must be None, a device string, a torch.device or a dict, got {type(map_location).__name__}"
        )
    device = torch.device(target)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(
                f"the checkpoint holds tensors saved on {source!r} but CUDA is not available here; "
                f"pass {argument}='cpu' to load them on the CPU"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceUnavailableError(
                f"tensor is to be placed on {device} but only {torch.cuda.device_count()} CUDA devices exist; "
                f"pass {argument}='cuda:0'" + (f" (or {{{source!r}: 'cuda:0'}})" if argument == "map_location" else "")
            )
    elif device.type not in ("cpu", "meta"):
        try:  # mps, xpu, xla, ...: probing is the one check that works for every backend
            torch.empty(0, device=device)
        except Exception as exc:  # torch raises a different type per backend
            raise DeviceUnavailableError(
                f"tensors are to be placed on {device}, which is not available here "
                f"({str(exc).splitlines()[0]:.120}); pass {argument}='cpu'"
            ) from exc
    return device


# Decoded bytes verify holds at once: four of a load's CPU batches, split between its workers.
VERIFY_BATCH_BYTES = 64 << 20


def verify_batches(entries: Sequence[TensorEntry], batch_bytes: int) -> list[list[int]]:
    """The table's entries in batches of about ``batch_bytes`` declared bytes, in table order:
    each stored tensor with the copies and casts made from it (so it is decoded once), and a
    group larger than ``batch_bytes`` alone."""
    groups: dict[int, list[int]] = {}
    for i in range(len(entries)):
        root = i
        while entries[root].is_reference:  # a copy of a cast at most: the index refuses longer chains
            root = entries[root].source_target
        groups.setdefault(root, []).append(i)
    batches: list[list[int]] = []
    size = 0
    for members in groups.values():
        nbytes = sum(entries[i].nbytes for i in members)
        if not batches or size + nbytes > batch_bytes:
            batches.append([])
            size = 0
        batches[-1].extend(members)
        size += nbytes
    return batches


def local_location(entries: Sequence[TensorEntry]) -> dict[str, str]:
    """A ``map_location`` that reads every tensor on this machine: on the device it was saved
    on where this machine has it, on another GPU where it has GPUs, else on the CPU (a GPU's
    file verified on a laptop)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    location = {}
    for saved in {entry.device or "cpu" for entry in entries}:
        device = torch.device(saved)
        if device.type == "cuda" and gpus:
            location[saved] = saved if (device.index or 0) < gpus else "cuda"
        else:
            location[saved] = "cpu"
    return location


class CheckpointReader:
    """Lazy access to a checkpoint: the index is read and validated up front, tensors on demand."""

    def __init__(self, f: PathFileOrBytes, *, map_location: MapLocation = None, max_bytes: int | None = None,
                 gpu_memory: int | None = None) -> None:
        self._owned: BinaryIO | None = None  # a file this reader opened, and closes
        settings.gpu_memory(gpu_memory)  # a bad value (or CKPTZIP_GPU_MEMORY_MB) fails here, on any machine
        self.gpu_memory = gpu_memory
        if isinstance(f, (str, os.PathLike)):
            if os.path.isdir(f):
                raise CheckpointNotFoundError(
                    f"no checkpoint file at {os.fspath(f)!r}: it is {directory_kind(f).describe()}")
            f = self._owned = open_for_read(f)  # refuses FIFOs and devices instead of blocking on them
        try:
            self._reader = ContainerReader(f)
        except BaseException:
            self.close()
            raise
        self.map_location = map_location
        self._by_name = {t.name: i for i, t in enumerate(self._reader.tensors)}
        self._values: dict[str, Any] | None = None  # the values that are not tensors, by path, once asked for
        try:
            self._max_bytes = validate_max_bytes(max_bytes)
            if self._max_bytes is not None:
                check_declared({torch.device("cpu"): self.nbytes}, self._max_bytes)
        except BaseException:
            self.close()
            raise

    def entries(self) -> list[TensorEntry]:
        """The tensor table: name, dtype, shape, sizes, codecs of every tensor."""
        return list(self._reader.tensors)

    def keys(self) -> list[str]:
        """Tensor names (dotted paths in the saved object)."""
        return list(self._by_name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name or name in self._plain_values()

    def __len__(self) -> int:
        return len(self._by_name)

    def __getitem__(self, name: str) -> Any:
        """The tensor named ``name``, decoded and verified (``ckpt["model.embed.weight"]``), or a
        value of the saved object that is not a tensor, by its dotted path (``ckpt["step"]``,
        ``ckpt["optimizer.param_groups.0.lr"]``), read from the index without decoding anything."""
        index = self._by_name.get(name)
        if index is not None:
            return self._tensor(index)
        values = self._plain_values()
        if name in values:
            return copy.deepcopy(values[name])  # the caller's to change
        inside = next((k for k in (*self._by_name, *values) if k.startswith(f"{name}.")), None)
        if inside is not None:
            raise KeyError(
                f"{name!r} is a container in this checkpoint: ckpt[...] gives its tensors and values by their dotted "
                f"paths ({inside!r}, ...), and load() the whole object")
        raise KeyError(f"no tensor or value named {name!r} in this checkpoint; keys() lists its {len(self)} tensors")

    def _plain_values(self) -> dict[str, Any]:
        if self._values is None:
            self._values = plain_values(self._reader.index.tree, len(self._reader.tensors))
        return self._values

    def _tensor(self, index: int) -> torch.Tensor:
        return self._read([index], lambda _: None)[0]

    def _all_tensors(self, progress: bool, base_tensors: BaseTensors) -> list[torch.Tensor]:
        with _progress(self.nbytes, progress, "decompress") as bar:
            return self._read(list(range(len(self._reader.tensors))), bar.update, base_tensors)

    def _read(self, indices: list[int], on_progress: Callable[[int], object], base_tensors: BaseTensors = None
              ) -> list[torch.Tensor]:
        """Tensors ``indices`` on their target devices, XOR deltas against ``base_tensors``, their
        declared bytes checked first against what the targets have available (a ``max_bytes``
        given was checked against the whole file when it was opened)."""
        devices = [resolve_device(self._reader.tensors[i].device, self.map_location) for i in indices]
        if self._max_bytes is None:
            check_declared(declared_needs(self._reader.tensors, indices, devices), None)
        return read_tensors(self._reader, indices, devices, LoadOptions(base_tensors, self.gpu_memory, on_progress))

    def load(self, *, progress: bool = False, base_tensors: BaseTensors = None) -> Any:
        """The whole saved object, every tensor decoded and verified (read in file order); tensors
        stored as XOR deltas are rebuilt from ``base_tensors`` (see :attr:`bases`)."""
        tensors = self._all_tensors(progress, base_tensors)
        return unflatten(self._reader.index.tree, tensors.__getitem__, len(tensors))

    def named_tensors(self, *, base_tensors: BaseTensors = None) -> dict[str, torch.Tensor]:
        """Every tensor, decoded and verified, by name (XOR deltas: as for :meth:`load`)."""
        return dict(zip(self.keys(), self._all_tensors(False, base_tensors)))

    def verify(self, *, batch_bytes: int = VERIFY_BATCH_BYTES) -> None:
        """Decode every tensor and check every checksum, keeping nothing: tensors are decoded in
        batches of about ``batch_bytes`` decoded bytes (a larger tensor alone, with the copies
        and casts made from it), each dropped before the next is decoded, so memory stays about a
        batch (or the largest tensor) whatever the size of the state. Damage raises
        :class:`~ckptzip.errors.CorruptCheckpointError` naming the tensor; tensors stored as XOR
        deltas need their base (:class:`~ckptzip.errors.MissingBaseError`, as for :meth:`load`)."""
        for batch in verify_batches(self._reader.tensors, batch_bytes):
            self._read(batch, lambda _: None)  # the batch's tensors are dropped here

    @property
    def bases(self) -> list[BaseRef]:
        """The checkpoints this one stores XOR deltas against (format 2.1): :meth:`load` and
        :meth:`named_tensors` take their tensors as ``base_tensors``, by name, one mapping per
        base, and need them where tensors are stored as deltas."""
        return list(self._reader.index.bases)

    @property
    def content_hash(self) -> str:
        """The hash a checkpoint stored relative to this one records for it (FORMAT.md, 2.1)."""
        return content_hash(self._reader.tensors)

    @property
    def nbytes(self) -> int:
        """Total decoded size of all tensors."""
        return sum(t.nbytes for t in self._reader.tensors)

    @property
    def compressed_nbytes(self) -> int:
        """Total stored size of all tensor chunks."""
        return sum(t.compressed_nbytes for t in self._reader.tensors)

    @property
    def file_size(self) -> int:
        return self._reader.file_size

    @property
    def ratio(self) -> float:
        """Decoded tensor bytes over stored tensor bytes."""
        return self.nbytes / self.compressed_nbytes if self.compressed_nbytes else 1.0

    def close(self) -> None:
        if hasattr(self, "_reader"):
            self._reader.ranges.close()
        if self._owned is not None:
            self._owned.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open(path: PathFileOrBytes, *, map_location: MapLocation = None, max_bytes: int | None = None,
         gpu_memory: int | None = None) -> CheckpointReader:
    """Open a checkpoint (a path, a binary file, or its bytes) for lazy, per-tensor reads:
    ``ckptzip.open(p)["model.w"]``. ``max_bytes``, ``gpu_memory``: as for :func:`load`."""
    return CheckpointReader(path, map_location=map_location, max_bytes=max_bytes, gpu_memory=gpu_memory)


def load(f: PathFileOrBytes, *, map_location: MapLocation = None, progress: bool = False,
         max_bytes: int | None = None, gpu_memory: int | None = None) -> Any:
    """Load what :func:`save` saved from a path, a binary file, or the bytes of one (read in
    place, without a copy); every tensor is verified bit-exact against its checksum.

    ``max_bytes`` (an int >= 0) bounds the decoded size an untrusted file may declare (a few bytes
    of zstd can declare gigabytes of zeros); without it the bound is what the target can hold
    (free host memory for the CPU, the device's free memory for a GPU). A file declaring more is
    refused with :class:`~ckptzip.errors.DecodeBudgetError` before any tensor memory is
    allocated. Decoding needs about the decoded size, plus a few batches (on a GPU, what its
    budget allows, at most 512 MiB each; 16 MiB per worker on the CPU). ``gpu_memory`` caps the
    GPU memory decoding uses beside the tensors it returns (as for :func:`save`).
    """
    with CheckpointReader(f, map_location=map_location, max_bytes=max_bytes, gpu_memory=gpu_memory) as reader:
        return reader.load(progress=progress)


class CompressedTensor:
    """One compressed tensor: a complete one-tensor .ckz container in memory."""

    def __init__(self, data: bytes) -> None:
        self._data = bytes(data)
        reader = ContainerReader(self._data)
        if len(reader.tensors) != 1 or reader.index.tree != {"tensor": 0}:
            raise CkptzipError(
                f"buffer holds a checkpoint of {len(reader.tensors)} tensors, expected exactly one compressed "
                "tensor (use ckptzip.load for checkpoints)"
            )
        self._entry = reader.tensors[0]

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> CompressedTensor:
        """Rebuild from :meth:`to_bytes` output; validates structure (checksums at decompress)."""
        return cls(bytes(data))

    def to_bytes(self) -> bytes:
        return self._data

    @property
    def dtype(self) -> torch.dtype:
        from .format import DTYPES

        return DTYPES[self._entry.dtype]

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._entry.shape)

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data."""
        return self._entry.nbytes

    @property
    def compressed_nbytes(self) -> int:
        """Size of the whole compressed object (container overhead included)."""
        return len(self._data)

    @property
    def ratio(self) -> float:
        return self.nbytes / self.compressed_nbytes

    @property
    def entry(self) -> TensorEntry:
        """The tensor's table entry (codecs, chunks)."""
        return self._entry

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return (
            f"CompressedTensor(dtype={self.dtype}, shape={tuple(self.shape)}, nbytes={self.nbytes}, "
            f"compressed_nbytes={self.compressed_nbytes}, ratio={self.ratio:.3f})"
        )


def warmup(device: str | torch.device | None = None, *, codec: CodecArg = "auto", wait: bool = False) -> None:
    """Compile the GPU kernels and create the codecs that saving and loading with ``codec`` use
    on ``device`` (default: the current CUDA device), on a background thread, so that the first
    save or load of a fresh process (an empty kernel cache) costs what later ones cost. Call it
    when a job starts; :class:`CheckpointManager` and the DCP plugin call it themselves. ``wait``
    blocks until it is done. Without CUDA it does nothing."""
    warm_up(None if device is None else torch.device(device), Policy.parse(codec), wait=wait)


def compress(tensor: torch.Tensor, *, codec: CodecArg = "auto") -> CompressedTensor:
    """Compress one tensor (CUDA tensors on their GPU when nvCOMP is installed)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"compress() takes a torch.Tensor, got {type(tensor).__name__}")
    policy = Policy.parse(codec)
    buf = io.BytesIO()
    write_state(buf, ["tensor"], [flatten(tensor).tensors[0].tensor], {"tensor": 0}, SaveOptions(policy))
    return CompressedTensor(buf.getvalue())


def decompress(ct: CompressedTensor | bytes, *, device: str | torch.device | None = None) -> torch.Tensor:
    """Decode a :class:`CompressedTensor` (or its bytes) onto ``device`` (default: where it was saved)."""
    if not isinstance(ct, CompressedTensor):
        ct = CompressedTensor.from_bytes(ct)
    reader = ContainerReader(ct.to_bytes())
    try:
        target = [resolve_device(reader.tensors[0].device, device, "device")]
        check_declared(declared_needs(reader.tensors, [0], target), None)
        return read_tensors(reader, [0], target)[0]
    finally:
        reader.ranges.close()
