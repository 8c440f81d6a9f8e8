"""Trainer integrations, each an optional extra imported on its own (nothing is imported here):

- :mod:`ckptzip.integrations.lightning`: ``CkptzipCheckpointIO``, a PyTorch Lightning / Fabric
  ``CheckpointIO`` plugin (``pip install 'ckptzip[lightning]'``).
- :mod:`ckptzip.integrations.hf`: ``CkptzipTrainer`` / ``CkptzipTrainerMixin`` for Hugging Face
  ``transformers.Trainer`` (``pip install 'ckptzip[hf]'``).

docs/INTEGRATIONS.md describes both.
"""
