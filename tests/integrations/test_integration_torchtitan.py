"""ckptzip.integrations.torchtitan with torchtitan's own llama3 debug model, optimizer and LR
scheduler containers: every async mode saves through ckptzip's DCP writer, and a fresh run
resumes from the latest step bit-exactly (model, AdamW moments, scheduler, train state).

torchtitan's flex attention has no backward on the CPU, so the steps apply seeded gradients
instead of backpropagating a loss; what is checkpointed is the same.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

pytest.importorskip("torchtitan")

from helpers import assert_same  # noqa: E402
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer  # noqa: E402
from torchtitan.components.optimizer.optimizer import default_adamw  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402

from ckptzip_bench.launch import launch  # noqa: E402
from ckptzip.integrations.torchtitan import CompressedCheckpointManager  # noqa: E402

pytestmark = pytest.mark.slow

MODES = ("disabled", "async", "async_with_pinned_mem")


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

    def __init__(self, root: Path, mode: str, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = model_registry("debugmodel").model.build()
        self.model.init_states()
        self.optimizers = default_adamw(lr=8e-4, implementation="for-loop").build(model_parts=[self.model])
        self.schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=self.optimizers,
                                                                              training_steps=10)
        self.train = _TrainState()
        config = CompressedCheckpointManager.Config(enable=True, folder=mode, interval=2, async_mode=mode,
                                                    keep_latest_k=2, last_save_model_only=False)
        self.manager = config.build(
            dataloader=None, model_parts=[self.model], optimizers=self.optimizers, lr_schedulers=self.schedulers,
            states={"train_state": self.train}, sd_adapter=None, base_folder=str(root),
        )

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
    """torchtitan's pinned-memory stager needs an accelerator; on the CPU the mode keeps the rest
    (asynchronous staging into shared memory, the save in a checkpoint process)."""
    if run.manager.async_mode == "async_with_pinned_mem" and not torch.accelerator.is_available():
        run.manager.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                                          use_async_staging=True, use_non_blocking_copy=False))


def _save_and_resume(rank: int, world: int, root: Path, mode: str) -> None:
    run = _Run(root, mode, seed=0)
    assert type(run.manager) is CompressedCheckpointManager  # built from the job config's Config
    _cpu_stager(run)
    for _ in range(5):
        run.step()
        run.manager.save(run.train.step)
        run.manager.maybe_wait_for_staging()
    run.manager.maybe_wait_for_saving()
    run.manager.close()
    assert sorted(os.listdir(root / mode)) == ["step-2", "step-4"], mode  # keep_latest_k=2
    assert sorted(os.listdir(root / mode / "step-4")) == [".metadata.ckz", "__0.ckzd"], mode

    resumed = _Run(root, mode, seed=1)
    assert resumed.manager.load()
    assert resumed.train.step == 4 and resumed.train.loader.getvalue() == b"tokens read at step 4", mode
    resumed.step()
    assert_same(resumed.state(), run.state(), f"{mode}: step 5 after resuming from step 4")
    resumed.manager.close()


@pytest.mark.parametrize("mode", MODES)
def test_async_mode_saves_with_ckptzip_and_resumes_bit_exactly(tmp_path: Path, mode: str) -> None:
    launch(_save_and_resume, 1, tmp_path, mode)
