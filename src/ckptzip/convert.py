"""Conversions between .ckz and the formats users already have (torch.save, safetensors)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO

import torch

from . import api
from .errors import CkptzipError, UnsupportedObjectError
from .format.kinds import HEAD_BYTES, SAFETENSORS, Kind, directory_kind, foreign_kind
from .format.spec import MAGIC
from .plain import listing, type_name, weights_only_refusal
from .storage import atomic_file, open_for_read


def is_safetensors(path: str | os.PathLike[str]) -> bool:
    return Path(path).suffix == ".safetensors"


def read_foreign(path: str | os.PathLike[str], *, trust_pickle: bool = False) -> Any:
    """Load a torch.save file (``weights_only=True``: no code runs; with ``trust_pickle``,
    ``weights_only=False``, which runs the file's pickled code) or a .safetensors file (by its
    extension or its first bytes); any other kind of file is an error saying what it is."""
    if os.path.isdir(path):
        held = directory_kind(path)
        raise CkptzipError(f"{str(path)!r} is {held.what}, not a torch.save or .safetensors file: {held.advice}")
    with open_for_read(path) as f:  # a FIFO or device is refused, not read until it ends
        head = f.read(HEAD_BYTES)
        kind = SAFETENSORS if is_safetensors(path) else foreign_kind(head, os.fstat(f.fileno()).st_size)
        if kind is SAFETENSORS:
            return _read_safetensors(path)
        _check_torch_kind(path, head, kind)
        f.seek(0)
        return _torch_load(path, f, trust_pickle)


def _check_torch_kind(path: str | os.PathLike[str], head: bytes, kind: Kind | None) -> None:
    """Refuse, saying what it is, a file that torch.load cannot read (a .ckz, a NumPy file, ...)."""
    if head.startswith(MAGIC):
        raise CkptzipError(
            f"{str(path)!r} is a .ckz file already: `ckptzip inspect` shows it, `ckptzip convert SRC DST --codec "
            "portable` re-encodes it, `ckptzip decompress SRC DST.pt` makes a torch.save file of it")
    if kind is None:
        start = f"it starts with {head[:16]!r}" if head else "it is empty"
        raise CkptzipError(f"{str(path)!r} is neither a torch.save nor a .safetensors file ({start}); compress reads those")
    if not kind.readable:
        raise CkptzipError(f"{str(path)!r} is {kind.what}, not a torch.save or .safetensors file: {kind.advice}")


def _torch_load(path: str | os.PathLike[str], f: BinaryIO, trust_pickle: bool) -> Any:
    try:
        return torch.load(f, map_location="cpu", weights_only=not trust_pickle)
    except CkptzipError:
        raise
    except Exception as exc:  # torch raises several unrelated types for unreadable files
        reason = weights_only_refusal(exc)
        if trust_pickle:
            raise CkptzipError(f"could not read {str(path)!r} as a torch.save file ({reason})") from exc
        if "WeightsUnpickler error" in str(exc) and reason:
            raise UnsupportedObjectError(
                f"{str(path)!r} holds pickled objects that torch.load(weights_only=True) refuses ({reason}). "
                "ckptzip reads torch.save files with weights_only=True so that no code from the file runs; if "
                "you trust the file, pass --trust-pickle (trust_pickle=True), which runs its pickled code"
            ) from exc
        raise CkptzipError(
            f"could not read {str(path)!r} as a torch.save file with weights_only=True ({reason}). "
            "Only tensors and plain containers are accepted, so no code from the file runs."
        ) from exc


def _read_safetensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own SafetensorError, OSError, ...
        raise CkptzipError(f"could not read {str(path)!r} as a .safetensors file: {exc}") from exc


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors, each with memory of its own: safetensors cannot store tied tensors
    (one tensor under two names), so a second name gets a copy of the same values."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        t = t.contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def write_foreign(obj: Any, path: str | os.PathLike[str]) -> None:
    """Write ``obj`` as .safetensors (a flat dict of tensors; tied tensors become copies) or as a
    torch.save file, atomically."""
    if is_safetensors(path):
        from safetensors.torch import save

        _check_flat_tensors(obj)
        try:
            data = save(_unshared(obj))
        except Exception as exc:  # safetensors refuses some dtypes and names
            raise CkptzipError(f"could not write {str(path)!r} as a .safetensors file: {exc}") from exc
        with atomic_file(path) as f:
            f.write(data)
    else:
        with atomic_file(path) as f:
            torch.save(obj, f)


def _check_flat_tensors(obj: Any) -> None:
    """Refuse, naming the entries in the way, what safetensors cannot hold: anything but a flat
    dict of string names to tensors."""
    advice = ("Write a torch.save file instead (DST.pt), or save one dict of tensors of it with safetensors "
              "(safetensors.torch.save_file(ckptzip.load(SRC)['model'], ...), say)")
    if not isinstance(obj, dict):
        raise UnsupportedObjectError(
            f"safetensors holds a flat dict of name -> tensor; this checkpoint holds a {type_name(obj)}. {advice}")
    others = [f"{k!r}: {type_name(v)}" for k, v in obj.items() if not (isinstance(k, str) and isinstance(v, torch.Tensor))]
    if others:
        raise UnsupportedObjectError(
            f"safetensors holds a flat dict of name -> tensor; {len(others)} of the {len(obj)} entries of this "
            f"checkpoint are not a tensor under a string name: {listing(others)}. {advice}")


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, codec: str, progress: bool = False) -> None:
    """Re-encode a .ckz file with another codec; GPU-only codecs decode on a GPU when present."""
    location = "cuda" if torch.cuda.is_available() else "cpu"
    obj = api.load(src, map_location=location, progress=progress)
    api.save(obj, dst, codec=codec, progress=progress)
