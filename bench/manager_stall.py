"""How much CheckpointManager stalls training: host time blocked in each ``save`` against the
device-to-device copy time of the state, and training throughput with a checkpoint every N steps
against none. Targets: blocking <= 2 x copy time; >= 95 % throughput at one save per minute.

    python3 bench/manager_stall.py --preset medium --steps 300 --every 50 --out $OUT/stall.json

The model, data and state come from ckptzip.demo.training. Each step ends with ``loss.item()`` (as a
loop that logs its loss does), so the host cannot hide a stall by running ahead of the GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import ckptzip
from ckptzip.manager import CheckpointManager
from ckptzip.demo.training import Transformer, get_preset, load_corpus, training_state
from ckptzip.tree import flatten


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _make_step(args: argparse.Namespace, device: torch.device) -> tuple[Callable[[], float], Callable[[int], Any]]:
    """A training step of the preset model (AdamW, bf16 autocast on CUDA) and its state at a step."""
    config = get_preset(args.preset)
    torch.manual_seed(0)
    model = Transformer(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    corpus = load_corpus().to(device)
    window = torch.arange(config.seq_len + 1, device=device)
    batches = torch.Generator(device=device).manual_seed(0)

    def step() -> float:
        offsets = torch.randint(
            0, corpus.numel() - config.seq_len - 1, (args.batch_size, 1), device=device, generator=batches
        )
        chunk = corpus[offsets + window].long()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits, aux = model(chunk[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=False)  # grads stay allocated: the state includes them
        (loss + 0.01 * aux).backward()
        optimizer.step()
        return loss.item()

    return step, lambda n: training_state(model, optimizer, n)


def _copy_seconds(state: Any, device: torch.device, repeats: int = 5) -> tuple[float, int, int]:
    """Median time to clone every tensor of the state on its device; total bytes; tensor count."""
    tensors = [item.tensor for item in flatten(state).tensors]
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        copies = [t.clone() for t in tensors]
        _sync(device)
        times.append(time.perf_counter() - start)
        del copies
    return statistics.median(times), sum(t.nbytes for t in tensors), len(tensors)


def _train(
    step: Callable[[], float], steps: int, device: torch.device, save: Callable[[int], None] | None, every: int
) -> tuple[float, list[float]]:
    """Seconds for ``steps`` steps, and the host seconds blocked in each ``save`` call."""
    blocked = []
    _sync(device)
    start = time.perf_counter()
    for i in range(1, steps + 1):
        step()
        if save is not None and i % every == 0:
            t0 = time.perf_counter()
            save(i)
            blocked.append(time.perf_counter() - t0)
    _sync(device)
    return time.perf_counter() - start, blocked


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="medium")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=300, help="steps per run (one run without, one with saves)")
    p.add_argument("--every", type=int, default=50, help="save every N steps in the second run")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--snapshot", choices=["auto", "device", "host"], default="auto")
    p.add_argument("--max-pending", type=int, default=1)
    p.add_argument("--codec", default="auto")
    p.add_argument("--dir", default=None, help="where checkpoints go (a fresh temporary directory inside it)")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args()
    device = torch.device(args.device)

    step, state = _make_step(args, device)
    for _ in range(args.warmup):
        step()
    copy_s, nbytes, ntensors = _copy_seconds(state(0), device)

    plain_s, _ = _train(step, args.steps, device, None, args.every)
    commit_s: list[float] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        _sync(device)
        t0 = time.perf_counter()
        ckptzip.save(state(0), Path(directory) / "sync.ckz", codec=args.codec)
        _sync(device)
        sync_save_s = time.perf_counter() - t0
        manager = CheckpointManager(
            directory, keep_last=2, codec=args.codec, max_pending=args.max_pending, snapshot=args.snapshot
        )

        def save(n: int) -> None:
            begun = time.perf_counter()
            manager.save(n, state(n)).add_done_callback(lambda _: commit_s.append(time.perf_counter() - begun))

        ckpt_s, blocked = _train(step, args.steps, device, save, args.every)
        t0 = time.perf_counter()
        manager.close()
        drain_s = time.perf_counter() - t0

    per_save_s = max(ckpt_s - plain_s, 0.0) / len(blocked)
    results = {
        "preset": args.preset,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "snapshot": args.snapshot,
        "codec": args.codec,
        "state_bytes": nbytes,
        "state_tensors": ntensors,
        "d2d_copy_ms": 1e3 * copy_s,
        "blocking_ms_median": 1e3 * statistics.median(blocked),
        "blocking_ms_max": 1e3 * max(blocked),
        "blocking_over_copy": statistics.median(blocked) / copy_s,
        "sync_ckptzip_save_ms": 1e3 * sync_save_s,
        "save_to_commit_s_median": statistics.median(commit_s),
        "drain_at_close_s": drain_s,
        "steps_per_s_plain": args.steps / plain_s,
        "steps_per_s_ckpt": args.steps / ckpt_s,
        "saves": len(blocked),
        "every": args.every,
        "throughput_ratio_measured": plain_s / ckpt_s,
        "overhead_per_save_s": per_save_s,
        "throughput_ratio_one_save_per_minute": 60.0 / (60.0 + per_save_s),
    }
    width = max(map(len, results))
    for key, value in results.items():
        print(f"{key:<{width}}  {value:.4g}" if isinstance(value, float) else f"{key:<{width}}  {value}")
    print(
        f"targets: blocking <= 2 x copy: {'PASS' if results['blocking_over_copy'] <= 2 else 'FAIL'}; "
        f">= 95 % throughput at 1 save/min: "
        f"{'PASS' if results['throughput_ratio_one_save_per_minute'] >= 0.95 else 'FAIL'}"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
