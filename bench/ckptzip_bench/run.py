"""``ckptzip bench``: every way of saving training state, side by side, on the same real state.

One run trains a dense and a mixture-of-experts transformer on the standard library's sources
(no downloads), then, per state: the order-0 entropy bound and the best codec on byte planes per
tensor class, and every method (ckptzip's presets and the baselines) saved and restored
``--reps`` times with each restore checked bit for bit. It measures the disk and the hardware
ceilings first, checks the project's targets, prints tables and writes JSON (after every method,
so an interrupted run keeps what it measured), RESULTS.md and a plot. docs/BENCH.md explains it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from . import gpu_codecs, tier, training_job, training_loop
from .analysis import (
    CPU_REFERENCE,
    GPU_REFERENCE,
    entropy_by_group,
    planes_reference,
)
from .measure import iter_tensors, tensor_nbytes
from .methods import (
    RunContext,
    first_line,
    get_method,
    measure_method,
    method_names,
)
from .results import (
    SCHEMA,
    BenchResultsError,
    methods_table,
    pipeline_table,
    profile_tables,
    render_markdown,
    write_plot,
)
from .pipeline import profile_pipeline
from .system import PageCache, disk_bandwidth, hardware, release_memory
from .targets import evaluate, format_targets
from ckptzip.codecs import has_codec
from ckptzip.errors import CkptzipError
from ckptzip.storage import atomic_file
from ckptzip.tree import map_tree
from ckptzip.demo.training import count_parameters, get_preset, state_nbytes, train

__all__ = ["configure", "run"]

_DEFAULT_PRESETS = {"cuda": ("medium", "medium-moe"), "cpu": ("tiny", "tiny-moe")}
PROFILED = "ckptzip-auto"  # the method --profile breaks down
_DISK_BYTES = (16 << 20, 2 << 30)  # bounds of the disk-bandwidth file; the state's size in between


class BenchArgumentError(CkptzipError, ValueError):
    """A ``ckptzip bench`` option names something that does not exist here."""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


# The other suites: name -> (module with configure(parser) and run(args), one line of help).
SUITES: dict[str, tuple[ModuleType, str]] = {
    "training-job": (training_job, "ckptzip inside a training job: a filled GPU, many saves, the manager, fresh nodes"),
    "training-loop": (training_loop, "ckptzip and its peers inside a real training loop: training time lost per checkpoint"),
    "tier": (tier, "the memory tier and deltas where training barely moves, on the CPU"),
    "gpu-codecs": (gpu_codecs, "each nvCOMP codec on weight-like bytes: ratio, GB/s, bit-exact, CPU interchange"),
}


def configure(p: argparse.ArgumentParser) -> None:
    """Add the ``bench`` subcommand's arguments to its parser; :func:`run` takes the parsed namespace."""
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--preset", help="dense model preset, or 'none' (default: medium on CUDA, tiny on CPU)")
    p.add_argument("--moe-preset", help="mixture-of-experts preset, or 'none' (default: medium-moe on CUDA, "
                                        "tiny-moe on CPU)")
    p.add_argument("--steps", type=_positive_int, default=30, help="AdamW steps to train (default: %(default)s)")
    p.add_argument("--bf16-weights", action="store_true",
                   help="bf16 model weights and grads with fp32 master weights (default: fp32 weights)")
    p.add_argument("--device", choices=("cuda", "cpu"),
                   help="where the state lives and is restored to (default: cuda if available)")
    p.add_argument("--methods", nargs="+", metavar="NAME",
                   help=f"methods to run, space- or comma-separated (default: all: {', '.join(method_names())})")
    p.add_argument("--reps", type=_positive_int, default=3,
                   help="save/restore repetitions per method; medians are reported (default: %(default)s)")
    p.add_argument("--budget-s", type=_positive_float,
                   help="soft time limit: no method, repetition or state starts after it (default: none)")
    p.add_argument("--cache", choices=("cold", "warm"), default="cold",
                   help="drop the page cache before timed reads where permitted (default: %(default)s)")
    p.add_argument("--pipeline-reps", type=_count, default=3,
                   help="repetitions of the pipeline without storage: each ckptzip preset and torch.save saving "
                        "to a discarding file object and loading from host memory; 0 leaves it out "
                        "(default: %(default)s)")
    p.add_argument("--profile", action="store_true",
                   help="break one ckptzip-auto save and load without storage down by where the time goes")
    p.add_argument("--dir", help="directory for the checkpoints written (default: the system temp dir)")
    p.add_argument("--out-json", help="write the results as JSON here (rewritten after every method)")
    p.add_argument("--results-md", help="write RESULTS.md here")
    p.add_argument("--plot", help="write a PNG of ratio against throughput here (needs matplotlib)")
    suites = p.add_subparsers(dest="suite", metavar="SUITE", title="other suites (their own options follow the name)")
    for name, (module, what) in SUITES.items():
        module.configure(suites.add_parser(name, help=what))


def _relative(arg: str) -> str:
    """A path inside the working directory as a relative path (results name no machine's paths)."""
    try:
        return os.path.relpath(arg) if os.path.isabs(arg) and Path(arg).resolve().is_relative_to(Path.cwd()) else arg
    except (OSError, ValueError):
        return arg


def _methods(arg: list[str] | None) -> list[str]:
    known = method_names()
    if not arg:
        return known
    names = [n for item in arg for n in item.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise BenchArgumentError(f"unknown method(s) {', '.join(unknown)}; expected names from {', '.join(known)}")
    return list(dict.fromkeys(names))


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings with defaults resolved; raises BenchArgumentError for unusable ones."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise BenchArgumentError("--device cuda was given but CUDA is not available here; use --device cpu")
    preset = args.preset or _DEFAULT_PRESETS[device][0]
    moe = args.moe_preset or _DEFAULT_PRESETS[device][1]
    presets = [name for name in (preset, moe) if name != "none"]
    if not presets:
        raise BenchArgumentError("--preset none and --moe-preset none leave nothing to benchmark; keep one")
    for name in presets:
        try:
            get_preset(name)
        except ValueError as e:
            raise BenchArgumentError(str(e)) from None
    if args.dir is not None and not Path(args.dir).is_dir():
        raise BenchArgumentError(f"--dir {args.dir!r} is not a directory; create it or pick another")
    for flag, path in (("--out-json", args.out_json), ("--results-md", args.results_md), ("--plot", args.plot)):
        if path is not None and not Path(path).resolve().parent.is_dir():
            raise BenchArgumentError(f"{flag} {path!r}: its directory does not exist; create it first")
    return {
        "device": device, "preset": preset, "moe_preset": moe, "presets": presets, "steps": args.steps,
        "bf16_weights": args.bf16_weights,
        "methods": _methods(args.methods), "reps": args.reps, "budget_s": args.budget_s,
        "dir": args.dir, "cache": args.cache, "pipeline_reps": args.pipeline_reps,
        "profile": args.profile,
    }


def _command(settings: dict[str, Any], args: argparse.Namespace) -> str:
    """The command that repeats this run, every default spelled out."""
    words = ["ckptzip", "bench", "--device", settings["device"], "--preset", settings["preset"],
             "--moe-preset", settings["moe_preset"], "--steps", str(settings["steps"]),
             "--reps", str(settings["reps"]), "--pipeline-reps", str(settings["pipeline_reps"]),
             "--cache", settings["cache"], "--methods", ",".join(settings["methods"])]
    for flag, on in (("--bf16-weights", settings["bf16_weights"]), ("--profile", settings["profile"])):
        if on:
            words.append(flag)
    for flag, value in (("--budget-s", settings["budget_s"]), ("--dir", settings["dir"]),
                        ("--out-json", args.out_json), ("--results-md", args.results_md), ("--plot", args.plot)):
        if value is not None:
            words += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return shlex.join(words)


def _guarded(what: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, or ``{"error": ...}`` if it raises: one failed measurement never ends the run."""
    try:
        return fn()
    except Exception as exc:  # reported in the results
        traceback.print_exc()
        print(f"  {what} failed: {first_line(exc)}", flush=True)
        return {"error": first_line(exc)}
    finally:
        release_memory()


def _ceilings(device: str, directory: str) -> dict[str, Any]:
    if device != "cuda":
        return {"skipped": "device-copy, pinned-transfer and disk ceilings are measured on CUDA runs only"}
    from .gpu import ceilings

    return dict(ceilings(directory=directory))


def _finite(doc: Any) -> Any:
    """``doc`` with infinite and NaN floats (a zero-time measurement) as ``None``: strict JSON."""
    return map_tree(doc, lambda value, _: None if isinstance(value, float) and not math.isfinite(value) else value)


def _write_json(doc: dict[str, Any], path: str | None) -> None:
    """Refresh targets and the top-level method summary, then replace ``path`` atomically."""
    for state in doc["states"]:
        if "methods" in state:
            state["targets"] = evaluate(state, doc["disk"])
    measured = [s for s in doc["states"] if "methods" in s]
    doc["methods"] = [
        {k: m.get(k) for k in ("name", "status", "exact", "ratio", "save_seconds", "load_seconds")}
        | {"state": measured[0]["label"]}
        for m in (measured[0]["methods"] if measured else [])
    ]
    if path is None:
        return
    with atomic_file(path, sync=False) as f:
        f.write(json.dumps(_finite(doc), indent=1, allow_nan=False).encode("utf-8"))


def _progress(m: dict[str, Any]) -> str:
    if m["status"] != "ok":
        return f"  {m['name']:<18} {m['status']}: {m['reason']}"
    line = (f"  {m['name']:<18} ratio {m['ratio']:.3f}  save {m['save_seconds']:.2f} s  "
            f"restore {m['load_seconds']:.2f} s ({m['read_cache']})")
    device, pipeline = m.get("device") or {}, m.get("pipeline") or {}
    if "encode_gbps" in device:
        line += f"  GPU {device['encode_gbps']:.0f}/{device['decode_gbps']:.0f} GB/s"
    if "save_gbps" in pipeline:
        line += f"  no storage {pipeline['save_gbps']:.3g}/{pipeline['load_gbps']:.3g} GB/s"
    return line + f"  bit-exact x{m['reps']}"


def _bench_state(label: str, preset: str, settings: dict[str, Any], ctx: RunContext,
                 record: dict[str, Any], save: Callable[[], None]) -> None:
    """Train one model, analyse its state and run every method on it, filling ``record``."""
    config = get_preset(preset)
    print(f"== {label}: training {preset!r} for {settings['steps']} steps on {ctx.device} ...", flush=True)
    result = train(config, settings["steps"], device=ctx.device, bf16_weights=settings["bf16_weights"])
    state = result.state()
    record.update({
        "params": count_parameters(config), "device": str(ctx.device),
        "train_seconds": result.seconds, "loss": [result.losses[0], result.losses[-1]],
        "raw_bytes": tensor_nbytes(state), "tensors": sum(1 for _ in iter_tensors(state)),
    })
    print(f"   {record['raw_bytes'] / 1e9:.3f} GB in {record['tensors']} tensors, loss "
          f"{result.losses[0]:.3f} -> {result.losses[-1]:.3f} in {result.seconds:.1f} s", flush=True)
    backend = "cuda" if ctx.device.type == "cuda" and has_codec("ans", "cuda") else "cpu"
    record["entropy"] = _guarded("entropy bound", lambda: entropy_by_group(state))
    record["reference_backend"] = backend
    record["reference_codecs"] = [asdict(c) for c in (GPU_REFERENCE if backend == "cuda" else CPU_REFERENCE)]
    record["reference"] = _guarded("codec-on-planes reference", lambda: planes_reference(state, backend))
    save()
    for name in settings["methods"]:
        measured = measure_method(get_method(name), state, ctx)
        record["methods"].append(measured)
        print(_progress(measured), flush=True)
        save()
        if name == PROFILED or name == settings["methods"][-1]:  # after its own first calls were timed
            _profile(state, settings, ctx, record, save)


def _profile(state: Any, settings: dict[str, Any], ctx: RunContext, record: dict[str, Any],
             save: Callable[[], None]) -> None:
    """With ``--profile``, once per state: where one save and one load of :data:`PROFILED` go."""
    if settings["profile"] and "profile" not in record and not ctx.out_of_time():
        print(f"   profiling one {PROFILED} save and load without storage ...", flush=True)
        record["profile"] = _guarded("profile", lambda: profile_pipeline(get_method(PROFILED), state, ctx.device))
        save()


def run(args: argparse.Namespace) -> int:
    """Run ``ckptzip bench`` (or the suite named). Returns 2 for unusable options; 1 if a method's
    restore was not bit-exact or a ckptzip preset failed; 0 otherwise (unmet targets and failed
    baselines are reported)."""
    suite = getattr(args, "suite", None)
    if suite is not None:
        return int(SUITES[suite][0].run(args))
    try:
        settings = _settings(args)
    except CkptzipError as e:
        print(f"ckptzip bench: error: {e}", file=sys.stderr)
        return 2
    started = time.monotonic()
    cache = PageCache(settings["cache"] == "cold")
    print(f"reads: {cache.note}", flush=True)
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": _command(settings, args),
        "argv": [_relative(a) for a in sys.argv],
        "hardware": hardware(),
        "settings": {**settings, "cache": cache.note},
        "disk": None,
        "ceilings": None,
        "states": [],
    }

    def save() -> None:
        _write_json(doc, args.out_json)

    with tempfile.TemporaryDirectory(dir=settings["dir"], prefix="ckptzip-bench-") as tmp:
        estimate = state_nbytes(get_preset(settings["presets"][0]), bf16_weights=settings["bf16_weights"])
        disk_bytes = min(max(estimate, _DISK_BYTES[0]), _DISK_BYTES[1])
        doc["disk"] = _guarded("disk bandwidth", lambda: disk_bandwidth(tmp, disk_bytes, cache))
        doc["ceilings"] = _guarded("ceilings", lambda: _ceilings(settings["device"], tmp))
        print(f"disk: {json.dumps(doc['disk'])}\nceilings: {json.dumps(doc['ceilings'])}", flush=True)
        save()
        ctx = RunContext(torch.device(settings["device"]), settings["reps"], cache, Path(tmp),
                         started + (settings["budget_s"] or math.inf), settings["pipeline_reps"])
        for n, preset in enumerate(settings["presets"]):
            label = "moe" if get_preset(preset).moe else "dense"
            record: dict[str, Any] = {"label": label, "preset": preset, "config": asdict(get_preset(preset)),
                                      "bf16_weights": settings["bf16_weights"], "steps": settings["steps"],
                                      "reps": settings["reps"], "status": "running", "reason": None}
            doc["states"].append(record)
            if n and ctx.out_of_time():
                record.update(status="skipped", reason="the time budget (--budget-s) was spent before training")
                continue
            try:
                record["methods"] = []
                _bench_state(label, preset, settings, ctx, record, save)
                record["status"] = "ok"
            except Exception as exc:  # the next state may still run
                traceback.print_exc()
                record.update(status="failed", reason=first_line(exc))
                del record["methods"]
            release_memory()
    save()
    _report(doc, args)
    return _exit_status(doc)


def _report(doc: dict[str, Any], args: argparse.Namespace) -> None:
    """Print each state's tables and targets; write RESULTS.md and the plot where asked."""
    for state in doc["states"]:
        if "methods" in state:
            extra = [profile_tables(state["profile"])] if "profile" in state else []
            print("\n\n".join([f"\n== {state['label']} ({state['preset']})", methods_table(state),
                                pipeline_table(state), *extra, format_targets(state["targets"])]))
    plot_ref = None
    later = "render it later from the JSON: python -m ckptzip_bench.results"
    if args.plot:
        try:
            write_plot(doc, args.plot)
            base = Path(args.results_md).parent if args.results_md else Path.cwd()
            plot_ref = os.path.relpath(args.plot, base)
            print(f"wrote {args.plot}")
        except BenchResultsError as e:
            print(f"no plot: {e}; {later}", file=sys.stderr)
    if args.results_md:
        try:
            Path(args.results_md).write_text(render_markdown([doc], plot_ref), encoding="utf-8")
            print(f"wrote {args.results_md}")
        except BenchResultsError as e:
            print(f"no {args.results_md}: {e}; {later}", file=sys.stderr)
    if args.out_json:
        print(f"wrote {args.out_json}")


def _exit_status(doc: dict[str, Any]) -> int:
    for state in doc["states"]:
        if state["status"] == "failed":
            return 1
        for m in state.get("methods", []):
            if m["status"] == "mismatch" or (m["status"] == "failed" and m["name"].startswith("ckptzip-")):
                return 1
    return 0
