"""torchtitan's training loop on one GPU with ckptzip's checkpoint manager against torchtitan's own.

A torchtitan llama3 flavor (``--flavor``, default 1B) is trained with torchtitan's AdamW and
warm-up scheduler on random tokens (real forward and backward, bf16 autocast, flex attention); every
``--interval`` steps the manager checkpoints model, optimizer, scheduler and train state. For
each manager (``ckptzip``: :class:`ckptzip.integrations.torchtitan.CompressedCheckpointManager`;
``torchtitan``: its ``CheckpointManager`` with DCP's ``FileSystemWriter``) and async mode, it
reports how long each ``save`` held the training loop, the steps' time, the bytes of a step
directory, and whether a fresh manager's ``load()`` restores the last step bit-exactly.

    python bench/torchtitan_gpu.py --flavor 1B --steps 30 --interval 10 --modes disabled,async

torchtitan 0.3.0 needs a torch with ``torch.distributed.fsdp.DataParallelMeshDims`` (2.13 has it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import default_adamw
from torchtitan.models.llama3 import model_registry

from ckptzip.integrations.torchtitan import CompressedCheckpointManager


class TrainState:
    """What torchtitan's trainer checkpoints about itself."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


class Run:
    """A model of ``flavor`` on the GPU with its optimizer, scheduler and a checkpoint manager."""

    def __init__(self, args: argparse.Namespace, kind: str, mode: str, root: str, seed: int) -> None:
        torch.manual_seed(seed)
        with torch.device("cuda"):
            self.model = model_registry(args.flavor).model.build()
            self.model.init_states()
        self.vocab = self.model.tok_embeddings.num_embeddings
        self.optimizers = default_adamw(lr=3e-4, implementation="fused").build(model_parts=[self.model])
        self.schedulers = LRSchedulersContainer.Config(warmup_steps=5).build(optimizers=self.optimizers,
                                                                              training_steps=args.steps)
        self.train = TrainState()
        manager = CompressedCheckpointManager if kind == "ckptzip" else CheckpointManager
        config = manager.Config(enable=True, folder="checkpoint", interval=args.interval, async_mode=mode,
                                keep_latest_k=1, last_save_model_only=False)
        self.manager = config.build(
            dataloader=None, model_parts=[self.model], optimizers=self.optimizers, lr_schedulers=self.schedulers,
            states={"train_state": self.train}, sd_adapter=None, base_folder=root,
        )
        self.batch, self.seq = args.batch, args.seq
        positions = torch.arange(self.seq, device="cuda").expand(self.batch, self.seq)
        self.masks = self.model.get_attention_masks(positions)  # causal, for flex attention

    def step(self) -> None:
        self.train.step += 1
        g = torch.Generator(device="cuda").manual_seed(self.train.step)
        tokens = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=g, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = self.model(tokens[:, :-1], attention_masks=self.masks)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        self.optimizers.step()
        self.schedulers.step()
        self.optimizers.zero_grad()

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizers.state_dict()}


def host_copy(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: host_copy(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(host_copy(v) for v in state)
    return state


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
                and torch.equal(a.detach().cpu().reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def one(args: argparse.Namespace, kind: str, mode: str) -> dict[str, Any]:
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        run = Run(args, kind, mode, root, seed=0)
        state_bytes = sum(t.numel() * t.element_size() for t in run.model.parameters()) * 3  # weights, 2 moments
        holds, steps = [], []
        for _ in range(args.steps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            run.step()
            torch.cuda.synchronize()
            steps.append(time.perf_counter() - t)
            t = time.perf_counter()
            run.manager.save(run.train.step, last_step=run.train.step == args.steps)
            run.manager.maybe_wait_for_staging()
            torch.cuda.synchronize()
            if run.train.step % args.interval == 0:
                holds.append(round(time.perf_counter() - t, 3))
        expected = host_copy(run.state())
        t = time.perf_counter()
        run.manager.maybe_wait_for_saving()
        drain = time.perf_counter() - t
        run.manager.close()
        step_dir = os.path.join(root, "checkpoint", f"step-{args.steps}")
        stored = directory_bytes(step_dir)
        del run
        torch.cuda.empty_cache()
        resumed = Run(args, kind, mode, root, seed=1)
        torch.cuda.synchronize()
        t = time.perf_counter()
        loaded = resumed.manager.load()
        torch.cuda.synchronize()
        load_s = time.perf_counter() - t
        exact = bool(loaded) and resumed.train.step == args.steps and same(resumed.state(), expected)
        resumed.manager.close()
        del resumed, expected
        torch.cuda.empty_cache()
        return {"manager": kind, "mode": mode, "flavor": args.flavor, "state_gb": round(state_bytes / 1e9, 2),
                "save_holds_s": holds, "step_median_s": round(statistics.median(steps), 3),
                "last_save_drain_s": round(drain, 3), "step_dir_gb": round(stored / 1e9, 3),
                "files": sorted(os.listdir(step_dir)), "load_s": round(load_s, 3), "resume_bit_exact": exact}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="1B")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--interval", type=int, default=10)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--modes", default="disabled,async")
    p.add_argument("--managers", default="ckptzip,torchtitan")
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("cuda:nccl,cpu:gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        for mode in args.modes.split(","):
            for kind in args.managers.split(","):
                try:
                    row = one(args, kind, mode)
                except Exception as exc:  # a failure is a result too
                    row = {"manager": kind, "mode": mode, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
                print(json.dumps(row), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
