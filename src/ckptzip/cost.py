"""What synchronous checkpoint writes cost in idle GPU time, and what compression saves.

``ckptzip cost`` turns a model size, a state layout, a cluster and a storage bandwidth into GPU
hours and dollars per month, with and without a compression ratio. The model, its formulas and
its assumptions are documented in ``docs/COST.md``; the functions here are pure, the CLI is
:func:`configure` + :func:`run`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

from ckptzip import strictjson
from ckptzip.errors import CkptzipError

GIB = 2**30
SECONDS_PER_DAY = 86_400
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
OPTIMIZER_STATES = {"adamw": 2, "sgd": 1, "none": 0}  # fp32 tensors per parameter
OPTIMIZER_LABELS = {"adamw": "AdamW", "sgd": "SGD momentum"}
DEFAULT_BENCH_METHOD = "ckptzip-auto"
_PARAM_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


class CostInputError(CkptzipError, ValueError):
    """An input to the cost model is out of range, or a ratio source cannot be read."""


def _require(name: str, value: float, check: Callable[[float], bool], expected: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not check(value):
        raise CostInputError(f"{name} must be {expected}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class CostInputs:
    """Everything the cost model needs. Bandwidths and throughputs are in GiB/s.

    ``write_bandwidth`` is the aggregate rate of the storage the whole job writes to;
    ``snapshot_bandwidth`` and ``compress_throughput`` are per GPU, with the checkpoint sharded
    evenly over ``gpus``. ``days`` is how many days per month the job trains. ``ratio`` is
    uncompressed bytes / compressed bytes; ``None`` means no compressed scenario.
    """

    params: float = 70e9
    gpus: int = 8
    gpu_hour_price: float = 4.40
    write_bandwidth: float = 5.0
    interval_minutes: float = 30.0
    days: float = 30.0
    weights_dtype: str = "bf16"
    master_weights: bool = False
    gradients: bool = True
    optimizer: str = "adamw"
    ratio: float | None = None
    async_save: bool = False
    snapshot_bandwidth: float = 50.0
    compress_throughput: float = 200.0
    storage_price: float | None = None
    keep: int = 1

    def __post_init__(self) -> None:
        for name in ("params", "write_bandwidth", "interval_minutes", "days", "snapshot_bandwidth",
                     "compress_throughput"):
            _require(name, getattr(self, name), lambda v: v > 0, "a positive number")
        for name in ("gpus", "keep"):
            _require(name, getattr(self, name), lambda v: v >= 1 and v == int(v), "a positive integer")
        _require("gpu_hour_price", self.gpu_hour_price, lambda v: v >= 0, "a number >= 0")
        _require("days", self.days, lambda v: v <= 31, "at most 31 (days per month)")
        if self.ratio is not None:
            _require("ratio", self.ratio, lambda v: v > 0, "a positive number")
        if self.storage_price is not None:
            _require("storage_price", self.storage_price, lambda v: v >= 0, "a number >= 0")
        if self.weights_dtype not in DTYPE_BYTES:
            raise CostInputError(f"weights_dtype must be one of {sorted(DTYPE_BYTES)}, "
                                 f"got {self.weights_dtype!r}")
        if self.optimizer not in OPTIMIZER_STATES:
            raise CostInputError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, "
                                 f"got {self.optimizer!r}")
        if self.master_weights and self.weights_dtype == "fp32":
            raise CostInputError("master_weights adds an fp32 copy of bf16/fp16 weights, but weights_dtype "
                                 "is already fp32; drop master_weights or pick weights_dtype bf16 or fp16")

    @property
    def bytes_per_param(self) -> int:
        """Checkpointed bytes per parameter: weights, fp32 master copy, gradients, fp32 optimizer states."""
        weights = DTYPE_BYTES[self.weights_dtype]
        return (weights + 4 * self.master_weights + weights * self.gradients
                + 4 * OPTIMIZER_STATES[self.optimizer])

    @property
    def checkpoint_bytes(self) -> float:
        return self.params * self.bytes_per_param

    def layout_description(self) -> str:
        parts = [f"{self.weights_dtype} weights"]
        if self.master_weights:
            parts.append("fp32 master weights")
        if self.gradients:
            parts.append(f"{self.weights_dtype} gradients")
        if self.optimizer != "none":
            parts.append(f"{OPTIMIZER_LABELS[self.optimizer]} fp32 states")
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class Scenario:
    """The cost of saving one way (uncompressed, or compressed at some ratio)."""

    checkpoint_gib: float
    compress_seconds: float
    snapshot_seconds: float
    write_seconds: float
    stall_seconds: float
    saves_per_month: float
    idle_hours_per_month: float
    idle_cost_per_month: float
    storage_cost_per_month: float | None
    backlog: bool

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.storage_cost_per_month is None:
            del out["storage_cost_per_month"]
        return out

    @property
    def total_cost_per_month(self) -> float:
        return self.idle_cost_per_month + (self.storage_cost_per_month or 0.0)


@dataclasses.dataclass(frozen=True)
class CostReport:
    """The uncompressed scenario, and the compressed one when a ratio is known."""

    inputs: CostInputs
    uncompressed: Scenario
    compressed: Scenario | None
    ratio_source: str | None = None

    @property
    def saved_per_month(self) -> float | None:
        """Idle cost plus storage cost saved per month; negative when compression costs more."""
        if self.compressed is None:
            return None
        return self.uncompressed.total_cost_per_month - self.compressed.total_cost_per_month

    def to_dict(self) -> dict[str, Any]:
        """The JSON object ``ckptzip cost --json`` prints."""
        out: dict[str, Any] = {"inputs": dataclasses.asdict(self.inputs),
                               "bytes_per_param": self.inputs.bytes_per_param}
        out.update(self.uncompressed.to_dict())
        if self.compressed is not None:
            out["ratio"] = self.inputs.ratio
            out["ratio_source"] = self.ratio_source
            out["compressed"] = self.compressed.to_dict()
            out["saved_per_month"] = self.saved_per_month
        return out


def estimate(inputs: CostInputs, *, ratio_source: str | None = None) -> CostReport:
    """Cost of checkpointing as ``inputs`` describe, without and (given a ratio) with compression."""
    compressed = None if inputs.ratio is None else scenario(inputs, inputs.ratio)
    return CostReport(inputs, scenario(inputs, None), compressed, ratio_source)


def scenario(inputs: CostInputs, ratio: float | None) -> Scenario:
    """Cost of one way of saving; ``ratio=None`` writes raw bytes and compresses nothing.

    Each save stalls the GPUs for its front part: GPU compression (if any), then the write (sync)
    or the copy to host memory (async, after which the write runs in the background). A save is
    busy until its write ends; if that outlasts the interval (``backlog``), the next save starts
    only then, so saves are less frequent and, when async, the GPUs wait for the previous write.
    """
    raw_gib = inputs.checkpoint_bytes / GIB
    size_gib = raw_gib if ratio is None else raw_gib / ratio
    compress_s = 0.0 if ratio is None else raw_gib / (inputs.compress_throughput * inputs.gpus)
    write_s = size_gib / inputs.write_bandwidth
    interval_s = inputs.interval_minutes * 60
    if inputs.async_save:
        snapshot_s = size_gib / (inputs.snapshot_bandwidth * inputs.gpus)
        front_s = compress_s + snapshot_s
        busy_s = front_s + write_s
    else:
        snapshot_s = 0.0
        front_s = busy_s = compress_s + write_s
    period_s = max(interval_s, busy_s)
    stall_s = min(period_s, front_s + (period_s - interval_s if inputs.async_save else 0.0))
    saves = inputs.days * SECONDS_PER_DAY / period_s
    idle_hours = saves * stall_s / 3600
    storage = None if inputs.storage_price is None else inputs.keep * size_gib * inputs.storage_price
    return Scenario(
        checkpoint_gib=size_gib,
        compress_seconds=compress_s,
        snapshot_seconds=snapshot_s,
        write_seconds=write_s,
        stall_seconds=stall_s,
        saves_per_month=saves,
        idle_hours_per_month=idle_hours,
        idle_cost_per_month=idle_hours * inputs.gpus * inputs.gpu_hour_price,
        storage_cost_per_month=storage,
        backlog=busy_s > interval_s,
    )


def ratio_from_bench(path: str | os.PathLike[str], method: str = DEFAULT_BENCH_METHOD) -> float:
    """The ratio of ``method`` in a benchmark JSON: ``{"methods": [{"name": ..., "ratio": ...}, ...]}``."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CostInputError(f"cannot read benchmark file {os.fspath(path)!r}: {e.strerror or e}") from e
    doc = strictjson.loads(raw, f"benchmark file {os.fspath(path)!r}", error=CostInputError,
                           advice="pass a file written by `ckptzip bench --out-json`")
    methods = doc.get("methods") if isinstance(doc, dict) else None
    if not isinstance(methods, list):
        raise CostInputError(f"benchmark file {os.fspath(path)!r} has no \"methods\" list; expected "
                             '{"methods": [{"name": ..., "ratio": ...}, ...]}')
    names = [m["name"] for m in methods if isinstance(m, dict) and isinstance(m.get("name"), str)]
    for entry in methods:
        if isinstance(entry, dict) and entry.get("name") == method:
            ratio = entry.get("ratio")
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio > 0 \
                    or not math.isfinite(ratio):
                raise CostInputError(f"method {method!r} in {os.fspath(path)!r} has ratio {ratio!r}; "
                                     "expected a positive number")
            return float(ratio)
    raise CostInputError(f"method {method!r} not found in {os.fspath(path)!r}; it has "
                         f"{', '.join(map(repr, names)) or 'no named methods'}; pick one with --method")


def ratio_from_checkpoint(path: str | os.PathLike[str]) -> float:
    """Uncompressed / compressed payload bytes of an existing ``.ckz`` file."""
    from ckptzip.api import open as open_checkpoint  # torch: only when a checkpoint is read

    try:
        with open_checkpoint(path) as reader:
            raw, stored = reader.nbytes, reader.compressed_nbytes
    except CkptzipError:
        raise
    except OSError as e:
        raise CostInputError(f"cannot read checkpoint {os.fspath(path)!r}: {e.strerror or e}") from e
    if stored <= 0:
        raise CostInputError(f"checkpoint {os.fspath(path)!r} stores no tensor bytes, so it has no ratio; "
                             "pass --ratio or a checkpoint with tensors")
    return raw / stored


# --- CLI ---------------------------------------------------------------------------------------

def _number_type(check: Callable[[float], bool], expected: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not math.isfinite(value) or not check(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value
    return parse


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _param_count(text: str) -> float:
    """``70e9``, ``70B``, ``1.5T``, ``350M`` -> a positive parameter count."""
    number, scale = text.strip(), 1.0
    if number[-1:].lower() in _PARAM_SUFFIXES:
        number, scale = number[:-1], _PARAM_SUFFIXES[number[-1].lower()]
    try:
        value = float(number) * scale
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(
            f"expected a positive parameter count like 70e9 or 70B, got {text!r}")
    return value


_positive = _number_type(lambda v: v > 0, "a positive number")
_non_negative = _number_type(lambda v: v >= 0, "a number >= 0")
_days = _number_type(lambda v: 0 < v <= 31, "training days per month, in (0, 31]")


def configure(p: argparse.ArgumentParser) -> None:
    """Add the ``cost`` subcommand's arguments to its parser; :func:`run` takes the parsed namespace."""
    p.description = ("Estimate what checkpoint writes cost in idle GPU time (and storage) per month, "
                     "and what a compression ratio saves. Rates are in GiB/s. See docs/COST.md.")
    job = p.add_argument_group("job")
    _option(job, "--params", _param_count, "parameters checkpointed, e.g. 70e9 or 70B; for MoE, all experts "
            "(default: 70e9)")
    _option(job, "--gpus", _positive_int, "GPUs of the job; all idle while a save stalls (default: %(default)s)")
    _option(job, "--gpu-hour-price", _non_negative, "$ per GPU-hour (default: %(default)s)")
    _option(job, "--interval-minutes", _positive, "minutes between saves (default: %(default)g)")
    _option(job, "--days", _days, "training days per month (default: %(default)g)")
    layout = p.add_argument_group("checkpoint layout")
    _option(layout, "--weights-dtype", None, "dtype of weights and gradients (default: %(default)s)",
            choices=sorted(DTYPE_BYTES))
    _option(layout, "--master-weights", None, "an fp32 master copy of bf16/fp16 weights is saved too (default: no)",
            action=argparse.BooleanOptionalAction)
    layout.add_argument("--no-gradients", dest="gradients", action="store_false", help="gradients are not saved")
    _option(layout, "--optimizer", None, "fp32 optimizer states per parameter: adamw 2, sgd 1, none 0 "
            "(default: %(default)s)", choices=sorted(OPTIMIZER_STATES))
    saving = p.add_argument_group("saving")
    _option(saving, "--write-bandwidth", _positive, "aggregate storage write bandwidth, GiB/s (default: %(default)g)")
    saving.add_argument("--async", dest="async_save", action="store_true",
                        help="saves copy to host memory and write in the background")
    _option(saving, "--snapshot-bandwidth", _positive, "with --async: device-to-host copy, GiB/s per GPU "
            "(default: %(default)g)")
    _option(saving, "--compress-throughput", _positive, "GPU compression, GiB/s of input per GPU (default: %(default)g)")
    ratio = p.add_argument_group("compression ratio (at most one source)")
    source = ratio.add_mutually_exclusive_group()
    source.add_argument("--ratio", type=_positive, help="uncompressed / compressed bytes")
    source.add_argument("--from-bench", metavar="BENCH_JSON", help="read the ratio from a benchmark JSON")
    source.add_argument("--from-checkpoint", metavar="PATH", help="read the ratio from a .ckz file")
    ratio.add_argument("--method",
                       help=f"with --from-bench: the method to read (default: {DEFAULT_BENCH_METHOD})")
    storage = p.add_argument_group("storage")
    _option(storage, "--storage-price", _non_negative, "$ per GiB-month")
    _option(storage, "--keep", _positive_int, "checkpoints retained (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _option(group: argparse._ArgumentGroup, flag: str, kind: Callable[[str], Any] | None, help: str,
            **extra: Any) -> None:
    """``flag`` in ``group``, for the :class:`CostInputs` field of its name, defaulting to that field."""
    field = flag.removeprefix("--").replace("-", "_")
    if kind is not None:
        extra["type"] = kind
    group.add_argument(flag, default=getattr(CostInputs, field), help=help, **extra)


def run(args: argparse.Namespace) -> int:
    """Run ``ckptzip cost``; returns the exit status (2 for unusable inputs)."""
    try:
        ratio, source = _resolve_ratio(args)
        inputs = CostInputs(**{f.name: getattr(args, f.name) for f in dataclasses.fields(CostInputs)
                                  if f.name != "ratio"}, ratio=ratio)
    except CkptzipError as e:
        print(f"ckptzip cost: error: {e}", file=sys.stderr)
        return 2
    report = estimate(inputs, ratio_source=source)
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_table(report))
    return 0


def _resolve_ratio(args: argparse.Namespace) -> tuple[float | None, str | None]:
    if args.method is not None and args.from_bench is None:
        raise CostInputError("--method only applies with --from-bench BENCH_JSON")
    if args.ratio is not None:
        return args.ratio, "--ratio"
    if args.from_bench is not None:
        method = args.method or DEFAULT_BENCH_METHOD
        return ratio_from_bench(args.from_bench, method), f"{args.from_bench} ({method})"
    if args.from_checkpoint is not None:
        return ratio_from_checkpoint(args.from_checkpoint), args.from_checkpoint
    return None, None


# --- table -------------------------------------------------------------------------------------

def _money(value: float) -> str:
    """``$2,203``; cents below $100; a minus sign for a loss."""
    text = f"${abs(value):,.0f}" if abs(value) >= 100 else f"${abs(value):,.2f}"
    return "-" + text if text.strip("$0.,") and value < 0 else text


def _count(n: float) -> str:
    """``70e9`` -> ``70B``, ``1.5e12`` -> ``1.5T``."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g}{suffix}"
    return f"{n:.4g}"


def format_table(report: CostReport) -> str:
    """A plain-text table of both scenarios, with the inputs it assumed."""
    i = report.inputs
    if i.async_save:
        mode = (f"async saves (host copy {i.snapshot_bandwidth:g} GiB/s per GPU, "
                f"storage {i.write_bandwidth:g} GiB/s)")
    else:
        mode = f"synchronous writes at {i.write_bandwidth:g} GiB/s"
    lines = [
        f"{_count(i.params)} params x {i.bytes_per_param} B/param ({i.layout_description()})",
        f"{i.gpus} GPUs at ${i.gpu_hour_price:.2f}/GPU-hour; a save every {i.interval_minutes:g} min, "
        f"{i.days:g} training days/month; {mode}",
        "",
    ]
    columns = [report.uncompressed] + ([report.compressed] if report.compressed else [])
    header = ["uncompressed"] + ([f"compressed {i.ratio:.3g}x"] if report.compressed else [])
    rows: list[tuple[str, list[str]]] = [
        ("checkpoint size", [f"{s.checkpoint_gib:,.1f} GiB" for s in columns]),
        ("storage write per save", [f"{s.write_seconds:,.1f} s" for s in columns]),
        ("GPU stall per save", [f"{s.stall_seconds:,.1f} s" for s in columns]),
        ("saves per month", [f"{s.saves_per_month:,.0f}" for s in columns]),
        ("idle hours per month", [f"{s.idle_hours_per_month:,.1f} h" for s in columns]),
        (f"idle cost per month ({i.gpus} GPUs)", [_money(s.idle_cost_per_month) for s in columns]),
    ]
    if i.async_save:
        rows.insert(1, ("host copy per save", [f"{s.snapshot_seconds:,.1f} s" for s in columns]))
    if report.compressed is not None:
        rows.insert(1, ("GPU compression per save", [f"{s.compress_seconds:,.1f} s" for s in columns]))
    if i.storage_price is not None:
        rows.append((f"storage per month ({i.keep} kept)",
                     [_money(s.storage_cost_per_month or 0.0) for s in columns]))
    width = max(len(label) for label, _ in rows)
    col = max(14, *(len(h) for h in header), *(len(v) for _, vs in rows for v in vs))
    lines.append(" " * width + "".join(f"  {h:>{col}}" for h in header))
    lines += [f"{label:<{width}}" + "".join(f"  {v:>{col}}" for v in values) for label, values in rows]
    if report.saved_per_month is not None:
        lines += ["", f"saved per month: {_money(report.saved_per_month)} (ratio from {report.ratio_source})"]
    for name, s in zip(header, columns):
        if s.backlog:
            lines.append(f"warning ({name}): a save is busy longer than the {i.interval_minutes:g}-minute "
                         "interval, so saves run back to back; save less often or write faster")
    return "\n".join(lines)
