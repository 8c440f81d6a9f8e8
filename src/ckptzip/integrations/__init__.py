"""Trainer integrations, each an optional extra imported on its own, when first reached (as
``ckptzip.integrations.lightning``, say; nothing is imported here):

- :mod:`ckptzip.integrations.lightning`: ``CkptzipCheckpointIO``, a PyTorch Lightning / Fabric
  ``CheckpointIO`` plugin (``pip install 'ckptzip[lightning]'``).
- :mod:`ckptzip.integrations.hf`: ``CkptzipTrainer`` / ``CkptzipTrainerMixin`` for Hugging Face
  ``transformers.Trainer`` (``pip install 'ckptzip[hf]'``).
- :mod:`ckptzip.integrations.jax`: pytrees of ``jax.Array`` to ``.ckz`` and back through DLPack
  (``pip install 'ckptzip[jax]'``).
- :mod:`ckptzip.integrations.tf`: TensorFlow variables, Keras models and optimizers, and a Keras
  callback saving every N steps (``pip install 'ckptzip[tf]'``).
- :mod:`ckptzip.integrations.deepspeed`: ``CkptzipCheckpointEngine``, a DeepSpeed checkpoint
  engine (``pip install 'ckptzip[deepspeed]'``).
- :mod:`ckptzip.integrations.megatron`: the ``"ckptzip"`` backend of Megatron-Core's
  ``dist_checkpointing`` (``pip install 'ckptzip[megatron]'``).
- :mod:`ckptzip.integrations.torchtitan`: ``CompressedCheckpointManager``, torchtitan's checkpoint
  manager storing its DCP checkpoints with ckptzip (``pip install 'ckptzip[torchtitan]'``).
- :mod:`ckptzip.integrations.torch_checkpointing`: ``CompressedCheckpointManager``, Meta's
  torch_checkpointing ``CheckpointManager`` with its items coded by ckptzip
  (``pip install 'ckptzip[torch-checkpointing]'``).

docs/INTEGRATIONS.md describes each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:
    from . import deepspeed as deepspeed, hf as hf, jax as jax, lightning as lightning, megatron as megatron
    from . import tf as tf, torchtitan as torchtitan

_SUBMODULES = ("deepspeed", "hf", "jax", "lightning", "megatron", "tf", "torchtitan")

__getattr__, __dir__ = lazy_attributes(__name__, {}, globals(), _SUBMODULES)
