"""Canaries for the private APIs of other packages that ckptzip relies on.

Each test checks that an attribute exists with the signature ckptzip calls it with, and says
which ckptzip feature breaks when it does not, so an upgrade of torch, transformers or Lightning
fails here, plainly, before it fails inside a user's save or resume.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch


def _parameters(function: Callable[..., Any]) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name != "self"]


# --- torch ------------------------------------------------------------------------------------


def test_torch_foreach_copy_takes_lists_and_non_blocking() -> None:
    what = (
        "torch._foreach_copy_(dst_list, src_list, non_blocking=...) changed: CheckpointManager's snapshot "
        "(ckptzip/staging/copies.py, copy_batched) copies a state's tensors with it"
    )
    assert callable(getattr(torch, "_foreach_copy_", None)), what
    dst, src = [torch.zeros(3), torch.zeros(2)], [torch.arange(3.0), torch.arange(2.0)]
    torch._foreach_copy_(dst, src, non_blocking=False)
    assert all(torch.equal(d, s) for d, s in zip(dst, src)), what


def test_torch_allocates_a_shared_storage_of_a_size() -> None:
    what = (
        "torch.UntypedStorage._new_shared(nbytes) changed: ckptzip/memory/shared.py (shared_empty) allocates "
        "the shared memory that stagings hand to DCP's and torch_checkpointing's checkpoint processes with it"
    )
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
    assert callable(new_shared), what
    storage = new_shared(64)
    assert storage.nbytes() == 64 and storage.is_shared(), what


def test_torch_maps_a_shared_storage_from_a_descriptor() -> None:
    import tempfile

    what = (
        "torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes) changed: ckptzip/memory/shared.py (shared_empty) "
        "maps the shared memory it makes (without holding the GIL) as a storage torch hands over by descriptor"
    )
    from_fd = getattr(torch.UntypedStorage, "_new_shared_fd_cpu", None)
    assert callable(from_fd), what
    with tempfile.TemporaryFile() as f:
        f.truncate(64)
        storage = from_fd(f.fileno(), 64)
    assert storage.nbytes() == 64 and storage.is_shared(), what


def test_dcp_loads_a_whole_checkpoint_without_a_template() -> None:
    from torch.distributed.checkpoint import default_planner, state_dict_loader

    what = (
        "torch.distributed.checkpoint's private {} changed: ckptzip.dcp.dcp_to_ckz and `ckptzip dcp-convert` "
        "(ckptzip/dcp/_convert.py) load a whole DCP checkpoint through it, as DCP's own dcp_to_torch_save does"
    )
    planner = getattr(default_planner, "_EmptyStateDictLoadPlanner", None)
    assert planner is not None, what.format("default_planner._EmptyStateDictLoadPlanner")
    planner()  # ckptzip constructs it without arguments
    loader = getattr(state_dict_loader, "_load_state_dict", None)
    assert loader is not None, what.format("state_dict_loader._load_state_dict")
    assert {"state_dict", "storage_reader", "planner", "no_dist"} <= set(_parameters(loader)), what.format(
        f"state_dict_loader._load_state_dict{inspect.signature(loader)}"
    )


# --- transformers -----------------------------------------------------------------------------

# The Trainer methods CkptzipTrainerMixin overrides (each calls the Trainer's own with the same
# arguments), and those it calls.
_OVERRIDDEN = (
    "_save_checkpoint",
    "_save_optimizer_and_scheduler",
    "_load_from_checkpoint",
    "_load_optimizer_and_scheduler",
    "_load_best_model",
)
_CALLED = {"_get_output_dir": ["trial"], "_issue_warnings_after_load": ["load_result"]}


@pytest.mark.parametrize("name", _OVERRIDDEN)
def test_trainer_hooks_that_the_mixin_overrides_keep_their_signatures(name: str) -> None:
    pytest.importorskip("transformers")
    from transformers import Trainer

    from ckptzip.integrations.hf import CkptzipTrainerMixin

    hook = getattr(Trainer, name, None)
    assert hook is not None, (
        f"transformers.Trainer.{name} is gone: CkptzipTrainer (ckptzip/integrations/hf.py) overrides it to "
        "write or read .ckz checkpoints, so its checkpoints would silently be plain Transformers ones (or "
        "not resume). Find the hook that replaced it and override that instead"
    )
    ours, theirs = _parameters(getattr(CkptzipTrainerMixin, name)), _parameters(hook)
    assert ours == theirs, (
        f"transformers.Trainer.{name}{inspect.signature(hook)} no longer takes the arguments "
        f"CkptzipTrainerMixin.{name} takes ({', '.join(ours)}): the Trainer would call the override wrongly. "
        "Update ckptzip/integrations/hf.py"
    )


@pytest.mark.parametrize(("name", "arguments"), sorted(_CALLED.items()))
def test_trainer_helpers_that_the_mixin_calls_keep_their_signatures(name: str, arguments: list[str]) -> None:
    pytest.importorskip("transformers")
    from transformers import Trainer

    helper = getattr(Trainer, name, None)
    assert helper is not None and _parameters(helper) == arguments, (
        f"transformers.Trainer.{name}({', '.join(arguments)}) changed "
        f"({inspect.signature(helper) if helper is not None else 'gone'}): CkptzipTrainer "
        "(ckptzip/integrations/hf.py) calls it to save or load a checkpoint's weights"
    )


# --- Lightning --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["save_checkpoint", "load_checkpoint"])
def test_lightning_checkpoint_io_methods_keep_their_signatures(name: str) -> None:
    pytest.importorskip("lightning")
    from lightning.fabric.plugins import TorchCheckpointIO

    from ckptzip.integrations.lightning import CkptzipCheckpointIO

    ours, theirs = _parameters(getattr(CkptzipCheckpointIO, name)), _parameters(getattr(TorchCheckpointIO, name))
    assert ours == theirs, (
        f"Lightning's TorchCheckpointIO.{name} now takes ({', '.join(theirs)}), CkptzipCheckpointIO.{name} "
        f"({', '.join(ours)}): Lightning would call the plugin (ckptzip/integrations/lightning.py) wrongly"
    )


# --- triton -----------------------------------------------------------------------------------


def test_triton_cache_key_function_takes_no_arguments_and_is_cached() -> None:
    cache = pytest.importorskip("triton.runtime.cache")
    what = (
        "triton.runtime.cache.triton_key() changed: ckptzip/kernels/__init__.py hashes Triton's compiler "
        "ahead on a background thread with it, so the first save of a process does not wait for that hash"
    )
    key = getattr(cache, "triton_key", None)
    assert callable(key) and _parameters(key) == [] and hasattr(key, "cache_info"), what
