"""``ckptzip dcp-convert``: the command-line side of :mod:`ckptzip.dcp`.

Importing this module is cheap (no torch): the rest of ckptzip is imported when the command runs.
"""

from __future__ import annotations

import argparse
import time

from ..errors import CheckpointNotFoundError


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``dcp-convert`` subcommand's arguments to its parser; :func:`run` takes the namespace."""
    parser.description = (
        "Convert a DCP checkpoint directory (written by ckptzip.dcp.CompressedStorageWriter, or "
        "with --trusted-objects by DCP's FileSystemWriter) to one .ckz file when SRC is such a directory, or a "
        ".ckz file to a ckptzip DCP directory otherwise. Paths may be fsspec URLs."
    )
    parser.add_argument("src", help="DCP checkpoint directory or .ckz file")
    parser.add_argument("dst", help=".ckz file or DCP checkpoint directory to create")
    parser.add_argument("--codec", default="auto", help="preset (auto, fast, portable) or codec id")
    parser.add_argument("--force", action="store_true", help="replace DST if it exists")
    parser.add_argument(
        "--trusted-objects", action="store_true",
        help="load non-tensor values that torch's weights_only unpickler refuses, and plain DCP checkpoints "
        "(pickled metadata); only for trusted files",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``ckptzip dcp-convert``."""
    from . import check_destination, emit
    from ..storage import local_path, open_directory
    from ..dcp._convert import ckz_to_dcp, dcp_to_ckz, is_dcp_checkpoint, is_plain_dcp_checkpoint
    from ..dcp._metadata import METADATA_FILE

    check_destination(local_path(args.src), local_path(args.dst), force=args.force, exists=_exists)
    start = time.perf_counter()
    if is_dcp_checkpoint(args.src) or is_plain_dcp_checkpoint(args.src):
        dcp_to_ckz(args.src, args.dst, codec=args.codec, trusted_objects=args.trusted_objects)
        direction = "DCP directory -> .ckz"
    elif open_directory(args.src).is_dir():
        raise CheckpointNotFoundError(
            f"{args.src!r} is a directory without ckptzip DCP metadata ({METADATA_FILE}) or DCP's own (.metadata); "
            "dcp-convert reads checkpoints written by ckptzip.dcp.CompressedStorageWriter or DCP's FileSystemWriter"
        )
    else:
        ckz_to_dcp(args.src, args.dst, codec=args.codec)
        direction = ".ckz -> DCP directory"
    emit(f"{args.src} -> {args.dst} ({direction}), {time.perf_counter() - start:.2f} s")
    return 0


def _exists(path: str) -> bool:
    """Whether a file or directory is at ``path`` (a local path or an fsspec URL)."""
    from ..storage import open_directory

    return open_directory(path).present()

