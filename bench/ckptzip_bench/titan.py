"""torchtitan 0.2 without the packages it imports with its model module and a training run
without logging never uses: TensorBoard (its metrics writer) and Hugging Face ``datasets`` (its
text data sets). The tests and ``bench/torchtitan_gpu.py`` (whose data set and tokenizer are
made in memory) run where neither is installed."""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any


def without_unused_extras() -> None:
    """Where TensorBoard or ``datasets`` is not installed, put a stand-in in its place that
    refuses to be used (a TensorBoard writer raises; ``datasets`` has no data sets). Once is
    enough; calling again changes nothing."""
    if "torch.utils.tensorboard" not in sys.modules and importlib.util.find_spec("tensorboard") is None:
        board = types.ModuleType("torch.utils.tensorboard")

        class SummaryWriter:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                raise RuntimeError("tensorboard is not installed: leave metrics.enable_tensorboard off")

        board.SummaryWriter = SummaryWriter  # type: ignore[attr-defined]
        sys.modules["torch.utils.tensorboard"] = board
    if "datasets" not in sys.modules and importlib.util.find_spec("datasets") is None:
        datasets, distributed = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")

        def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("Hugging Face datasets is not installed")

        datasets.Dataset = type("Dataset", (), {})  # type: ignore[attr-defined]
        datasets.load_dataset = unavailable  # type: ignore[attr-defined]
        distributed.split_dataset_by_node = unavailable  # type: ignore[attr-defined]
        sys.modules.update({"datasets": datasets, "datasets.distributed": distributed})
