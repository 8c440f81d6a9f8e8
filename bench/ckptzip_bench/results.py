"""Render ``ckptzip bench`` JSON into RESULTS.md, a ratio-vs-throughput plot and the README headline.

    python -m ckptzip_bench.results bench.json [more.json ...] --results-md bench/RESULTS.md --plot bench/bench.png
    python -m ckptzip_bench.results bench.json --headline

Several JSON files (for example a fp32 run and a bf16-weights run) become one document; the
headline table and the plot show the first state of the first file. Matplotlib is needed only
for ``--plot`` and is imported then.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from .analysis import CORE, GROUPS
from .breakdown import CATEGORIES, LANES
from .targets import evaluate
from ckptzip import strictjson
from ckptzip.errors import CkptzipError

__all__ = [
    "SCHEMA",
    "BenchResultsError",
    "breakdown_table",
    "headline",
    "load_results",
    "main",
    "methods_table",
    "pipeline_table",
    "profile_tables",
    "render_markdown",
    "write_plot",
]

SCHEMA = "ckptzip-bench/1"
_CLASSES = tuple(g for g in GROUPS if g != "total")


class BenchResultsError(CkptzipError, ValueError):
    """A benchmark JSON file cannot be read or is not one ``ckptzip bench`` wrote."""



def print_and_save(result: dict[str, Any], path: str | None) -> None:
    """A probe's result: printed as JSON, and written to ``path`` where one is given."""
    print(json.dumps(result, indent=1))
    if path:
        Path(path).write_text(json.dumps(result, indent=1))

def load_results(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check one benchmark JSON file."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise BenchResultsError(f"cannot read benchmark file {os.fspath(path)!r}: {e.strerror or e}") from e
    doc = strictjson.loads(raw, f"benchmark file {os.fspath(path)!r}", error=BenchResultsError,
                           advice="write it with `ckptzip bench --out-json`")
    schema = doc.get("schema") if isinstance(doc, dict) else None
    if schema != SCHEMA or not isinstance(doc.get("states"), list):
        raise BenchResultsError(
            f"{os.fspath(path)!r} is not a ckptzip bench result: expected schema {SCHEMA!r} and a "
            f"\"states\" list, found schema {schema!r}; write it with `ckptzip bench --out-json`"
        )
    return cast(dict[str, Any], doc)


# ------------------------------------------------------------------------------- formatting


def _ratio(v: float | None) -> str:
    return "–" if v is None else f"{v:.3f}"


def _gbps(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def _seconds(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}"


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _device(m: dict[str, Any], key: str) -> float | None:
    value = (m.get("device") or {}).get(key)
    return None if value is None else float(value)


def _exact(m: dict[str, Any]) -> str:
    return {"ok": "yes", "mismatch": "**NO**"}.get(m["status"], "–")


def _first_measured(doc: dict[str, Any], purpose: str) -> dict[str, Any]:
    for state in doc["states"]:
        if state.get("methods"):
            return cast(dict[str, Any], state)
    raise BenchResultsError(f"the benchmark file has no state with measured methods to {purpose}")


def _state_title(state: dict[str, Any]) -> str:
    kind = "MoE" if (state.get("config") or {}).get("n_experts") else "dense"
    if "params" not in state:
        return f"{kind} `{state['preset']}`"
    weights = "bf16 weights + fp32 master" if state.get("bf16_weights") else "fp32 weights"
    return (f"{kind} `{state['preset']}`: {state['params'] / 1e6:.1f}M params, {weights}, AdamW, "
            f"{state['steps']} steps (loss {state['loss'][0]:.2f} → {state['loss'][1]:.2f}), "
            f"{_gb(state['raw_bytes'])} in {state['tensors']} tensors")


# ----------------------------------------------------------------------------------- tables


def methods_table(state: dict[str, Any]) -> str:
    """Every method on one state: ratio (whole, fp32 w+m+v), wall times, throughputs, exactness."""
    rows = []
    for m in state["methods"]:
        if m["status"] != "ok":
            rows.append([m["name"], _exact(m), *["–"] * 8, f"{m['status']}: {m['reason']}"])
            continue
        core = ((m.get("classes") or {}).get(CORE) or {}).get("ratio")
        first = m.get("first_round")
        notes = [(m.get("device") or {}).get("error", "")]
        if first:
            notes.append(f"first round in this process: save {first['save_seconds']:.2f} s, "
                         f"restore {first['load_seconds']:.2f} s")
        rows.append([
            m["name"], _exact(m), _ratio(m["ratio"]), _ratio(core), _seconds(m["save_seconds"]),
            _seconds(m["load_seconds"]), _gbps(m["save_gbps"]), _gbps(m["load_gbps"]),
            _gbps(_device(m, "encode_gbps")), _gbps(_device(m, "decode_gbps")), "; ".join(n for n in notes if n),
        ])
    header = ["method", "bit-exact", "ratio", f"ratio {CORE}", "save s", "restore s", "save GB/s",
              "restore GB/s", "GPU compress GB/s", "GPU decompress GB/s", "note"]
    return _table(header, rows)


def pipeline_table(state: dict[str, Any]) -> str:
    """Each method that saves to a file object, with no storage in the way (save to a discarding
    sink, load from host memory), next to its storage-bound GB/s."""
    rows = []
    for m in state["methods"]:
        p = m.get("pipeline")
        if m["status"] != "ok" or p is None:
            continue
        if "error" in p:
            rows.append([m["name"], *["–"] * 8, p["error"]])
            continue
        rows.append([m["name"], _seconds(p["save_seconds"]), _seconds(p["load_seconds"]), _gbps(p["save_gbps"]),
                     _gbps(p["load_gbps"]), _gbps(m["save_gbps"]), _gbps(m["load_gbps"]),
                     _seconds(p["first_save_seconds"]), _seconds(p["first_load_seconds"]), ""])
    if not rows:
        return "Not measured (`--pipeline-reps 0`, or no method that saves to a file object ran)."
    header = ["method", "save s", "load s", "save GB/s", "load GB/s", "storage-bound save GB/s",
              "storage-bound restore GB/s", "first save s", "first load s", "note"]
    return _table(header, rows)


_LANE_TITLES = {"gpu": "GPU s", "main": "main thread s", "workers": "other threads s"}


def breakdown_table(profile: dict[str, Any]) -> str:
    """One profiled call (:func:`ckptzip_bench.breakdown.profile_call`): seconds per category and lane."""
    lanes = profile["lanes"]
    rows = []
    for category in CATEGORIES:
        values = [lanes[lane].get(category) for lane in LANES]
        if any(values):
            rows.append([category, *(_seconds3(v) for v in values)])
    rows.append(["**total**", *(_seconds3(sum(lanes[lane].values())) for lane in LANES)])
    return _table(["category", *(_LANE_TITLES[lane] for lane in LANES)], rows)


def _seconds3(v: float | None) -> str:
    return "–" if not v else f"{v:.3f}"


def profile_tables(profile: dict[str, Any]) -> str:
    """Where the time of one save and one load goes (``--profile``), one table each."""
    if "error" in profile:
        return f"Profile not measured: {profile['error']}"
    parts = []
    for op, what in (("save", "save to a discarding file object"), ("load", "load from host memory")):
        p = profile[op]
        gpu = "GPU lane from torch.profiler" if p["gpu_profiled"] else "no GPU lane (CPU run)"
        parts.append(f"{profile['method']} {what}: {p['wall_seconds']:.3f} s wall while profiled; "
                     f"{p['samples']} stack samples, {p['worker_threads']} other threads; {gpu}.")
        parts.append(breakdown_table(p))
    return "\n\n".join(parts)


def classes_table(state: dict[str, Any]) -> str:
    """Ratio per tensor class: entropy bound, best codec on planes, then each method that codes tensors
    independently."""
    entropy, reference = state.get("entropy") or {}, state.get("reference") or {}
    per_class = [m for m in state["methods"] if m["status"] == "ok" and m.get("classes")]
    header = ["class", "bytes", "order-0 bound", "best codec on planes", *(m["name"] for m in per_class)]
    rows = []
    for group in GROUPS:
        if group not in entropy:
            continue
        ref = reference.get(group) or {}
        best = f"{_ratio(ref.get('best_ratio'))} ({ref['best']})" if ref.get("best") else "–"
        rows.append([group, _gb(entropy[group]["raw_bytes"]), _ratio(entropy[group]["bound"]), best,
                     *(_ratio(((m["classes"].get(group)) or {}).get("ratio")) for m in per_class)])
    return _table(header, rows)


def planes_table(state: dict[str, Any]) -> str:
    """Per class: bits per byte of each byte plane and the ratio of every reference codec on planes."""
    entropy, reference = state.get("entropy") or {}, state.get("reference") or {}
    labels = [c["label"] for c in state.get("reference_codecs", [])]
    rows = []
    for group in _CLASSES:
        if group not in entropy:
            continue
        planes = "; ".join(f"{d}: " + " ".join(f"{b:.1f}" for b in bits)
                           for d, bits in entropy[group]["planes"].items())
        codecs = (reference.get(group) or {}).get("codecs", {})
        rows.append([group, planes, *(_ratio(codecs.get(label)) for label in labels)])
    return _table(["class", "bits/byte per plane (high byte first)", *labels], rows)


def targets_table(targets: list[dict[str, Any]]) -> str:
    """One row per target: met / not met / not measured, the number, what it needs and the details."""
    rows = []
    for t in targets:
        status = {True: "met", False: "**not met**", None: "not measured"}[t["met"]]
        measured = "–" if t["measured"] is None else f"{t['measured']:.3f}"
        rows.append([t["text"], status, measured, f"{t['op']} {t['threshold']:g}", t["detail"]])
    return _table(["target", "status", "measured", "needs", "detail"], rows)


def headline(doc: dict[str, Any]) -> str:
    """The README table: the first state of ``doc``, its methods that ran, one line of context."""
    state = _first_measured(doc, "make a headline table from")
    rows = []
    for m in state["methods"]:
        if m["status"] != "ok":
            continue
        rows.append([m["name"], _ratio(m["ratio"]), _seconds(m["save_seconds"]), _seconds(m["load_seconds"]),
                     _gbps(_device(m, "encode_gbps")), _gbps(_device(m, "decode_gbps"))])
    gpu = doc["hardware"]["gpu"].get("name") or f"CPU only ({doc['hardware']['cpu']['model']})"
    cache = (doc.get("disk") or {}).get("read_cache", "warm")
    context = (f"{_state_title(state)}; {gpu}, {doc['date'][:10]}; save = write + fsync, restore = read "
               f"onto {doc['settings']['device']} (page cache {cache}); every restore checked bit-exact.")
    table = _table(["method", "ratio", "save s", "restore s", "GPU compress GB/s", "GPU decompress GB/s"], rows)
    return f"{table}\n\n{context}"


def _hardware(doc: dict[str, Any]) -> str:
    hw = doc["hardware"]
    gpu = hw["gpu"]
    versions = ", ".join(f"{k} {v}" for k, v in hw["versions"].items() if v)
    lines = [
        f"- GPU: {gpu['name']} ×{gpu['count']}, {gpu['memory_gib']} GiB" if gpu.get("name") else "- GPU: none",
        (f"- CPU: {hw['cpu']['model']}, {hw['cpu']['count']} logical cores ({hw['cpu']['usable']} usable); "
        f"memory {hw['memory_gib']} GiB"),
        f"- {hw['platform']}, Python {hw['python']}; {versions}",
    ]
    disk = doc.get("disk")
    if disk:
        fs = disk["filesystem"]
        lines.append(f"- Disk ({fs['path']} on {fs['mount']}, {fs['type']}): write + fsync "
                     f"{_gbps(disk['write_gbps'])} GB/s, read {_gbps(disk['read_gbps'])} GB/s "
                     f"(page cache {disk['read_cache']}), {_gb(disk['bytes'])}")
    lines.append(f"- Reads: {doc['settings']['cache']}")
    ceilings = doc.get("ceilings") or {}
    if "skipped" in ceilings or "error" in ceilings:
        lines.append(f"- Ceilings not measured: {ceilings.get('skipped') or ceilings.get('error')}")
    elif ceilings:
        lines.append("- Ceilings (ckptzip_bench.gpu.ceilings): "
                     + ", ".join(f"{k.removesuffix('_gbps')} {_gbps(v)} GB/s" for k, v in ceilings.items()))
    return "\n".join(lines)


def _state_section(state: dict[str, Any], disk: dict[str, Any] | None) -> str:
    title = f"### {_state_title(state)}"
    if "methods" not in state:
        return f"{title}\n\nNot measured ({state['status']}): {state['reason']}"
    notes = [f"**{what} failed**: {state[key]['error']}" for key, what in
             (("entropy", "Entropy bound"), ("reference", "Codec-on-planes reference")) if "error" in state[key]]
    if state["status"] == "running":
        notes.append("**Interrupted**: the run ended before every method of this state was measured.")
    targets = state.get("targets") or evaluate(state, disk)
    ref = ", ".join(f"{c['label']} ({c['chunk_bytes'] >> 10} KiB chunks)" for c in state.get("reference_codecs", []))
    return "\n\n".join([
        title,
        (f"Trained in {state['train_seconds']:.1f} s on {state['device']}; medians of up to "
        f"{state['reps']} save/restore repetitions."),
        *notes,
        "#### Methods", methods_table(state),
        "#### Pipeline without storage", pipeline_table(state),
        ("Save to a file object that discards what it is given; load from bytes already in host "
        f"memory onto {state['device']}; medians, GB/s of uncompressed bytes; the first call of each "
        "(after the storage-bound runs) is reported apart and the first load is checked bit for bit. "
        "The storage-bound columns repeat the Methods table."),
        *(["#### Where the time goes", profile_tables(state["profile"]),
           ("Seconds per lane: GPU = torch.profiler's device events (streams summed); threads = "
            "stack samples of every thread, innermost recognised frame. Lanes overlap, so a column "
            "is busy time on that lane, not a share of the wall time.")] if "profile" in state else []),
        "#### Ratio per tensor class",
        classes_table(state),
        (f"*order-0 bound*: what an order-0 coder fitted to each byte plane of each tensor would reach "
        f"(entropies sampled as the planner samples). *best codec on planes*: the best of {ref or 'none'} "
        f"on each tensor's byte planes ({state.get('reference_backend', '?')}), a plane kept raw where "
        "coding does not shrink it. Per-class columns exist for methods that store tensors independently."),
        "#### Byte planes", planes_table(state),
        "#### Targets", targets_table(targets),
    ])


def render_markdown(docs: Sequence[dict[str, Any]], plot: str | None = None) -> str:
    """RESULTS.md for one or more benchmark runs; ``plot`` is the image path relative to the file."""
    parts = [
        "# ckptzip benchmark results",
        ("Generated by `python -m ckptzip_bench.results` from the JSON `ckptzip bench` writes "
        "(see docs/BENCH.md). Every method's restored state was compared bit for bit with what it "
        "saved before its numbers were recorded; methods that did not run say why."),
        "## Headline",
        headline(docs[0]),
    ]
    if plot:
        parts.append(f"![compression ratio against throughput per method]({plot})")
    for n, doc in enumerate(docs, 1):
        parts += [
            f"## Run {n}: {doc['date']}",
            f"```\n{doc['command']}\n```",
            _hardware(doc),
            *(_state_section(s, doc.get("disk")) for s in doc["states"]),
        ]
    return "\n\n".join(parts) + "\n"


# ------------------------------------------------------------------------------------- plot


def write_plot(doc: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """PNG of ratio against throughput per method (first measured state of ``doc``): compress on the
    left, decompress on the right; filled markers end to end (disk included), hollow GPU-resident."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter
    except ImportError as e:
        raise BenchResultsError("the plot needs matplotlib: pip install matplotlib") from e
    state = _first_measured(doc, "plot")
    methods = [m for m in state["methods"] if m["status"] == "ok" and m["save_gbps"] and m["load_gbps"]]
    fig = Figure(figsize=(14, 5.5), layout="constrained")
    panels = fig.subplots(1, 2, sharey=True)
    for ax, (title, wall, device) in zip(panels, (("compress", "save_gbps", "encode_gbps"),
                                                  ("decompress", "load_gbps", "decode_gbps"))):
        for n, m in enumerate(methods):
            color = f"C{n % 10}"
            ax.scatter(m[wall], m["ratio"], color=color, s=40, zorder=3, label=m["name"])
            resident = _device(m, device)
            if resident is not None:
                ax.scatter(resident, m["ratio"], facecolors="none", edgecolors=color, s=40, zorder=3)
                ax.plot([m[wall], resident], [m["ratio"], m["ratio"]], color=color, lw=0.6, ls=":")
        ax.set_xscale("log")
        for axis_format in (ax.xaxis.set_major_formatter, ax.xaxis.set_minor_formatter):
            axis_format(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("GB/s of uncompressed bytes (log)")
        ax.set_title(f"{title}: filled = end to end with disk, hollow = GPU-resident")
        ax.grid(True, which="both", alpha=0.3)
    panels[0].set_ylabel("compression ratio (uncompressed / stored bytes)")
    fig.legend(*panels[0].get_legend_handles_labels(), loc="outside right upper", fontsize=8)
    gpu = doc["hardware"]["gpu"].get("name") or "CPU only"
    fig.suptitle(f"ckptzip bench: {state['preset']} ({_gb(state['raw_bytes'])}), {gpu}, {doc['date'][:10]}")
    fig.savefig(path, dpi=120)


# -------------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckptzip_bench.results", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", nargs="+", help="bench JSON files written by `ckptzip bench --out-json`")
    parser.add_argument("--results-md", help="write RESULTS.md here (default: print it)")
    parser.add_argument("--plot", help="write the ratio-vs-throughput PNG here (needs matplotlib)")
    parser.add_argument("--headline", action="store_true", help="print only the README headline table")
    args = parser.parse_args(argv)
    try:
        docs = [load_results(p) for p in args.json]
        if args.headline:
            print(headline(docs[0]))
            return 0
        if args.plot:
            write_plot(docs[0], args.plot)
        plot_ref = None
        if args.plot:
            base = Path(args.results_md).parent if args.results_md else Path.cwd()
            plot_ref = os.path.relpath(args.plot, base)
        text = render_markdown(docs, plot_ref)
        if args.results_md:
            Path(args.results_md).write_text(text, encoding="utf-8")
            print(f"wrote {args.results_md}" + (f" and {args.plot}" if args.plot else ""))
        else:
            print(text, end="")
    except CkptzipError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
