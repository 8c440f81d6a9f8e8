"""DeepSpeed on GPUs with ckptzip's checkpoint engine: real ``deepspeed.initialize`` (ZeRO, bf16),
train, ``save_checkpoint`` with DeepSpeed's own engine and with ``CkptzipCheckpointEngine``,
``load_checkpoint`` into a differently initialised engine, and resume. Checks, per engine, that
the loaded module and optimizer state is bit-identical to what was saved, and that the resumed run
is bit-identical to an uninterrupted one. Prints one JSON line: bytes, save and load seconds per engine.

    python bench/deepspeed_gpu.py                          # 1 GPU, ZeRO-2, the "tiny" transformer
    python bench/deepspeed_gpu.py --nproc 2 --stage 3 --preset medium --json $OUT/deepspeed.json

Each rank is a process started here (NCCL, rank r on GPU r); no ``deepspeed`` launcher. Needs
``pip install 'ckptzip[deepspeed,gpu]'``; nothing of DeepSpeed is compiled (its optimizer here is
torch's AdamW, ``torch_adam``), so neither a compiler nor ninja is used.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from _resume import arguments, checked, differing, run, state_bytes, write_report
from ckptzip.demo.training import Transformer, get_preset, load_corpus


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


def _digest(engine: Any) -> dict[str, bytes]:
    """Every tensor of the module and optimizer state, as bytes (compared across runs)."""
    return state_bytes({"module": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict()})


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
        saved = _digest(engine)
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
        loaded = differing(_digest(resumed), saved)
        train(resumed, args.steps)
        resumed_same = differing(_digest(resumed), expected)
        results[name] = checked(directory, save_s, load_s, loaded, resumed_same, world)
        del resumed
    if rank == 0:
        import deepspeed

        write_report(root, {"bench": "deepspeed", "preset": args.preset, "stage": args.stage, "nproc": world,
                            "steps": args.steps, "deepspeed": deepspeed.__version__}, results)


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    parser.add_argument("--preset", default="tiny")
    run(_worker, parser.parse_args())


if __name__ == "__main__":
    main()
