"""The ``ckptzip`` command line: compress, decompress, convert, inspect, demo, bench, cost."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TextIO

from . import api
from ._version import __version__
from .convert import convert, read_foreign, write_foreign
from .errors import CkptzipError
from .codecs import codec_ids
from .engine.policy import PRESETS
from .report import class_table, human_bytes, portability_note, sources_note, tensor_table


def emit(text: str, stream: TextIO | None = None) -> None:
    """Print ``text``; characters the stream cannot encode (a lone surrogate in a tensor name, or
    any non-ASCII under LANG=C) are written as backslash escapes instead of raising."""
    stream = stream or sys.stdout
    encoding = getattr(stream, "encoding", None) or "utf-8"
    print(text.encode(encoding, "backslashreplace").decode(encoding), file=stream)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def force_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--force", action="store_true", help="replace DST if it exists")


def check_destination(src: str, dst: str, *, force: bool, exists: Callable[[str], bool] = os.path.lexists) -> None:
    """Refuse DST when it is SRC (however spelled) or, without ``force``, when it exists."""
    if os.path.realpath(src) == os.path.realpath(dst) or (
        os.path.exists(src) and os.path.exists(dst) and os.path.samefile(src, dst)
    ):
        raise CkptzipError(f"{dst!r} is the source {src!r}; write to another path")
    if not force and exists(dst):
        raise CkptzipError(f"{dst!r} exists; pass --force to replace it")


def _codec_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--codec", default="auto",
        help=f"preset ({', '.join(PRESETS)}) or codec id ({', '.join(sorted(codec_ids()))})",
    )


def _compress(args: argparse.Namespace) -> None:
    api.save(read_foreign(args.src), args.dst, codec=args.codec, progress=True)


def _decompress(args: argparse.Namespace) -> None:
    write_foreign(api.load(args.src, map_location="cpu", progress=True), args.dst)


def _convert(args: argparse.Namespace) -> None:
    convert(args.src, args.dst, codec=args.codec, progress=True)


def _add_file_command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help_text: str,
    action: Callable[[argparse.Namespace], None], *, codec: bool,
) -> None:
    """Add ``NAME SRC DST [--codec]``: run ``action``, then print both sizes, the ratio and the time."""
    p = sub.add_parser(name, help=help_text)
    p.add_argument("src")
    p.add_argument("dst")
    force_arg(p)
    if codec:
        _codec_arg(p)

    def run(args: argparse.Namespace) -> int:
        check_destination(args.src, args.dst, force=args.force)
        start = time.perf_counter()
        action(args)
        seconds = time.perf_counter() - start
        src, dst = Path(args.src), Path(args.dst)
        a, b = src.stat().st_size, dst.stat().st_size
        emit(f"{src} ({human_bytes(a)}) -> {dst} ({human_bytes(b)}), {a / max(b, 1):.3f}x, {seconds:.2f} s")
        return 0

    p.set_defaults(func=run)


def _cmd_inspect(args: argparse.Namespace) -> int:
    with api.open(args.path) as reader:
        entries = reader.entries()
        emit(tensor_table(entries, limit=args.top))
        emit("")
        emit(class_table(entries))
        emit(f"\nfile {human_bytes(reader.file_size)}; tensors {human_bytes(reader.nbytes)} -> "
             f"{human_bytes(reader.compressed_nbytes)} ({reader.ratio:.3f}x)")
        emit(sources_note(entries, reader.bases))
        emit(portability_note(entries))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .bench.demo import run_demo

    return run_demo(preset=args.preset, steps=args.steps, device=args.device)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptzip", description=__doc__)
    parser.add_argument("--version", action="version", version=f"ckptzip {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_file_command(sub, "compress", "torch.save or .safetensors file -> .ckz", _compress, codec=True)
    _add_file_command(
        sub, "decompress", ".ckz -> torch.save file, or .safetensors by DST's extension", _decompress, codec=False
    )
    _add_file_command(
        sub, "convert", "re-encode a .ckz file with another codec (e.g. --codec portable)", _convert, codec=True
    )

    p = sub.add_parser("inspect", help="per-tensor ratio table and totals by tensor class")
    p.add_argument("path")
    p.add_argument("--top", type=positive_int, default=None, help="show only the N largest tensors (N >= 1)")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("demo", help="train a small model, checkpoint it, restore it bit-exactly")
    p.add_argument("--preset", default="tiny", help="model size preset (tiny, tiny-moe, small, medium, ...)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.set_defaults(func=_cmd_demo)

    for module in _plugin_modules():
        module.add_parser(sub).set_defaults(func=module.run)
    return parser


def _plugin_modules() -> list[ModuleType]:
    """Subcommands that live with their subsystem: each has ``add_parser(sub)`` and ``run(args)``."""
    from . import cost, dcp
    from .bench import run as bench

    return [cost, dcp, bench]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CkptzipError as exc:
        emit(f"ckptzip: error: {exc}", sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
