"""Hugging Face ``transformers.Trainer`` integration: checkpoints whose big files are ``.ckz``.

    from ckptzip.integrations.hf import CkptzipTrainer

    trainer = CkptzipTrainer(model=model, args=args, train_dataset=data, ckptzip_codec="auto")
    trainer.train(resume_from_checkpoint=True)

In every ``checkpoint-N`` directory the model weights become ``model.ckz`` (instead of
``model.safetensors`` or its shards) and the optimizer and scheduler states become
``optimizer.ckz`` and ``scheduler.ckz`` (instead of ``optimizer.pt`` and ``scheduler.pt``).
Everything else (``config.json``, ``trainer_state.json``, ``rng_state.pth``, ...) is left as
Transformers writes it, and :meth:`Trainer.save_model` still exports ``from_pretrained`` files.
With ``push_to_hub`` the weights stay ``model.safetensors``: the Trainer uploads checkpoint
folders in the background, so their files must not change after it starts.

A callback alone cannot do this: ``resume_from_checkpoint`` loads the weights and optimizer
before any callback runs. So :class:`CkptzipTrainerMixin` overrides the Trainer's checkpoint hooks
(``_save_checkpoint``, ``_save_optimizer_and_scheduler``, ``_load_from_checkpoint``,
``_load_optimizer_and_scheduler``, ``_load_best_model``); tested with transformers 5.24.
Checkpoints without ``.ckz`` files (written by a plain Trainer) still resume. DeepSpeed, FSDP,
XLA and SageMaker model parallelism write their own checkpoint layouts; with those the mixin
steps aside and the Trainer's own code runs.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import torch

import ckptzip

try:
    import safetensors.torch
    from transformers import Trainer
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME
    from transformers.utils.import_utils import is_sagemaker_mp_enabled, is_torch_xla_available
except ImportError as exc:
    raise ImportError(
        "ckptzip.integrations.hf needs transformers and accelerate, which are not installed; "
        "install them with: pip install 'ckptzip[hf]'"
    ) from exc

__all__ = [
    "MODEL_FILE",
    "OPTIMIZER_FILE",
    "SCHEDULER_FILE",
    "CkptzipTrainer",
    "CkptzipTrainerMixin",
    "compress_model_weights",
]

MODEL_FILE = "model.ckz"
OPTIMIZER_FILE = "optimizer.ckz"
SCHEDULER_FILE = "scheduler.ckz"


def compress_model_weights(directory: str | os.PathLike[str], *, codec: str = "auto") -> bool:
    """Replace the safetensors weights in ``directory`` (one file, or shards plus their index) by
    one ``model.ckz`` holding the same tensors under the same names.

    The new file is complete (written atomically) before the originals are removed. Returns
    whether there were weights to replace.
    """
    index_path = os.path.join(directory, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        originals = [*shards, SAFE_WEIGHTS_INDEX_NAME]
    elif os.path.isfile(os.path.join(directory, SAFE_WEIGHTS_NAME)):
        shards = originals = [SAFE_WEIGHTS_NAME]
    else:
        return False
    state_dict: dict[str, torch.Tensor] = {}
    for name in shards:
        state_dict.update(safetensors.torch.load_file(os.path.join(directory, name), device="cpu"))
    ckptzip.save(state_dict, os.path.join(directory, MODEL_FILE), codec=codec)
    for name in originals:
        os.remove(os.path.join(directory, name))
    return True


# The mixin is typed as a Trainer, which it always ends up in front of.
if TYPE_CHECKING:
    _MixinBase = Trainer
else:
    _MixinBase = object


class CkptzipTrainerMixin(_MixinBase):
    """Mix into any ``transformers.Trainer`` subclass, first: ``class T(CkptzipTrainerMixin, SFTTrainer)``.

    Adds the keyword argument ``ckptzip_codec`` (a ckptzip preset or codec id, default ``"auto"``).
    """

    def __init__(self, *args: Any, ckptzip_codec: str = "auto", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ckptzip_codec = ckptzip_codec

    def _ckptzip_applies(self) -> bool:
        """False where the Trainer writes a backend-specific layout that ckptzip leaves alone."""
        return not (
            self.is_deepspeed_enabled or self.is_fsdp_enabled or is_torch_xla_available() or is_sagemaker_mp_enabled()
        )

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        # With push_to_hub the Trainer uploads this folder in the background: its files must stay.
        if self._ckptzip_applies() and self.args.should_save and not self.args.push_to_hub:
            folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            compress_model_weights(os.path.join(self._get_output_dir(trial=trial), folder), codec=self.ckptzip_codec)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        optimizer, scheduler = self.optimizer, self.lr_scheduler
        if not self._ckptzip_applies() or optimizer is None or scheduler is None:
            super()._save_optimizer_and_scheduler(output_dir)
            return
        if self.args.should_save:
            codec = self.ckptzip_codec
            ckptzip.save(optimizer.state_dict(), os.path.join(output_dir, OPTIMIZER_FILE), codec=codec)
            ckptzip.save(scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE), codec=codec)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        path = os.path.join(resume_from_checkpoint, MODEL_FILE)
        if self._ckptzip_applies() and os.path.isfile(path):
            self._load_model_weights(path, self.model if model is None else model)
        else:
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        path = os.path.join(best, MODEL_FILE) if best is not None else None
        if path is not None and self._ckptzip_applies() and os.path.isfile(path):
            self._load_model_weights(path, self.model)
        else:
            super()._load_best_model()

    def _load_model_weights(self, path: str, model: Any) -> None:
        # Like the Trainer: load on the CPU (no GPU memory spike), non-strict, then report.
        load_result = model.load_state_dict(ckptzip.load(path, map_location="cpu"), False)
        self._issue_warnings_after_load(load_result)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        optimizer, scheduler = self.optimizer, self.lr_scheduler
        if (
            checkpoint is None
            or optimizer is None
            or scheduler is None
            or not self._ckptzip_applies()
            or not os.path.isfile(os.path.join(checkpoint, OPTIMIZER_FILE))
        ):
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        # Like the Trainer: on the CPU for one process, straight to the device for several.
        device = self.args.device
        map_location = device if self.args.world_size > 1 and device.type != "cpu" else "cpu"
        optimizer.load_state_dict(ckptzip.load(os.path.join(checkpoint, OPTIMIZER_FILE), map_location=map_location))
        scheduler.load_state_dict(ckptzip.load(os.path.join(checkpoint, SCHEDULER_FILE), map_location="cpu"))


class CkptzipTrainer(CkptzipTrainerMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints store weights and optimizer state as ``.ckz``."""
