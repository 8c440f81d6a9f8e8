"""Codec registry: codec id + backend -> implementation class."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ..errors import CodecUnavailableError, CorruptCheckpointError, UnsupportedFormatError
from .base import Codec

_REGISTRY: dict[tuple[str, str], type[Codec]] = {}
# Codec ids that exist but whose implementation could not be loaded here, with the reason.
_UNAVAILABLE: dict[tuple[str, str], str] = {}
# Codec ids declared before their implementation is loaded: the loader registers them (or marks
# them unavailable) the first time one is asked for on that backend.
_PENDING: dict[tuple[str, str], Callable[[], object]] = {}
# Codec ids whose CPU implementation is a fallback far slower than nvCOMP's: where a GPU runs
# them, a load decodes them there whatever the target device.
_GPU_FIRST: set[str] = set()
# The id sets derived from the two tables (asked per tensor when saving and loading), by the
# tables' identities and sizes: rebuilt when either changes (or is replaced, as tests do).
_IDS: dict[tuple[int, ...], tuple[frozenset[str], frozenset[str]]] = {}


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make ``cls`` the implementation of its id on its backend."""
    _REGISTRY[(cls.codec_id, cls.backend)] = cls
    _IDS.clear()  # the size alone misses a pop followed by a register
    return cls


def mark_unavailable(codec_id: str, backend: str, reason: str) -> None:
    """Record why an implementation of ``codec_id`` on ``backend`` cannot load here."""
    _UNAVAILABLE.setdefault((codec_id, backend), reason)


def declare(codec_ids: Iterable[str], backend: str, load: Callable[[], object], gpu_first: bool = False) -> None:
    """Make ``codec_ids`` known on ``backend`` without loading them: ``load()`` (idempotent)
    registers or marks them unavailable when one is first asked for there (GPU libraries are
    imported only by a GPU path). ``gpu_first``: these CPU implementations are fallbacks
    (:func:`gpu_first_ids`)."""
    for codec_id in codec_ids:
        _PENDING[(codec_id, backend)] = load
        if gpu_first:
            _GPU_FIRST.add(codec_id)
    _IDS.clear()


def _resolve(codec_id: str, backend: str) -> None:
    load = _PENDING.get((codec_id, backend))
    if load is not None:
        load()
        for key in [key for key, pending in _PENDING.items() if pending is load]:
            _PENDING.pop(key, None)
        _IDS.clear()


def _ids() -> tuple[frozenset[str], frozenset[str]]:
    """(every codec id, the GPU-only ones)."""
    key = (id(_REGISTRY), len(_REGISTRY), id(_UNAVAILABLE), len(_UNAVAILABLE), id(_PENDING), len(_PENDING))
    ids = _IDS.get(key)
    if ids is None:
        known = [*_REGISTRY, *_UNAVAILABLE, *_PENDING]
        every = frozenset(cid for cid, _ in known)
        ids = _IDS[key] = every, every - {cid for cid, backend in known if backend == "cpu"}
    return ids


def codec_ids() -> frozenset[str]:
    """Every codec id this ckptzip knows, whether or not it can run here (derived from the classes)."""
    return _ids()[0]


def gpu_only_ids() -> frozenset[str]:
    """Codec ids with no CPU implementation at all (NVIDIA formats only nvCOMP decodes)."""
    return _ids()[1]


def gpu_first_ids() -> frozenset[str]:
    """Codec ids best decoded on a GPU where one runs them: the GPU-only ones, and those whose CPU
    decoder is a slow fallback (``gdeflate``)."""
    return gpu_only_ids() | _GPU_FIRST


def has_codec(codec_id: str, backend: str) -> bool:
    """Whether ``codec_id`` can run on ``backend`` in this process."""
    _resolve(codec_id, backend)
    return (codec_id, backend) in _REGISTRY


def get_codec(config: dict[str, Any] | str, backend: str) -> Codec:
    """Return the implementation of a codec config on ``backend`` ("cpu" or "cuda").

    Raises ``UnsupportedFormatError`` for an unknown id, ``CodecUnavailableError`` when the id
    is known but cannot run on this backend here, and ``CorruptCheckpointError`` for options the
    codec rejects.
    """
    if isinstance(config, str):
        config = {"id": config}
    codec_id = config.get("id")
    if codec_id not in codec_ids():
        raise UnsupportedFormatError(
            f"unknown codec id {codec_id!r}; this ckptzip knows {sorted(codec_ids())}. "
            "Upgrade ckptzip to read this file."
        )
    _resolve(codec_id, backend)
    cls = _REGISTRY.get((codec_id, backend))
    if cls is None:
        raise CodecUnavailableError(_unavailable_message(codec_id, backend))
    try:
        return cls.from_config(config)
    except (TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"codec configuration {config!r:.200} is invalid: {exc}") from exc


def _unavailable_message(codec_id: str, backend: str) -> str:
    reason = _UNAVAILABLE.get((codec_id, backend))
    if backend == "cpu" and codec_id in gpu_only_ids():
        return (
            f"codec {codec_id!r} is GPU-only (NVIDIA nvCOMP) and has no CPU decoder. "
            "Load this checkpoint on a machine with a CUDA GPU and `pip install ckptzip[gpu]`, "
            "or convert it there once for CPU use: `ckptzip convert SRC DST --codec portable`."
        )
    if backend == "cuda":
        why = reason or "nvCOMP is not installed (pip install ckptzip[gpu]) or no CUDA device is visible"
        return f"codec {codec_id!r} cannot run on the GPU here: {why}."
    why = reason or "its optional package is not installed"
    return f"codec {codec_id!r} cannot run on the CPU here: {why}."
