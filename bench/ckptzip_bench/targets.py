"""The project's performance targets, checked against one benchmarked state.

:func:`evaluate` is pure: it reads the JSON records ``ckptzip bench`` writes (a state's methods,
its codec-on-planes reference, the disk bandwidth), so a results file can be re-checked later.
Each target is ``met`` (True/False) or not measured (``None``, with the reason in ``detail``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from .analysis import CORE

__all__ = ["DEFAULT", "PORTABLE", "evaluate", "format_targets"]

DEFAULT = "ckptzip-auto"
PORTABLE = "ckptzip-portable"
_CLASSES = ("weights", "exp_avg", "exp_avg_sq", "gradients")


@dataclass(frozen=True)
class _Target:
    id: str
    text: str
    op: str  # ">=" or "<="
    threshold: float
    measured: float | None
    met: bool | None
    detail: str


class _Missing(Exception):
    """A number a target needs was not measured; the message says which."""


def _method(methods: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    m = methods.get(name)
    if m is None:
        raise _Missing(f"{name} was not run (add it to --methods)")
    if m["status"] != "ok":
        raise _Missing(f"{name} is {m['status']}: {m['reason']}")
    return m


def _class_ratio(m: dict[str, Any], group: str) -> float:
    ratio = ((m.get("classes") or {}).get(group) or {}).get("ratio")
    if ratio is None:
        raise _Missing(f"{m['name']} has no {group!r} ratio")
    return float(ratio)


def _device(m: dict[str, Any], key: str) -> float:
    device = m.get("device") or {}
    if key not in device:
        why = device.get("error") or "GPU-resident throughput is measured on CUDA runs only"
        raise _Missing(f"{m['name']}: {why}")
    return float(device[key])


def _number(value: Any, what: str) -> float:
    if value is None:
        raise _Missing(f"{what} was not measured")
    return float(value)


def _check(tid: str, text: str, op: str, threshold: float, measure: Callable[[], tuple[float, str]]) -> _Target:
    try:
        value, detail = measure()
    except _Missing as missing:
        return _Target(tid, text, op, threshold, None, None, str(missing))
    met = value >= threshold if op == ">=" else value <= threshold
    return _Target(tid, text, op, threshold, value, met, detail)


def evaluate(state: dict[str, Any], disk: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Every target for one benchmarked ``state`` record, given the run's ``disk`` bandwidths."""
    methods = {m["name"]: m for m in state.get("methods", [])}
    reference = state.get("reference") or {}
    disk = disk or {}
    cache = disk.get("read_cache", "warm")
    out: list[_Target] = []

    def core_ratio() -> tuple[float, str]:
        r = _class_ratio(_method(methods, DEFAULT), CORE)
        return r, f"{r:.3f}x on {CORE} (fp32 weights + exp_avg + exp_avg_sq)"

    def versus_nvcomp() -> tuple[float, str]:
        ours = _class_ratio(_method(methods, DEFAULT), CORE)
        theirs = _class_ratio(_method(methods, "nvcomp-zstd"), CORE)
        return ours / theirs, f"{ours:.3f}x vs nvcomp-zstd {theirs:.3f}x on {CORE}"

    out.append(_check("default-ratio", f"{DEFAULT} ratio on {CORE} >= 1.20x", ">=", 1.20, core_ratio))
    out.append(_check("default-vs-nvcomp-zstd", f"{DEFAULT} ratio on {CORE} >= 1.10 x plain nvCOMP zstd",
                      ">=", 1.10, versus_nvcomp))
    for cls in _CLASSES:
        if cls not in reference:
            continue

        def versus_reference(cls: str = cls) -> tuple[float, str]:
            ours = _class_ratio(_method(methods, DEFAULT), cls)
            ref = reference[cls]
            best = _number(ref.get("best_ratio"), f"the codec-on-planes reference for {cls}")
            return ours / best, f"{ours:.3f}x vs best codec on planes {best:.3f}x ({ref['best']})"

        out.append(_check(f"class-{cls}", f"{DEFAULT} {cls} ratio within 2% of the best codec on planes",
                          ">=", 0.98, versus_reference))

    def speed(name: str, key: str) -> Callable[[], tuple[float, str]]:
        def measure() -> tuple[float, str]:
            value = _device(_method(methods, name), key)
            return value, f"{value:.0f} GB/s GPU-resident"
        return measure

    out.append(_check("gpu-compress", f"{DEFAULT} GPU-resident compress >= 300 GB/s", ">=", 300,
                      speed(DEFAULT, "encode_gbps")))
    out.append(_check("gpu-decompress", f"{DEFAULT} GPU-resident decompress >= 500 GB/s", ">=", 500,
                      speed(DEFAULT, "decode_gbps")))

    def portable_ratio() -> tuple[float, str]:
        ours, portable = _method(methods, DEFAULT)["ratio"], _method(methods, PORTABLE)["ratio"]
        return portable / ours, f"{portable:.3f}x vs {ours:.3f}x (whole state)"

    out.append(_check("portable-ratio", f"{PORTABLE} ratio within 1% of {DEFAULT}", ">=", 0.99, portable_ratio))
    out.append(_check("portable-gpu-compress", f"{PORTABLE} GPU-resident compress >= 40 GB/s", ">=", 40,
                      speed(PORTABLE, "encode_gbps")))

    def pipeline(name: str, op: str) -> Callable[[], tuple[float, str]]:
        def measure() -> tuple[float, str]:
            m = _method(methods, name)
            if not str(state.get("device", "")).startswith("cuda"):
                raise _Missing(f"the pipeline targets are for CUDA runs; this state is on {state.get('device')}")
            p = m.get("pipeline") or {}
            if f"{op}_gbps" not in p:
                raise _Missing(f"{name}: {p.get('error') or 'the pipeline was not measured (--pipeline-reps 0)'}")
            size = (f"{state['raw_bytes'] / 1e9:.2f} GB in {state['tensors']} tensors"
                    if "raw_bytes" in state and "tensors" in state else "state size unknown")
            return p[f"{op}_gbps"], f"{p[f'{op}_seconds']:.3f} s on {size} (issue 9 asks >= 8 GB, >= 500 tensors)"
        return measure

    for name, save_gbps, load_gbps in ((DEFAULT, 40, 30), (PORTABLE, 15, 30)):
        short = name.removeprefix("ckptzip-")
        out.append(_check(f"{short}-pipeline-save", f"{name} save to a discarding file object >= {save_gbps} GB/s",
                          ">=", save_gbps, pipeline(name, "save")))
        out.append(_check(f"{short}-pipeline-load", f"{name} load from host memory >= {load_gbps} GB/s",
                          ">=", load_gbps, pipeline(name, "load")))

    def versus_disk(kind: str) -> Callable[[], tuple[float, str]]:
        def measure() -> tuple[float, str]:
            m = _method(methods, DEFAULT)
            gbps = _number(disk.get(f"{kind}_gbps"), f"disk {kind} bandwidth")
            floor = m["stored_bytes"] / (gbps * 1e9)
            seconds = m[f"{'save' if kind == 'write' else 'load'}_seconds"]
            note = f", page cache {cache}" if kind == "read" else ""
            return seconds / floor, (f"{seconds:.2f} s vs {m['stored_bytes'] / 1e9:.2f} GB / {gbps:.2f} GB/s "
                                     f"= {floor:.2f} s{note}")
        return measure

    def versus_torch(kind: str) -> Callable[[], tuple[float, str]]:
        def measure() -> tuple[float, str]:
            ours = _method(methods, DEFAULT)[f"{kind}_seconds"]
            theirs = _method(methods, "torch.save")[f"{kind}_seconds"]
            note = f", page cache {cache}" if kind == "load" else ""
            return theirs / ours, f"{ours:.2f} s vs torch.save {theirs:.2f} s{note}"
        return measure

    out.append(_check("save-vs-disk", f"{DEFAULT} save wall time <= 1.1 x (stored bytes / disk write GB/s)",
                      "<=", 1.10, versus_disk("write")))
    out.append(_check("save-vs-torch", f"{DEFAULT} save >= 1.15x faster than torch.save", ">=", 1.15,
                      versus_torch("save")))
    out.append(_check("restore-vs-disk", f"{DEFAULT} restore wall time <= 1.1 x (stored bytes / disk read GB/s)",
                      "<=", 1.10, versus_disk("read")))
    out.append(_check("restore-vs-torch", f"{DEFAULT} restore >= 1.15x faster than torch.load", ">=", 1.15,
                      versus_torch("load")))
    return [asdict(t) for t in out]


def format_targets(targets: list[dict[str, Any]]) -> str:
    """One line per target: ``met`` / ``NOT MET`` / ``not measured``, the number and the details."""
    lines = []
    for t in targets:
        status = {True: "met", False: "NOT MET", None: "not measured"}[t["met"]]
        value = "" if t["measured"] is None else f" {t['measured']:.3f} ({t['op']} {t['threshold']:g})"
        lines.append(f"[{status:^12}] {t['text']}:{value} {t['detail']}")
    return "\n".join(lines)
