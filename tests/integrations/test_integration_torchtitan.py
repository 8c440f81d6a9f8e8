"""ckptzip.integrations.torchtitan with torchtitan's own llama3 debug model, optimizer and LR
scheduler containers, on torchtitan 0.3 (installed) and 0.2: both managers (ckptzip's DCP
storage; torch_checkpointing with ckptzip's items) save in every async mode, keep the latest
steps, and a fresh run resumes from the latest step bit-exactly (model, AdamW moments,
scheduler, train state).

torchtitan's flex attention has no backward on the CPU, so the steps apply seeded gradients
instead of backpropagating a loss; what is checkpointed is the same.

torchtitan 0.2 runs in a process of its own (this file as a script) with a ``--target``
install of it first on the path: ``make test`` installs it into ``<venv>/torchtitan-0.2``
without its requirements. It imports TensorBoard and Hugging Face ``datasets`` when its model
module loads and uses neither here: where they are missing, stand-ins that refuse to be used
take their place (:func:`ckptzip_bench.titan.without_unused_extras`).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

MODES = ("disabled", "async", "async_with_pinned_mem")
MANAGERS = ("CompressedCheckpointManager", "CompressedTorchCheckpointingManager")
TORCHTITAN_02 = Path(sys.prefix) / "torchtitan-0.2"  # pip install --no-deps --target ... torchtitan==0.2.2 torchdata


class _TrainState:
    """What torchtitan's trainer checkpoints about itself, with a data loader position as bytes."""

    def __init__(self) -> None:
        self.step = 0
        self.loader = io.BytesIO()

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "loader": io.BytesIO(f"tokens read at step {self.step}".encode())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.loader = state["step"], state["loader"]


class _Run:
    """The debug model with torchtitan's AdamW and warm-up scheduler, and a manager over ``root``."""

    def __init__(self, root: Path, manager: str, mode: str, seed: int) -> None:
        from ckptzip.integrations import torchtitan as integration

        cls = getattr(integration, manager)
        torch.manual_seed(seed)
        self.train = _TrainState()
        fields = {"enable": True, "folder": mode, "interval": 2, "async_mode": mode, "keep_latest_k": 2,
                  "last_save_model_only": False}
        if hasattr(cls, "Config"):  # torchtitan 0.3: components built from Config dataclasses
            from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
            from torchtitan.components.optimizer.optimizer import default_adamw
            from torchtitan.models.llama3 import model_registry

            self.model = model_registry("debugmodel").model.build()
            self.model.init_states()
            self.optimizers = default_adamw(lr=8e-4, implementation="for-loop").build(model_parts=[self.model])
            self.schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=self.optimizers,
                                                                                  training_steps=10)
            self.manager = cls.Config(**fields).build(
                dataloader=None, model_parts=[self.model], optimizers=self.optimizers,
                lr_schedulers=self.schedulers, states={"train_state": self.train}, sd_adapter=None,
                base_folder=str(root))
        else:  # torchtitan 0.2: the job config's sections
            from torchtitan.components.lr_scheduler import build_lr_schedulers
            from torchtitan.components.optimizer import build_optimizers
            from torchtitan.config.job_config import Checkpoint, LRScheduler, Optimizer
            from torchtitan.distributed.parallel_dims import ParallelDims
            from torchtitan.models.llama3 import Transformer, llama3_args

            self.model = Transformer(llama3_args["debugmodel"])
            with torch.no_grad():  # as torchtitan 0.2's trainer initialises it
                self.model.init_weights()
            dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
            self.optimizers = build_optimizers([self.model], Optimizer(lr=8e-4, implementation="for-loop"), dims)
            self.schedulers = build_lr_schedulers(self.optimizers, LRScheduler(warmup_steps=2), training_steps=10)
            self.manager = cls(
                dataloader=None, model_parts=[self.model], optimizers=self.optimizers,
                lr_schedulers=self.schedulers, states={"train_state": self.train},
                checkpoint_config=Checkpoint(**fields), sd_adapter=None, base_folder=str(root))
        assert type(self.manager) is cls

    def step(self) -> None:
        self.train.step += 1
        generator = torch.Generator().manual_seed(self.train.step)
        for param in self.model.parameters():
            param.grad = torch.randn(param.shape, generator=generator).to(param.dtype) * 1e-2
        self.optimizers.step()
        self.schedulers.step()
        self.optimizers.zero_grad()

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizers.state_dict(),
                "lr": self.schedulers.state_dict(), "step": self.train.step}


def _cpu_stager(run: _Run) -> None:
    """torchtitan makes a pinned-memory stager in this mode, which needs an accelerator; on the CPU
    one without pinned memory stands in (ckptzip's managers stage without it: the checkpoint
    process is what the mode keeps)."""
    if run.manager.async_mode == "async_with_pinned_mem" and not torch.accelerator.is_available():
        run.manager.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                                          use_async_staging=True, use_non_blocking_copy=False))


def _save_and_resume(rank: int, world: int, root: Path, manager: str, mode: str) -> None:
    from importlib.metadata import version

    from ckptzip_bench.titan import without_unused_extras
    from helpers import assert_same

    if version("torchtitan").startswith("0.2."):
        without_unused_extras()
    run = _Run(root, manager, mode, seed=0)
    _cpu_stager(run)
    for _ in range(5):
        run.step()
        run.manager.save(run.train.step)
        run.manager.maybe_wait_for_staging()
    if hasattr(run.manager, "maybe_wait_for_saving"):
        run.manager.maybe_wait_for_saving()
    else:  # torchtitan 0.2 (its trainer waits in its next save, with this)
        run.manager._async_wait()
    run.manager.close()
    assert sorted(os.listdir(root / mode)) == ["step-2", "step-4"], mode  # keep_latest_k=2
    files = sorted(os.listdir(root / mode / "step-4"))
    if manager == "CompressedCheckpointManager":
        assert files == [".metadata.ckz", "__0.ckzd"], files
    else:
        items = ["lr_scheduler_0.pt", "model_0.pt", "optimizer_0.pt", "train_state_0.pt"]
        # torch_checkpointing's synchronous saver writes its metadata with its first step only
        assert files == sorted(items + ([] if mode == "disabled" else ["metadata.pkl"])), files

    resumed = _Run(root, manager, mode, seed=1)
    assert resumed.manager.load()
    assert resumed.train.step == 4 and resumed.train.loader.getvalue() == b"tokens read at step 4", mode
    resumed.step()
    assert_same(resumed.state(), run.state(), f"{manager} {mode}: step 5 after resuming from step 4")
    resumed.manager.close()


def _cases() -> list[Any]:
    return [pytest.param(manager, mode, id=f"{manager}-{mode}") for manager in MANAGERS for mode in MODES]


@pytest.mark.slow
@pytest.mark.parametrize(("manager", "mode"), _cases())
def test_torchtitan_03_saves_with_ckptzip_and_resumes_bit_exactly(tmp_path: Path, manager: str, mode: str) -> None:
    pytest.importorskip("torchtitan")
    if manager == "CompressedTorchCheckpointingManager":
        pytest.importorskip("torch_checkpointing")
    from ckptzip_bench.launch import launch

    launch(_save_and_resume, 1, tmp_path, manager, mode)


@pytest.mark.slow
@pytest.mark.skipif(not (TORCHTITAN_02 / "torchtitan").is_dir(),
                    reason=f"torchtitan 0.2 is not installed in {TORCHTITAN_02} (make test installs it)")
@pytest.mark.parametrize(("manager", "mode"), _cases())
def test_torchtitan_02_saves_with_ckptzip_and_resumes_bit_exactly(tmp_path: Path, manager: str, mode: str) -> None:
    if manager == "CompressedTorchCheckpointingManager":
        pytest.importorskip("torch_checkpointing")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TORCHTITAN_02), *sys.path])}
    done = subprocess.run([sys.executable, __file__, str(tmp_path), manager, mode], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert done.stdout.splitlines()[-1] == "torchtitan 0.2.2: resumed bit-exactly", done.stdout[-2000:]


if __name__ == "__main__":  # torchtitan 0.2, in a process of its own (the test above)
    from importlib.metadata import version

    from ckptzip_bench.titan import without_unused_extras

    without_unused_extras()

    import torchtitan

    assert Path(torchtitan.__file__).is_relative_to(TORCHTITAN_02), torchtitan.__file__
    from ckptzip_bench.launch import launch

    launch(_save_and_resume, 1, Path(sys.argv[1]), sys.argv[2], sys.argv[3])
    print(f"torchtitan {version('torchtitan')}: resumed bit-exactly")
