"""Issue 11's numbers: what casts, duplicates and incremental checkpoints save, and what finding
them costs.

1. Mixed precision: a trained model with bf16 parameters, fp32 master weights and both AdamW
   moments (Megatron's layout, no grads); its ratio with and without references, and save time
   with and without the detection (each checked bit-exact).
2. Incremental: a model trained ``--steps`` steps, saved every ``--every`` by two managers, one
   with ``incremental=K``; bytes per checkpoint of bf16 weights only and of the full fp32 training
   state, each against standalone ckptzip, and save time of both; every step restored bit-exact.
   Per tensor class: stored bytes of both, how many tensors became deltas, and the bytes had each
   tensor of a delta checkpoint taken the smaller of whole and delta (``oracle``: what a perfect
   per-tensor decision would store). The issue's targets are checked at the end.

    python3 bench/sources_bench.py --preset tiny --device cpu --out sources.json       # CPU, minutes
    python3 bench/sources_bench.py --preset medium --device cuda --out $OUT/sources.json  # H200
    python3 bench/sources_bench.py --parts incremental --steps 300 --every 50 --k 5 ...  # the target alone
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import ckptzip
from ckptzip.demo.training import Transformer, get_preset, load_corpus, train, training_state
from ckptzip.engine import sources
from ckptzip.engine.delta import xor_bytes
from ckptzip.engine.encode import tensor_bytes
from ckptzip.manager import CheckpointManager
from ckptzip.report import tensor_class
from ckptzip.tree import flatten

# The incremental targets: mean ratio of bf16 weights-only checkpoints, fewer bytes of the
# full fp32 training state than standalone, save time at most this much above standalone.
TARGET_BF16_RATIO = 2.2
TARGET_FP32_SAVED = 0.04
TARGET_SAVE_SLOWDOWN = 0.10


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _same(a: Any, b: Any) -> bool:
    ta, tb = flatten(a).tensors, flatten(b).tensors
    return len(ta) == len(tb) and all(
        x.name == y.name and torch.equal(x.tensor.reshape(-1).view(torch.uint8).cpu(), y.tensor.reshape(-1).view(torch.uint8).cpu())
        for x, y in zip(ta, tb))


@contextlib.contextmanager
def _no_references() -> Iterator[None]:
    """Saves as before issue 11: no casts, no duplicates (the bench's baseline)."""
    casts, dups = sources.find_casts, sources.find_duplicates
    sources.find_casts, sources.find_duplicates = (lambda *a, **k: {}), (lambda *a, **k: {})  # type: ignore[assignment]
    try:
        yield
    finally:
        sources.find_casts, sources.find_duplicates = casts, dups  # type: ignore[assignment]


def _save_seconds(state: Any, device: torch.device, reps: int) -> tuple[float, bytes]:
    times, blob = [], b""
    for _ in range(reps + 1):  # the first call is a warm-up
        buf = io.BytesIO()
        _sync(device)
        start = time.perf_counter()
        ckptzip.save(state, buf)
        _sync(device)
        times.append(time.perf_counter() - start)
        blob = buf.getvalue()
    return statistics.median(times[1:]), blob


def mixed_precision(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    run = train(args.preset, args.mixed_steps, device=device, bf16_weights=True)
    state = training_state(run.model, run.optimizer, run.step, master_weights=run.master_weights, include_grads=False)
    state.pop("rng")
    nbytes = sum(t.tensor.nbytes for t in flatten(state).tensors)
    with _no_references():
        before_s, before = _save_seconds(state, device, args.reps)
    after_s, after = _save_seconds(state, device, args.reps)
    tensors = [t.tensor for t in flatten(state).tensors]
    _sync(device)
    start = time.perf_counter()
    sources.rewrite_table([t.name for t in flatten(state).tensors], tensors)
    _sync(device)
    detect_s = time.perf_counter() - start
    assert _same(ckptzip.load(after, map_location=device), state)
    with ckptzip.open(after) as reader:
        kinds = [e.source_kind for e in reader.entries()]
    return {
        "state_bytes": nbytes, "tensors": len(tensors), "casts": kinds.count("cast"), "copies": kinds.count("copy"),
        "ratio_before": nbytes / len(before), "ratio_after": nbytes / len(after),
        "save_s_before": before_s, "save_s_after": after_s, "detect_s": detect_s,
        "save_GBps_before": nbytes / before_s / 1e9, "save_GBps_after": nbytes / after_s / 1e9,
    }


def _trainer(args: argparse.Namespace, device: torch.device) -> tuple[Any, Any]:
    config = get_preset(args.preset)
    torch.manual_seed(0)
    model = Transformer(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    corpus = load_corpus().to(device)
    window = torch.arange(config.seq_len + 1, device=device)
    batches = torch.Generator().manual_seed(0)

    def step() -> None:
        offsets = torch.randint(0, corpus.numel() - config.seq_len - 1, (args.batch_size, 1), generator=batches)
        chunk = corpus[offsets.to(device) + window].long()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits, aux = model(chunk[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        (loss + 0.01 * aux).backward()
        optimizer.step()

    return step, (model, optimizer)


def _dir_bytes(path: Path) -> dict[int, int]:
    return {int(n[5:13]): (path / n).stat().st_size for n in os.listdir(path) if n.startswith("step_")}


def _stored_by_class(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, int]]:
    """Stored bytes and XOR-delta tensors of one checkpoint, by tensor class."""
    out: dict[str, dict[str, int]] = {}
    with ckptzip.open(path) as reader:
        for e in reader.entries():
            row = out.setdefault(tensor_class(e.name, tensors[e.name]), {"bytes": 0, "deltas": 0, "tensors": 0})
            row["bytes"] += e.compressed_nbytes
            row["deltas"] += e.source_kind == "xor"
            row["tensors"] += 1
    return out


def _oracle_by_class(tensors: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> dict[str, int]:
    """Bytes by class had every tensor taken the smaller of whole and XOR against ``base``
    (casts and copies aside: each tensor compressed on its own)."""
    out: dict[str, int] = {}
    for name, t in tensors.items():
        size = len(ckptzip.compress(t).to_bytes())
        b = base.get(name)
        if b is not None and b.dtype == t.dtype and b.shape == t.shape and t.numel():
            residue = xor_bytes(tensor_bytes(t), tensor_bytes(b)).view(t.dtype).view(t.shape)
            size = min(size, len(ckptzip.compress(residue).to_bytes()))
        cls = tensor_class(name, t)
        out[cls] = out.get(cls, 0) + size
    return out


def incremental(args: argparse.Namespace, device: torch.device, root: Path) -> dict[str, Any]:
    step, (model, optimizer) = _trainer(args, device)
    kinds = {
        "bf16_weights": lambda: {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()},
        "fp32_training_state": lambda: training_state(model, optimizer, 0, include_grads=False),
    }
    managers = {(kind, mode): CheckpointManager(root / f"{kind}-{mode}", keep_last=None, async_save=False,
                                                incremental=args.k if mode == "incremental" else None)
                for kind in kinds for mode in ("standalone", "incremental")}
    seconds: dict[tuple[str, str], list[float]] = {key: [] for key in managers}
    saved: dict[tuple[str, int], Any] = {}
    for i in range(1, args.steps + 1):
        step()
        if i % args.every:
            continue
        for kind, make in kinds.items():
            state = make()
            saved[kind, i] = {t.name: t.tensor.clone() for t in flatten(state).tensors}
            for mode in ("standalone", "incremental"):
                _sync(device)
                start = time.perf_counter()
                managers[kind, mode].save(i, state)
                _sync(device)
                seconds[kind, mode].append(time.perf_counter() - start)
    out: dict[str, Any] = {}
    for kind in kinds:
        sizes = {mode: _dir_bytes(root / f"{kind}-{mode}") for mode in ("standalone", "incremental")}
        steps = sorted(sizes["standalone"])
        raw = {i: sum(t.nbytes for t in saved[kind, i].values()) for i in steps}
        for i in steps:  # every step restores bit-exactly, deltas through their chains
            got = managers[kind, "incremental"].restore(i, map_location=device)
            assert _same({t.name: t.tensor for t in flatten(got).tensors}, saved[kind, i]), (kind, i)
        by_class = {mode: {i: _stored_by_class(root / f"{kind}-{mode}" / f"step_{i:08d}.ckz", saved[kind, i])
                           for i in steps} for mode in ("standalone", "incremental")}
        deltas = [i for i in steps if any(row["deltas"] for row in by_class["incremental"][i].values())]
        out[kind] = {
            "steps": steps, "raw_bytes": raw[steps[0]],
            "ratio_standalone": [raw[i] / sizes["standalone"][i] for i in steps],
            "ratio_incremental": [raw[i] / sizes["incremental"][i] for i in steps],
            "mean_ratio_standalone": sum(raw.values()) / sum(sizes["standalone"].values()),
            "mean_ratio_incremental": sum(raw.values()) / sum(sizes["incremental"].values()),
            "bytes_saved_fraction": 1 - sum(sizes["incremental"].values()) / sum(sizes["standalone"].values()),
            "save_s_standalone": statistics.median(seconds[kind, "standalone"]),
            "save_s_incremental": statistics.median(seconds[kind, "incremental"]),
            "delta_steps": deltas,
            "mean_ratio_delta_steps_standalone": sum(raw[i] for i in deltas) / max(1, sum(sizes["standalone"][i] for i in deltas)),
            "mean_ratio_delta_steps_incremental": sum(raw[i] for i in deltas) / max(1, sum(sizes["incremental"][i] for i in deltas)),
            "by_class": {mode: {str(i): rows for i, rows in per_step.items()} for mode, per_step in by_class.items()},
            # the previous step of a delta step is its base (chains run in step order)
            "oracle_by_class": {str(i): _oracle_by_class(saved[kind, i], saved[kind, steps[steps.index(i) - 1]])
                                for i in deltas},
        }
    for manager in managers.values():
        manager.close()
    return out


def _class_table(result: dict[str, Any]) -> str:
    """Per class, over the delta steps: stored bytes standalone, incremental, and the oracle's."""
    rows, deltas = {}, [str(i) for i in result["delta_steps"]]
    for i in deltas:
        for cls, row in result["by_class"]["standalone"][i].items():
            r = rows.setdefault(cls, [0, 0, 0, 0, 0])
            r[0] += row["bytes"]
            r[1] += result["by_class"]["incremental"][i][cls]["bytes"]
            r[2] += result["oracle_by_class"][i].get(cls, 0)
            r[3] += result["by_class"]["incremental"][i][cls]["deltas"]
            r[4] += row["tensors"]
    lines = [f"  {'class':11s} {'standalone':>11s} {'incremental':>11s} {'oracle':>11s}  deltas/tensors (delta steps)"]
    for cls, (a, b, c, d, n) in rows.items():
        lines.append(f"  {cls:11s} {a:11d} {b:11d} {c:11d}  {d}/{n}   incremental saves {1 - b / max(a, 1):+.1%}")
    return "\n".join(lines)


def check_targets(results: dict[str, Any]) -> list[str]:
    """One line per target of the issue's incremental run: the number, the target, met or not."""
    inc = results["incremental"]
    bf16, fp32 = inc["bf16_weights"], inc["fp32_training_state"]
    lines = [
        f"bf16 weights-only mean ratio {bf16['mean_ratio_incremental']:.3f} (standalone "
        f"{bf16['mean_ratio_standalone']:.3f}; delta steps alone {bf16['mean_ratio_delta_steps_incremental']:.3f}), "
        f"target >= {TARGET_BF16_RATIO}: {'met' if bf16['mean_ratio_incremental'] >= TARGET_BF16_RATIO else 'MISSED'}",
        f"fp32 training state {fp32['bytes_saved_fraction']:.2%} fewer bytes than standalone, target >= "
        f"{TARGET_FP32_SAVED:.0%}: {'met' if fp32['bytes_saved_fraction'] >= TARGET_FP32_SAVED else 'MISSED'}",
    ]
    for kind, r in inc.items():
        slower = r["save_s_incremental"] / r["save_s_standalone"] - 1
        lines.append(f"{kind} median save {r['save_s_incremental']:.3f} s vs standalone {r['save_s_standalone']:.3f} s "
                     f"({slower:+.1%}), target <= +{TARGET_SAVE_SLOWDOWN:.0%}: "
                     f"{'met' if slower <= TARGET_SAVE_SLOWDOWN else 'MISSED'}")
    lines.append("every step restored bit-exactly (asserted)")
    for kind, r in inc.items():
        lines.append(f"{kind}, bytes of the delta steps by tensor class:\n{_class_table(r)}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--mixed-steps", type=int, default=50, help="training steps before the mixed-precision state")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--k", type=int, default=5, help="incremental=K")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=None, help="where checkpoints go (a fresh temporary directory inside it)")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    p.add_argument("--parts", default="mixed,incremental", help="which measurements, comma-separated")
    args = p.parse_args()
    device = torch.device(args.device)
    parts = set(args.parts.split(","))
    results: dict[str, Any] = {"args": vars(args)}
    if "mixed" in parts:
        results["mixed_precision"] = mixed_precision(args, device)
        print(json.dumps(results["mixed_precision"], indent=1), flush=True)
    if "incremental" in parts:
        with tempfile.TemporaryDirectory(dir=args.dir) as root:
            results["incremental"] = incremental(args, device, Path(root))
        results["targets"] = check_targets(results)
        print("\n".join(results["targets"]))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
