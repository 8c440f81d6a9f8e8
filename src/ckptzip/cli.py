"""The ``ckptzip`` command line: compress, decompress, convert, inspect, demo, bench, cost."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from . import __version__, api
from .convert import convert, read_foreign, write_foreign
from .errors import CkptzipError
from .planner import PRESETS
from .report import class_table, human_bytes, tensor_table


def _codec_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--codec", default="auto",
        help=f"preset ({', '.join(PRESETS)}) or codec id (zstd, deflate, lz4, raw, ans, bitcomp, gdeflate, cascaded)",
    )


def _summary(src: Path, dst: Path, seconds: float) -> None:
    a, b = src.stat().st_size, dst.stat().st_size
    print(f"{src} ({human_bytes(a)}) -> {dst} ({human_bytes(b)}), {a / max(b, 1):.3f}x, {seconds:.2f} s")


def _cmd_compress(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    obj = read_foreign(args.src)
    api.save(obj, args.dst, codec=args.codec, progress=True)
    _summary(Path(args.src), Path(args.dst), time.perf_counter() - start)
    return 0


def _cmd_decompress(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    obj = api.load(args.src, map_location="cpu", progress=True)
    write_foreign(obj, args.dst)
    _summary(Path(args.src), Path(args.dst), time.perf_counter() - start)
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    convert(args.src, args.dst, codec=args.codec, progress=True)
    _summary(Path(args.src), Path(args.dst), time.perf_counter() - start)
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    with api.open(args.path) as reader:
        entries = reader.entries()
        print(tensor_table(entries, limit=args.top))
        print()
        print(class_table(entries))
        print(f"\nfile {human_bytes(reader.file_size)}; tensors {human_bytes(reader.nbytes)} -> "
              f"{human_bytes(reader.compressed_nbytes)} ({reader.ratio:.3f}x)")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(preset=args.preset, steps=args.steps, device=args.device)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptzip", description=__doc__)
    parser.add_argument("--version", action="version", version=f"ckptzip {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("compress", help="torch.save or .safetensors file -> .ckz")
    p.add_argument("src")
    p.add_argument("dst")
    _codec_arg(p)
    p.set_defaults(func=_cmd_compress)

    p = sub.add_parser("decompress", help=".ckz -> torch.save file, or .safetensors by DST's extension")
    p.add_argument("src")
    p.add_argument("dst")
    p.set_defaults(func=_cmd_decompress)

    p = sub.add_parser("convert", help="re-encode a .ckz file with another codec (e.g. --codec portable)")
    p.add_argument("src")
    p.add_argument("dst")
    _codec_arg(p)
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("inspect", help="per-tensor ratio table and totals by tensor class")
    p.add_argument("path")
    p.add_argument("--top", type=int, default=None, help="show only the N largest tensors")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("demo", help="train a small model, checkpoint it, restore it bit-exactly")
    p.add_argument("--preset", default="tiny", help="model size preset (tiny, tiny-moe, small, medium, ...)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.set_defaults(func=_cmd_demo)

    for module in _plugin_modules():
        module.add_parser(sub).set_defaults(func=module.run)
    return parser


def _plugin_modules() -> list:
    """Subcommands that live with their subsystem: each has ``add_parser(sub)`` and ``run(args)``."""
    from . import cost, dcp

    return [cost, dcp]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CkptzipError as exc:
        print(f"ckptzip: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
