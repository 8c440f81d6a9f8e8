"""DeepSpeed on GPUs with ckptzip's checkpoint engine: real ``deepspeed.initialize`` (ZeRO, bf16),
train, ``save_checkpoint`` with DeepSpeed's own engine and with ``CkptzipCheckpointEngine``,
``load_checkpoint`` into a differently initialised engine, resume, and check that the resumed run
is bit-identical to an uninterrupted one. Prints (and with --json writes) bytes, save and load
seconds per engine.

    python bench/deepspeed_gpu.py                          # 1 GPU, ZeRO-2, the "tiny" transformer
    python bench/deepspeed_gpu.py --nproc 2 --stage 3 --preset medium --json $OUT/deepspeed.json

Each rank is a process started here (NCCL, rank r on GPU r); no ``deepspeed`` launcher. Needs
``pip install 'ckptzip[deepspeed,gpu]'`` with DS_BUILD_OPS=0 (the optimizer is torch's AdamW, so
no DeepSpeed C++/CUDA op is compiled).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ckptzip.bench.training import Transformer, get_preset, load_corpus
from ckptzip.dcp._launch import launch


def _engine(args: argparse.Namespace, seed: int) -> Any:
    import deepspeed

    torch.manual_seed(seed)
    model = Transformer(get_preset(args.preset))
    config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}},
        "zero_optimization": {"stage": args.stage},
        "bf16": {"enabled": True},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _train(engine: Any, corpus: torch.Tensor, first: int, steps: int, seq_len: int, batch_size: int) -> None:
    window = torch.arange(seq_len + 1, device=corpus.device)
    for step in range(first, first + steps):
        generator = torch.Generator(device=corpus.device).manual_seed(1000 * step + engine.global_rank)
        offsets = torch.randint(0, corpus.numel() - seq_len - 1, (batch_size, 1), device=corpus.device,
                                generator=generator)
        chunk = corpus[offsets + window].long()
        logits, aux = engine(chunk[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten()) + 0.01 * aux
        engine.backward(loss)
        engine.step()


def _digest(engine: Any) -> list[tuple[str, bytes]]:
    """Every tensor of the module and optimizer state, as bytes (compared across runs)."""
    out: list[tuple[str, bytes]] = []

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, torch.Tensor):
            out.append((path, obj.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()))
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}.{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}.{i}")

    walk(engine.module.state_dict(), "module")
    walk(engine.optimizer.state_dict(), "optimizer")
    return out


def _worker(rank: int, world: int, args: argparse.Namespace, root: Path) -> None:
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    from ckptzip.integrations.deepspeed import CkptzipCheckpointEngine

    os.environ["LOCAL_RANK"] = str(rank)
    config = get_preset(args.preset)
    corpus = load_corpus().cuda()

    def train(engine: Any, first: int) -> None:
        _train(engine, corpus, first, args.steps, config.seq_len, args.batch_size)

    reference = _engine(args, seed=0)
    train(reference, 0)
    train(reference, args.steps)
    expected = _digest(reference)
    del reference

    results: dict[str, Any] = {}
    for name, make in (("torch", TorchCheckpointEngine), ("ckptzip", CkptzipCheckpointEngine)):
        directory = root / name
        engine = _engine(args, seed=0)
        engine.checkpoint_engine = make()
        train(engine, 0)
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.save_checkpoint(str(directory))
        save_s = time.perf_counter() - start
        del engine
        resumed = _engine(args, seed=1)
        resumed.checkpoint_engine = make()
        dist.barrier()
        start = time.perf_counter()
        resumed.load_checkpoint(str(directory))
        torch.cuda.synchronize()
        load_s = time.perf_counter() - start
        train(resumed, args.steps)
        same = _digest(resumed) == expected
        flags = [None] * world
        dist.all_gather_object(flags, same)
        nbytes = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
        results[name] = {"bytes": nbytes, "save_s": save_s, "load_s": load_s, "resume_bit_exact": all(flags)}
        del resumed
    if rank == 0:
        report = {"preset": args.preset, "stage": args.stage, "nproc": world, "steps": args.steps,
                  "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "engines": results}
        print(json.dumps(report, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
        if not all(r["resume_bit_exact"] for r in results.values()):
            raise SystemExit("a resumed run differs from the uninterrupted one")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=5, help="steps before the save, and again after it")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        launch(_worker, args.nproc, args, Path(root), backend="nccl")


if __name__ == "__main__":
    main()
