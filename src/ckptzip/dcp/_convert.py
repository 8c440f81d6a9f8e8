"""Convert between a ckptzip DCP checkpoint directory and a single ``.ckz`` file.

The DCP side follows DCP's own ``dcp_to_torch_save`` / ``torch_save_to_dcp``: the whole state is
loaded in one process (no process group) with DCP's empty-state-dict planner, which rebuilds the
nested state dict from the checkpoint metadata.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any, BinaryIO

from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from .. import api
from ..errors import CheckpointNotFoundError, CkptzipError
from ._metadata import METADATA_FILE
from ._reader import CompressedStorageReader
from ._storage import CheckpointDir, is_url
from ._writer import CompressedStorageWriter


@contextlib.contextmanager
def _ckptzip_errors() -> Iterator[None]:
    """Re-raise the ckptzip error inside DCP's ``CheckpointException`` (single process: one rank)."""
    try:
        yield
    except CheckpointException as exc:
        for error, _trace in exc.failures.values():
            if isinstance(error, CkptzipError):
                raise error from exc
        raise


@contextlib.contextmanager
def _open_file(path: str | os.PathLike[str], mode: str) -> Iterator[BinaryIO | str | os.PathLike[str]]:
    """A local path as it is (ckptzip writes it atomically), a URL as an fsspec stream."""
    if not is_url(path):
        yield path
        return
    import fsspec

    with fsspec.open(os.fspath(path), mode) as stream:
        yield stream


def _load_full_state(dcp_dir: str | os.PathLike[str], *, trusted_objects: bool = False) -> dict[str, Any]:
    """The whole state of a ckptzip DCP checkpoint as one nested dict of CPU tensors."""
    state: dict[str, Any] = {}
    reader = CompressedStorageReader(dcp_dir, trusted_objects=trusted_objects)
    with _ckptzip_errors():
        _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state


def dcp_to_ckz(
    dcp_dir: str | os.PathLike[str], ckz_path: str | os.PathLike[str], *, codec: str = "auto",
    trusted_objects: bool = False,
) -> None:
    """Convert a checkpoint written by :class:`CompressedStorageWriter` to one ``.ckz`` file.

    Loads the whole state in this process (like DCP's ``dcp_to_torch_save``), so it needs memory
    for all of it. The result loads with ``ckptzip.load``.
    """
    state = _load_full_state(dcp_dir, trusted_objects=trusted_objects)
    with _open_file(ckz_path, "wb") as target:
        api.save(state, target, codec=codec)


def ckz_to_dcp(ckz_path: str | os.PathLike[str], dcp_dir: str | os.PathLike[str], *, codec: str = "auto") -> None:
    """Convert a ``.ckz`` checkpoint to a ckptzip DCP checkpoint directory (one rank's files),
    which ``dcp.load`` with :class:`CompressedStorageReader` reshards onto any number of ranks."""
    with _open_file(ckz_path, "rb") as source:
        state = api.load(source, map_location="cpu")
    if not isinstance(state, dict):
        raise CkptzipError(
            f"{os.fspath(ckz_path)!r} holds a {type(state).__name__}; a DCP checkpoint is made from a dict state"
        )
    with _ckptzip_errors():
        dcp_save(state, storage_writer=CompressedStorageWriter(dcp_dir, codec=codec), no_dist=True)


def is_dcp_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory holding a ckptzip DCP checkpoint."""
    return CheckpointDir(path).exists(METADATA_FILE)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``dcp-convert`` subcommand to the ``ckptzip`` command line."""
    parser = subparsers.add_parser(
        "dcp-convert",
        help="ckptzip DCP checkpoint directory <-> single .ckz file (direction from SRC)",
        description="Convert a DCP checkpoint written with ckptzip.dcp.CompressedStorageWriter to one "
        ".ckz file when SRC is such a directory, or a .ckz file to such a directory otherwise. "
        "Paths may be fsspec URLs.",
    )
    parser.add_argument("src", help="DCP checkpoint directory or .ckz file")
    parser.add_argument("dst", help=".ckz file or DCP checkpoint directory to create")
    parser.add_argument("--codec", default="auto", help="preset (auto, fast, portable) or codec id")
    parser.add_argument(
        "--trusted-objects", action="store_true",
        help="load non-tensor values that torch's weights_only unpickler refuses (only for trusted files)",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    """Run ``ckptzip dcp-convert``."""
    start = time.perf_counter()
    if is_dcp_checkpoint(args.src):
        dcp_to_ckz(args.src, args.dst, codec=args.codec, trusted_objects=args.trusted_objects)
        direction = "DCP directory -> .ckz"
    elif CheckpointDir(args.src).is_dir():
        raise CheckpointNotFoundError(
            f"{args.src!r} is a directory without ckptzip DCP metadata ({METADATA_FILE}); "
            "dcp-convert reads checkpoints written by ckptzip.dcp.CompressedStorageWriter"
        )
    else:
        ckz_to_dcp(args.src, args.dst, codec=args.codec)
        direction = ".ckz -> DCP directory"
    print(f"{args.src} -> {args.dst} ({direction}), {time.perf_counter() - start:.2f} s")
    return 0
