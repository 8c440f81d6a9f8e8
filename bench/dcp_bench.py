"""ckptzip.dcp against DCP's FileSystemWriter (plain and with its zstd stream extension).

N ranks (one process each, no torchrun; one GPU each with NCCL) train an FSDP2-sharded
transformer with AdamW for a few steps, then save the same sharded state with every method,
through ``dcp.save`` and ``dcp.async_save``. M ranks (``--load-nproc``, default N) then load each
checkpoint into a differently initialised model, resharding when M != N, and compare every
tensor bit for bit (a hash of each unsharded tensor). Prints bytes on disk, save / load seconds
and throughput (aggregate and per rank) per method::

    python bench/dcp_bench.py                                          # 1 CPU rank, tiny model
    python bench/dcp_bench.py --nproc 4 --load-nproc 2                 # CPU, gloo, resharding
    python bench/dcp_bench.py --backend nccl --preset medium           # one GPU
    python bench/dcp_bench.py --backend nccl --nproc 2 --load-nproc 1 --preset medium --json out.json

Throughput is uncompressed tensor bytes per second. "blocked" is the time ``dcp.async_save``
kept the training loop waiting (staging to CPU memory); "total" runs until its future resolves.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ckptzip.checksum import xxh3_hex
from ckptzip.dcp import CompressedStorageReader, CompressedStorageWriter
from ckptzip_bench.launch import launch
from ckptzip.demo.training import PRESETS, Transformer, get_preset, load_corpus

METHODS: dict[str, tuple[Callable[[Path, argparse.Namespace], Any], Callable[[Path], Any]]] = {
    "dcp": (lambda path, args: FileSystemWriter(path), FileSystemReader),
    "dcp-zstd": (lambda path, args: FileSystemWriter(path, _extensions=[ZStandard()]), FileSystemReader),
    "ckptzip": (lambda path, args: CompressedStorageWriter(path, codec=args.codec), CompressedStorageReader),
}
MODES = ("save", "async")


def _device(args: argparse.Namespace) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if args.backend == "nccl" else torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _sharded_model(args: argparse.Namespace, world: int, seed: int) -> Transformer:
    device = _device(args)
    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(seed)
    model = Transformer(get_preset(args.preset)).to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(model: Transformer, args: argparse.Namespace, steps: int, seed: int) -> torch.optim.Optimizer:
    """AdamW steps on the standard-library byte corpus; every rank sees the same batches."""
    device = _device(args)
    config = model.config
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    corpus = load_corpus(4 << 20).to(device)
    window = torch.arange(config.seq_len + 1, device=device)
    batches = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        offsets = torch.randint(0, corpus.numel() - config.seq_len - 1, (args.batch_size, 1), generator=batches)
        chunk = corpus[offsets.to(device) + window].long()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits, aux = model(chunk[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten())
        (loss + 0.01 * aux).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return optimizer


def _state(model: Transformer, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "step": step}


def _leaves(obj: Any, path: str = "") -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [leaf for key, value in obj.items() for leaf in _leaves(value, f"{path}.{key}" if path else str(key))]
    if isinstance(obj, (list, tuple)):
        return [leaf for i, value in enumerate(obj) for leaf in _leaves(value, f"{path}[{i}]")]
    return [(path, obj)]


def _local_nbytes(state: dict[str, Any]) -> int:
    """Tensor bytes this rank holds (its shards)."""
    total = 0
    for _, value in _leaves(state):
        if isinstance(value, torch.Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value
            total += local.numel() * local.element_size()
    return total


def _fingerprint(state: dict[str, Any], rank: int) -> dict[str, str]:
    """A sharding-independent digest of every value (collective; the result is on rank 0)."""
    digest = {}
    for path, value in _leaves(state):
        if isinstance(value, torch.Tensor):
            full = value.full_tensor() if isinstance(value, DTensor) else value
            if rank == 0:
                data = full.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                digest[path] = f"{full.dtype}{list(full.shape)}:{xxh3_hex(data)}"
        elif rank == 0:
            digest[path] = repr(value)
    return digest


def _files_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def _save_worker(rank: int, world: int, args: argparse.Namespace) -> None:
    device = _device(args)
    model = _sharded_model(args, world, seed=0)
    optimizer = _train(model, args, args.steps, seed=1)
    state = _state(model, optimizer, args.steps)
    result: dict[str, Any] = {"raw_bytes": _local_nbytes(state), "runs": {}}
    for method in args.methods:
        for mode in MODES:
            path = args.dir / f"{method}-{mode}"
            writer = METHODS[method][0](path, args)
            _sync(device)
            start = time.perf_counter()
            if mode == "save":
                dcp.save(state, storage_writer=writer)
                blocked = time.perf_counter() - start
            else:
                future = dcp.async_save(state, storage_writer=writer)
                blocked = time.perf_counter() - start
                future.result()
            total = time.perf_counter() - start
            result["runs"][f"{method}-{mode}"] = {"blocked": blocked, "total": total}
            _sync(device)
    fingerprint = _fingerprint(state, rank)
    if rank == 0:
        (args.dir / "fingerprint.json").write_text(json.dumps(fingerprint))
    (args.dir / f"save-{rank}.json").write_text(json.dumps(result))


def _load_worker(rank: int, world: int, args: argparse.Namespace) -> None:
    device = _device(args)
    expected = json.loads((args.dir / "fingerprint.json").read_text()) if rank == 0 else {}
    result: dict[str, Any] = {"runs": {}}
    for method in args.methods:
        for mode in MODES:
            name = f"{method}-{mode}"
            model = _sharded_model(args, world, seed=10)
            optimizer = _train(model, args, 1, seed=11)  # creates the optimizer state to load into
            state = _state(model, optimizer, 0)
            result["raw_bytes"] = _local_nbytes(state)
            _sync(device)
            start = time.perf_counter()
            dcp.load(state, storage_reader=METHODS[method][1](args.dir / name))
            _sync(device)
            seconds = time.perf_counter() - start
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            fingerprint = _fingerprint(state, rank)
            result["runs"][name] = {"seconds": seconds, "bit_exact": fingerprint == expected if rank == 0 else None}
    (args.dir / f"load-{rank}.json").write_text(json.dumps(result))


def _gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _report(args: argparse.Namespace) -> dict[str, Any]:
    saves = [json.loads((args.dir / f"save-{r}.json").read_text()) for r in range(args.nproc)]
    loads = [json.loads((args.dir / f"load-{r}.json").read_text()) for r in range(args.load_nproc)]
    raw = sum(s["raw_bytes"] for s in saves)
    rows = []
    for method in args.methods:
        for mode in MODES:
            name = f"{method}-{mode}"
            save_s = [s["runs"][name]["total"] for s in saves]
            load_s = [r["runs"][name]["seconds"] for r in loads]
            rows.append({
                "method": name,
                "bytes": _files_bytes(args.dir / name),
                "save_s": max(save_s),
                "blocked_s": max(s["runs"][name]["blocked"] for s in saves),
                "save_gbps": _gbps(raw, max(save_s)),
                "save_rank_gbps": [_gbps(s["raw_bytes"], s["runs"][name]["total"]) for s in saves],
                "load_s": max(load_s),
                "load_gbps": _gbps(raw, max(load_s)),
                "load_rank_gbps": [_gbps(r["raw_bytes"], r["runs"][name]["seconds"]) for r in loads],
                "bit_exact": loads[0]["runs"][name]["bit_exact"],
            })
    return {
        "torch": torch.__version__,
        "backend": args.backend,
        "preset": args.preset,
        "steps": args.steps,
        "save_ranks": args.nproc,
        "load_ranks": args.load_nproc,
        "raw_bytes": raw,
        "rows": rows,
    }


def _print(report: dict[str, Any]) -> None:
    print(
        f"torch {report['torch']}, {report['backend']}, preset {report['preset']}, "
        f"{report['steps']} steps; ranks: {report['save_ranks']} saving, {report['load_ranks']} loading; "
        f"tensor bytes {report['raw_bytes'] / 1e6:.1f} MB"
    )
    header = (
        f"{'method':<16}{'MB on disk':>11}{'ratio':>7}{'save s':>8}{'blocked s':>10}{'GB/s':>7}"
        f"{'min rank':>9}{'load s':>8}{'GB/s':>7}{'min rank':>9}  bit-exact"
    )
    print(header)
    print("-" * len(header))
    for row in report["rows"]:
        print(
            f"{row['method']:<16}{row['bytes'] / 1e6:>11.2f}{report['raw_bytes'] / row['bytes']:>7.3f}"
            f"{row['save_s']:>8.2f}{row['blocked_s']:>10.2f}{row['save_gbps']:>7.2f}"
            f"{min(row['save_rank_gbps']):>9.2f}{row['load_s']:>8.2f}{row['load_gbps']:>7.2f}"
            f"{min(row['load_rank_gbps']):>9.2f}  {row['bit_exact']}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=1, help="ranks that train and save (one GPU each with nccl)")
    parser.add_argument("--load-nproc", type=int, default=None, help="ranks that load (default: --nproc)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="gloo: CPU ranks; nccl: GPUs")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model size (ckptzip.demo.training)")
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps before saving")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--codec", default="auto", help="ckptzip preset or codec id")
    parser.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=list(METHODS))
    parser.add_argument("--dir", type=Path, default=None, help="where checkpoints go (default: a temporary dir)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    args.load_nproc = args.load_nproc or args.nproc
    owned = args.dir is None
    args.dir = Path(tempfile.mkdtemp(prefix="dcp-bench-")) if owned else args.dir
    args.dir.mkdir(parents=True, exist_ok=True)
    # async_save needs a CPU process group next to NCCL.
    backend = "cpu:gloo,cuda:nccl" if args.backend == "nccl" else "gloo"
    try:
        launch(_save_worker, args.nproc, args, backend=backend)
        launch(_load_worker, args.load_nproc, args, backend=backend)
        report = _report(args)
    finally:
        if owned and not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    _print(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if all(row["bit_exact"] for row in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
