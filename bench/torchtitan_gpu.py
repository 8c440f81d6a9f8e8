"""torchtitan 0.2's own training loop on one GPU, checkpointing with torchtitan's manager and with
ckptzip's, in every async mode, all in one process.

torchtitan's ``Trainer`` (torchtitan 0.2.x: the one torch 2.11 runs) trains its llama3 model
(``debugmodel``, or ``--dim``/``--layers`` for a larger one registered here) with its own data
loader, AdamW, LR schedule and train step; the data set is synthetic text and the tokenizer a
byte-level BPE trained on it here (nothing is downloaded). For each manager and ``async_mode``
(``disabled``, ``async``, ``async_with_pinned_mem``) the trainer checkpoints every
``--interval`` steps (``keep_latest_k=2``) and the script prints one JSON line:

- ``save_call_s``: how long each ``checkpointer.save`` held the loop;
- ``lost_per_checkpoint_s``: the training time a checkpoint cost: the steps' and saves' wall time
  after ``--warmup`` steps, less as many steps of a run without checkpoints (its median), per
  checkpoint (what async writes take from later steps included);
- ``step_dir_gb``: the bytes of one step directory; ``load_s``: a fresh trainer's
  ``checkpointer.load`` of that step; ``resume_bit_exact``: whether the model and optimizer it
  loaded are, bit for bit, what they were when that step was saved.

Managers: ``torchtitan`` (its ``CheckpointManager``: DCP's ``FileSystemWriter``; in
``async_with_pinned_mem`` a new pinned stager each save, since torch 2.11 cannot reuse one), ``ckptzip``
(``CompressedCheckpointManager``: ckptzip's DCP storage), ``torch_checkpointing`` (each step
through torch_checkpointing, nothing coded) and ``ckptzip_tc`` (``CompressedTorchCheckpointingManager``:
torch_checkpointing with the model and optimizer coded by ckptzip).

    python bench/torchtitan_gpu.py --steps 40 --interval 10
    python bench/torchtitan_gpu.py --dim 2048 --layers 16 --batch 2 --seq 2048 --modes async

Needs torchtitan 0.2 and torchdata (``pip install --no-deps``), tokenizers, and, for the
torch_checkpointing managers, torch_checkpointing; TensorBoard and Hugging Face ``datasets`` are
used by none of this (:mod:`ckptzip_bench.titan`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ckptzip_bench.titan import without_unused_extras

MODES = ("disabled", "async", "async_with_pinned_mem")
WORDS = ("the model learns weights of layers that shift by small steps while loss falls over many tokens and "
         "each batch of text passes through attention heads feed forward blocks norms and an output head").split()


class Texts:
    """Synthetic ``{"text": ...}`` samples that checkpoint their position, as a streaming data set
    does for torchtitan's text data set (``state_dict``, ``load_state_dict``, ``set_epoch``)."""

    def __init__(self, count: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.texts = [" ".join(rng.choices(WORDS, k=rng.randint(20, 120))) for _ in range(count)]
        self.position, self.epoch = 0, 0

    def __iter__(self) -> Iterator[dict[str, str]]:
        while self.position < len(self.texts):
            self.position += 1
            yield {"text": self.texts[self.position - 1]}

    def set_epoch(self, epoch: int) -> None:
        self.position, self.epoch = 0, epoch

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position, self.epoch = state["position"], state["epoch"]


def make_tokenizer(folder: str, texts: list[str]) -> None:
    """A byte-level BPE of 2048 tokens (the debug model's vocabulary) trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    special = ["<|begin_of_text|>", "<|end_of_text|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=2048, special_tokens=special,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": special[0], "eos_token": special[1]}, f)


def register(args: argparse.Namespace, texts: Texts) -> str:
    """The data set (``ckptzip_bench``) and, with --dim, a llama3 flavor; returns the flavor."""
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets import text_datasets
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model.args import TransformerModelArgs

    split = text_datasets.split_dataset_by_node
    text_datasets.split_dataset_by_node = lambda ds, rank, world: ds if isinstance(ds, Texts) else split(ds, rank, world)
    text_datasets.DATASETS["ckptzip_bench"] = DatasetConfig(path="synthetic", loader=lambda path: texts,
                                                            sample_processor=lambda sample: sample["text"])
    if args.dim is None:
        return "debugmodel"
    llama3_args["ckptzip_bench"] = TransformerModelArgs(dim=args.dim, n_layers=args.layers, n_heads=args.dim // 128,
                                                        vocab_size=2048, rope_theta=500000)
    return "ckptzip_bench"


def managers() -> dict[str, type]:
    from torchtitan.components.checkpoint import CheckpointManager

    from ckptzip.integrations.torchtitan import CompressedCheckpointManager, CompressedTorchCheckpointingManager

    class TorchCheckpointing(CompressedTorchCheckpointingManager):
        """Each step through torch_checkpointing, nothing coded: its own files."""

        coded_states = ()

    class Torchtitan(CheckpointManager):  # type: ignore[misc]
        """torchtitan's manager with a new pinned stager for each save in async_with_pinned_mem:
        torchtitan 0.2 reuses one, and torch 2.11 leaves a DefaultStager unusable after its first
        async_save (KeyError: <class 'type'>); the old one goes once its save is written."""

        def save(self, curr_step: int, last_step: bool = False) -> None:
            if self.stager is not None and self._should_save(curr_step, last_step):
                self._async_wait()
                self.stager.close()
                self.stager = None
            super().save(curr_step, last_step)

    return {"torchtitan": Torchtitan, "ckptzip": CompressedCheckpointManager,
            "torch_checkpointing": TorchCheckpointing, "ckptzip_tc": CompressedTorchCheckpointingManager}


def job_config(args: argparse.Namespace, flavor: str, root: str, mode: str | None, steps: int) -> Any:
    from torchtitan.config.job_config import JobConfig

    config = JobConfig()
    config.job.dump_folder = root
    config.model.name, config.model.flavor, config.model.hf_assets_path = "llama3", flavor, args.tokenizer
    config.training.dataset, config.training.steps = "ckptzip_bench", steps
    config.training.local_batch_size, config.training.seq_len = args.batch, args.seq
    config.lr_scheduler.warmup_steps = 2
    config.metrics.log_freq = 1000
    config.debug.seed = 0
    config.checkpoint.enable = mode is not None
    config.checkpoint.async_mode = mode or "disabled"
    config.checkpoint.interval = args.interval
    config.checkpoint.keep_latest_k = 2
    config.checkpoint.last_save_model_only = False
    return config


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        local = getattr(value, "_local_tensor", value)
        return local.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: host_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(host_copy(v) for v in value)
    return value


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        a = getattr(a, "_local_tensor", a).detach().cpu()
        return (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def trained(args: argparse.Namespace, flavor: str, cls: type | None, mode: str | None, root: str
            ) -> tuple[list[float], list[float], Any]:
    """Train ``args.steps`` steps; per step its wall time and its save's, and the model and
    optimizer as they were when step ``args.check_step`` was saved."""
    import torchtitan.train
    from torchtitan.components.checkpoint import MODEL, OPTIMIZER

    if cls is not None:
        torchtitan.train.CheckpointManager = cls  # torchtitan 0.2's trainer builds it by this name
    trainer = torchtitan.train.Trainer(job_config(args, flavor, root, mode, args.steps))
    steps: list[float] = []
    saves: list[float] = []
    snapshot: dict[str, Any] = {}
    train_step, save = trainer.train_step, trainer.checkpointer.save

    def timed_step(data: Any) -> None:
        sync()
        t = time.perf_counter()
        train_step(data)
        sync()
        steps.append(time.perf_counter() - t)

    def timed_save(curr_step: int, last_step: bool = False) -> None:
        t = time.perf_counter()
        save(curr_step, last_step=last_step)
        sync()
        saves.append(time.perf_counter() - t)
        if curr_step == args.check_step:  # what the step holds (the loop has not changed it yet)
            states = trainer.checkpointer.states
            snapshot.update(model=host_copy(states[MODEL].state_dict()), optim=host_copy(states[OPTIMIZER].state_dict()))

    trainer.train_step, trainer.checkpointer.save = timed_step, timed_save
    try:
        trainer.train()
        if mode is not None:
            trainer.checkpointer._async_wait()  # the last save written (torchtitan 0.2's trainer leaves it to close)
    finally:
        trainer.close()
        dist.destroy_process_group()
    return steps, saves, snapshot


def resumed(args: argparse.Namespace, flavor: str, cls: type, mode: str, root: str, snapshot: Any) -> tuple[float, bool]:
    """A fresh trainer loading step ``args.check_step``: seconds, and whether it is bit-exact."""
    import torchtitan.train
    from torchtitan.components.checkpoint import MODEL, OPTIMIZER

    torchtitan.train.CheckpointManager = cls
    trainer = torchtitan.train.Trainer(job_config(args, flavor, root, mode, args.steps))
    try:
        sync()
        t = time.perf_counter()
        loaded = trainer.checkpointer.load(step=args.check_step)
        sync()
        seconds = time.perf_counter() - t
        states = trainer.checkpointer.states
        exact = bool(loaded) and same(states[MODEL].state_dict(), snapshot["model"]) and same(
            states[OPTIMIZER].state_dict(), snapshot["optim"])
    finally:
        trainer.close()
        dist.destroy_process_group()
    return seconds, exact


def one(args: argparse.Namespace, flavor: str, name: str, cls: type, mode: str, reference: float) -> dict[str, Any]:
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        steps, saves, snapshot = trained(args, flavor, cls, mode, root)
        measured = range(args.warmup, args.steps - 1)  # the last step's save is a synchronous full save
        checkpoints = sum((k + 1) % args.interval == 0 for k in measured)
        wall = sum(steps[k] + saves[k] for k in measured)
        step_dir = os.path.join(root, "checkpoint", f"step-{args.check_step}")
        stored = directory_bytes(step_dir)
        files = sorted(os.listdir(step_dir))
        load_s, exact = resumed(args, flavor, cls, mode, root, snapshot)
        return {"manager": name, "mode": mode, "flavor": flavor, "steps": args.steps, "interval": args.interval,
                "step_median_s": round(statistics.median(steps[args.warmup:]), 4),
                "save_call_s": [round(saves[k], 3) for k in measured if (k + 1) % args.interval == 0],
                "lost_per_checkpoint_s": round((wall - len(measured) * reference) / max(checkpoints, 1), 3),
                "step_dir_gb": round(stored / 1e9, 4), "files": files, "load_s": round(load_s, 3),
                "resume_bit_exact": exact}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--interval", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the timings")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--dim", type=int, default=None, help="a larger llama3 (with --layers) instead of debugmodel")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--managers", default="torchtitan,ckptzip,torch_checkpointing,ckptzip_tc")
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    args.check_step = (args.steps - 1) // args.interval * args.interval  # the last interval step: saved as in training
    without_unused_extras()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    base = tempfile.mkdtemp(dir=args.dir)
    texts = Texts(count=max(2000, args.steps * args.batch * args.seq // 40))
    args.dir, args.tokenizer = base, os.path.join(base, "tokenizer")
    make_tokenizer(args.tokenizer, texts.texts[:2000])
    flavor = register(args, texts)
    import torchtitan

    print(json.dumps({"torch": torch.__version__, "torchtitan": torchtitan.__version__,
                      "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}), flush=True)
    texts.set_epoch(0)
    steps, _, _ = trained(args, flavor, None, None, tempfile.mkdtemp(dir=base))  # no checkpoints: the reference
    reference = statistics.median(steps[args.warmup:])
    print(json.dumps({"manager": "none", "flavor": flavor, "step_median_s": round(reference, 4)}), flush=True)
    table = managers()
    try:
        for mode in args.modes.split(","):
            for name in args.managers.split(","):
                texts.set_epoch(0)
                try:
                    row = one(args, flavor, name, table[name], mode, reference)
                except Exception as exc:  # a failure is a result too
                    row = {"manager": name, "mode": mode, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
                    if dist.is_initialized():
                        dist.destroy_process_group()
                print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
