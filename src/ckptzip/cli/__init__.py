"""The ckptzip command line (``ckptzip --help`` lists its commands); :mod:`.dcp` is ``dcp-convert``.

Building the parser imports nothing heavy: each command's arguments are added when that command
is chosen, and its handler imports torch and the rest of ckptzip, so ``ckptzip --help`` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from .._version import __version__
from ..errors import CkptzipError, UsageError

if TYPE_CHECKING:
    from ..api import CheckpointReader
    from ..format import TensorEntry

    _SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]
else:
    _SubParsers = argparse._SubParsersAction  # not subscriptable at run time

Configure = Callable[[argparse.ArgumentParser], None]


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
    from ..codecs import codec_ids
    from ..engine.policy import PRESETS

    parser.add_argument(
        "--codec", default="auto",
        help=f"preset ({', '.join(PRESETS)}) or codec id ({', '.join(sorted(codec_ids()))})",
    )


def _progress(args: argparse.Namespace) -> bool:
    """Progress bars go to stderr only when it is a terminal (not into logs), and not with --quiet."""
    return not args.quiet and sys.stderr.isatty()


def _entries(lines: list[str]) -> str:
    return f"{len(lines)} entr{'y' if len(lines) == 1 else 'ies'}"


def _report(head: str, lines: list[str]) -> None:
    """Say on stderr what was done to which entries of a state, one path a line."""
    if lines:
        emit(f"ckptzip: {head}:\n" + "\n".join(f"  {line}" for line in lines), sys.stderr)


def _compress_options(p: argparse.ArgumentParser) -> None:
    _codec_arg(p)
    p.add_argument(
        "--trust-pickle", action="store_true",
        help="load SRC with torch.load(weights_only=False), which RUNS ANY CODE PICKLED IN THE FILE: only for "
        "files you trust (Lightning and HF checkpoints holding argparse.Namespace, paths, scheduler objects). "
        "Objects ckptzip cannot store are converted where they have a plain form (Namespace, dict subclass and "
        "namedtuple -> dict, path -> str), each reported on stderr",
    )
    p.add_argument(
        "--skip-unsupported", action="store_true",
        help="leave out the objects ckptzip cannot store (a dict entry is dropped, a list or tuple item becomes "
        "None), each reported by its path; without it they are an error",
    )


def _compress(args: argparse.Namespace) -> None:
    from .. import api
    from ..convert import read_foreign
    from ..plain import storable

    if args.trust_pickle:
        emit(f"ckptzip: warning: --trust-pickle loads {args.src} with torch.load(weights_only=False), which runs "
             "any code pickled in the file; use it only for files you trust", sys.stderr)
    plain = storable(read_foreign(args.src, trust_pickle=args.trust_pickle), skip_unsupported=args.skip_unsupported)
    _report(f"note: converted {_entries(plain.converted)} to values ckptzip stores", plain.converted)
    _report(f"note: left out {_entries(plain.unsupported)} that ckptzip cannot store (--skip-unsupported)",
            plain.unsupported)
    api.save(plain.state, args.dst, codec=args.codec, progress=_progress(args))


def _decompress(args: argparse.Namespace) -> None:
    from .. import api
    from ..convert import is_safetensors, write_foreign
    from ..plain import weights_only_loadable

    state = api.load(args.src, map_location="cpu", progress=_progress(args))
    if not is_safetensors(args.dst):
        plain = weights_only_loadable(state)
        _report(f"note: wrote {_entries(plain.converted)} holding NumPy values as tensors of the same dtype and "
                "bits, so that torch.load(weights_only=True) reads the file", plain.converted)
        _report(f"warning: torch.load(weights_only=True) will refuse {args.dst} for {_entries(plain.unsupported)} "
                "(NumPy values torch cannot hold); load it with weights_only=False, or keep the .ckz",
                plain.unsupported)
        state = plain.state
    write_foreign(state, args.dst)


def _convert(args: argparse.Namespace) -> None:
    from ..convert import convert

    convert(args.src, args.dst, codec=args.codec, progress=_progress(args))


def size_change(src: Path, a: int, dst: Path, b: int) -> str:
    """``model.ckz is 1.227x smaller than model.pt``: the ratio of two file sizes, said in words."""
    if b <= a:
        return f"{dst.name} is {a / max(b, 1):.3f}x smaller than {src.name}"
    return f"{dst.name} is {b / max(a, 1):.3f}x larger than {src.name}"


def quiet_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no summary line")


class _Commands(_SubParsers):
    """Subcommands whose arguments are added (by a ``configure`` function) only when one is
    chosen, so the top-level parser and its help import none of what the commands need."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: dict[str, Configure] = {}

    def add_command(self, name: str, help_text: str, configure: Configure) -> None:
        self.add_parser(name, help=help_text, description=help_text)
        self._pending[name] = configure

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        assert values is not None and not isinstance(values, str)  # nargs=PARSER: [name, *arguments]
        configure = self._pending.pop(values[0], None)
        if configure is not None:
            configure(self.choices[values[0]])
        super().__call__(parser, namespace, values, option_string)


def _add_file_command(
    sub: _Commands, name: str, help_text: str, action: Callable[[argparse.Namespace], None],
    options: Configure | None = None,
) -> None:
    """Add ``NAME SRC DST [options]``: run ``action``, then print both sizes, the ratio and the time."""
    source, target = help_text.split(" -> ", 1) if " -> " in help_text else (".ckz file", ".ckz file to write")

    def configure(p: argparse.ArgumentParser) -> None:
        p.add_argument("src", help=f"input: {source}")
        p.add_argument("dst", help=f"output: {target}")
        force_arg(p)
        quiet_arg(p)
        if options is not None:
            options(p)
        p.set_defaults(func=run)

    def run(args: argparse.Namespace) -> int:
        from ..report import human_bytes

        check_destination(args.src, args.dst, force=args.force)
        start = time.perf_counter()
        action(args)
        seconds = time.perf_counter() - start
        src, dst = Path(args.src), Path(args.dst)
        a, b = src.stat().st_size, dst.stat().st_size
        if not args.quiet:
            emit(f"{src} ({human_bytes(a)}) -> {dst} ({human_bytes(b)}): {size_change(src, a, dst, b)}, {seconds:.2f} s")
        return 0

    sub.add_command(name, help_text, configure)


def _refuse_directory(path: str, command: str) -> None:
    """A directory is not a .ckz file: say how to get one from a DCP checkpoint."""
    if os.path.isdir(path):
        raise CkptzipError(
            f"{path!r} is a directory; {command} reads one .ckz file. For a DCP checkpoint directory, "
            f"`ckptzip dcp-convert {path} FILE.ckz` makes one (or give one rank's data file, {path}/__0.ckzd)"
        )


def _entry_json(entry: TensorEntry, entries: list[TensorEntry]) -> dict[str, object]:
    from ..report import classify, entry_ratio, pipeline_label

    return {
        "name": entry.name, "dtype": entry.dtype, "shape": list(entry.shape), "bytes": entry.nbytes,
        "compressed": entry.compressed_nbytes, "ratio": entry_ratio(entry), "codec": pipeline_label(entry, entries),
        "class": classify(entry),
    }


def _inspect_json(reader: CheckpointReader, top: int | None) -> dict[str, object]:
    """Everything ``inspect`` prints, as JSON: sizes, class totals, references and the bases they
    need, portability, and the tensor table (the ``top`` largest)."""
    from ..report import class_totals, portability, source_totals

    entries = reader.entries()
    shown = entries if top is None else sorted(entries, key=lambda e: -e.nbytes)[:top]
    where = portability(entries)
    return {
        "file_bytes": reader.file_size, "bytes": reader.nbytes, "compressed": reader.compressed_nbytes,
        "ratio": reader.ratio,
        "classes": {name: {"tensors": t.tensors, "bytes": t.nbytes, "compressed": t.compressed, "ratio": t.ratio}
                    for name, t in class_totals(entries).items()},
        "references": {kind: {"tensors": t.tensors, "bytes": t.nbytes, "not_stored": t.not_stored, "sparse": t.sparse}
                       for kind, t in source_totals(entries).items()},
        "bases": [ref.to_json() for ref in reader.bases],
        "portability": {"portable": not where.gpu_only and not where.compiled, "gpu_only_codecs": where.gpu_only,
                        "codecs_needing_the_c_decoder": where.compiled, "note": where.note},
        "tensors": [_entry_json(e, entries) for e in shown],
    }


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .. import api
    from ..report import class_table, human_bytes, portability_note, sources_note, tensor_table

    _refuse_directory(args.path, "inspect")
    with api.open(args.path) as reader:
        entries = reader.entries()
        if args.json:
            emit(json.dumps(_inspect_json(reader, args.top), indent=1))
            return 0
        emit(tensor_table(entries, limit=args.top))
        emit("")
        emit(class_table(entries))
        emit(f"\nfile {human_bytes(reader.file_size)}; tensors {human_bytes(reader.nbytes)} -> "
             f"{human_bytes(reader.compressed_nbytes)} ({reader.ratio:.3f}x)")
        emit(sources_note(entries, reader.bases))
        emit(portability_note(entries))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    """Decode every tensor of a .ckz file and check every checksum, a batch at a time (memory
    stays about a batch), each tensor where this machine can decode it (a GPU's file on the CPU
    where there is no GPU); nothing is written."""
    from .. import api
    from ..report import human_bytes

    _refuse_directory(args.path, "verify")
    start = time.perf_counter()
    with api.open(args.path) as reader:
        reader.map_location = api.local_location(reader.entries())
        reader.verify()
        count, nbytes = len(reader.entries()), reader.nbytes
    emit(f"{args.path}: {count} tensors ({human_bytes(nbytes)}), every checksum verified, "
         f"{time.perf_counter() - start:.2f} s")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from ..demo import run_demo

    return run_demo(preset=args.preset, steps=args.steps, device=args.device)


def _configure_inspect(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help=".ckz file")
    p.add_argument("--top", type=positive_int, default=None, help="show only the N largest tensors (N >= 1)")
    p.add_argument("--json", action="store_true", help="print the same as JSON: sizes, class totals, references, "
                   "portability and the tensor table")
    p.set_defaults(func=_cmd_inspect)


def _configure_verify(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help=".ckz file")
    p.set_defaults(func=_cmd_verify)


def _configure_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", help="model size preset (tiny, tiny-moe, small, medium, ...)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.set_defaults(func=_cmd_demo)


def _configure_warmup(p: argparse.ArgumentParser) -> None:
    p.add_argument("--codec", default="auto", help="the preset whose GPU kernels and codecs to prepare (default auto)")
    p.set_defaults(func=_cmd_warmup)


def _cmd_warmup(args: argparse.Namespace) -> int:
    """Prepare this machine, or a container image built on it, for a fast first save and load:
    remember Triton's cache key (no GPU needed) and, on a GPU, compile the kernels into Triton's
    kernel cache."""
    import importlib.util

    import torch

    from ..engine.policy import Policy
    from ..engine.warmup import compile_kernels
    from ..kernels import remember_triton_key

    policy = Policy.parse(args.codec)
    if importlib.util.find_spec("triton") is None:
        emit("Triton is not installed here: no cache key to keep (GPU saves need PyTorch's CUDA build)")
    elif (kept := remember_triton_key()) is not None:
        emit(f"Triton's cache key: kept in {kept}")
    else:
        emit("Triton's cache key: not kept (CKPTZIP_CACHE_DIR is empty, or its folder cannot be written)")
    if not torch.cuda.is_available():
        emit("no CUDA device here: the GPU kernels compile on the first GPU save or load (run `ckptzip "
             "warmup` on a GPU machine, with TRITON_CACHE_DIR kept, to compile them ahead)")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    start = time.perf_counter()
    compile_kernels(device, policy)
    from ..kernels import _aot

    where = "shipped compiled" if _aot.covers(device) else "kept in Triton's kernel cache"
    emit(f"GPU kernels for codec={args.codec!r}: ready on {device} ({torch.cuda.get_device_name(device)}) in "
         f"{time.perf_counter() - start:.1f} s, {where}")
    return 0


def _plugin(module: str) -> Configure:
    """A subcommand that lives with its subsystem: ``module`` has ``configure(parser)`` and ``run(args)``,
    and is imported only when the subcommand is chosen."""

    def configure(p: argparse.ArgumentParser) -> None:
        plugin = importlib.import_module(module, __package__)
        plugin.configure(p)
        p.set_defaults(func=plugin.run)

    return configure


# The benchmark harness (bench/ckptzip_bench, a distribution of its own outside the wheel) declares
# its command module in this entry-point group (bench/pyproject.toml); where it is not installed,
# the module is imported by name, which finds a checkout's bench/ folder on the import path.
BENCH_ENTRY_POINTS = "ckptzip.bench"
BENCH_MODULE = "ckptzip_bench.run"


def _harness() -> Any:
    """The harness's command module: ``configure(parser)`` and ``run(args)``."""
    from importlib.metadata import entry_points

    for entry in entry_points(group=BENCH_ENTRY_POINTS):
        return entry.load()
    try:
        return importlib.import_module(BENCH_MODULE)
    except ModuleNotFoundError as e:
        if e.name != BENCH_MODULE.split(".")[0]:  # the harness is there; something it imports is not
            raise
        raise UsageError(
            "`ckptzip bench` needs the benchmark harness, which is not installed: it is not part of the "
            "ckptzip wheel; from a ckptzip checkout, `pip install -e bench` (or put the checkout's bench/ folder "
            "on PYTHONPATH)"
        ) from None


def _bench(p: argparse.ArgumentParser) -> None:
    """``ckptzip bench``: the harness's own arguments and command."""
    harness = _harness()
    harness.configure(p)
    p.set_defaults(func=harness.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptzip")
    parser.add_argument("--version", action="version", version=f"ckptzip {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", action=_Commands)
    assert isinstance(sub, _Commands)

    _add_file_command(sub, "compress", "torch.save or .safetensors file -> .ckz", _compress, _compress_options)
    _add_file_command(sub, "decompress", ".ckz -> torch.save file, or .safetensors by DST's extension", _decompress)
    _add_file_command(
        sub, "convert", "re-encode a .ckz file with another codec (e.g. --codec portable)", _convert, _codec_arg
    )
    sub.add_command("inspect", "per-tensor ratio table and totals by tensor class", _configure_inspect)
    sub.add_command("verify", "decode a .ckz file and check every checksum; writes nothing", _configure_verify)
    sub.add_command("demo", "train a small model, checkpoint it, restore it bit-exactly", _configure_demo)
    sub.add_command("warmup", "prepare this machine (or an image) for a fast first save: Triton's key, the GPU kernels",
                    _configure_warmup)
    sub.add_command(
        "cost", "estimate idle-GPU and storage cost of checkpoint writes, with and without compression",
        _plugin("..cost"),
    )
    sub.add_command("dcp-convert", "DCP checkpoint directory <-> single .ckz file (direction from SRC)", _plugin(".dcp"))
    sub.add_command(
        "bench", "compare ckptzip with torch.save, safetensors, DCP, zstd, ZipNN and nvCOMP on real state",
        _bench,
    )
    parser.description = "Lossless compression of deep-learning checkpoints. Commands: " + ", ".join(sub.choices)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except CkptzipError as exc:
        emit(f"ckptzip: error: {exc}", sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
