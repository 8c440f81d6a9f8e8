"""DeepSpeed integration: a checkpoint engine that writes every checkpoint file with ckptzip.

    from ckptzip.integrations.deepspeed import CkptzipCheckpointEngine

    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config, ...)
    engine.checkpoint_engine = CkptzipCheckpointEngine()      # the one line
    engine.save_checkpoint("ckpt")                             # unchanged
    engine.load_checkpoint("ckpt")                             # unchanged

DeepSpeed keeps its layout (``ckpt/latest``, ``ckpt/global_stepN/mp_rank_00_model_states.pt``,
``..._optim_states.pt``): only the content of each file changes, to a ``.ckz`` container. Loading
detects the container by its magic bytes, so checkpoints written before the switch still load.

DeepSpeed's files hold a few DeepSpeed objects besides tensors and plain values (the ZeRO
optimizer's loss scaler, its stage enum, the parameter slice mappings). ckptzip never pickles:
these classes, and only these, are stored as their fields and rebuilt on load (see ``OBJECT_TYPES``).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import torch

import ckptzip
from ckptzip.errors import CorruptCheckpointError, UnsupportedObjectError
from ckptzip.format import is_ckz

try:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
except ImportError as exc:
    raise ImportError(
        "ckptzip.integrations.deepspeed needs DeepSpeed, which is not installed; "
        "install it with: pip install 'ckptzip[deepspeed]'"
    ) from exc

__all__ = ["OBJECT_TYPES", "CkptzipCheckpointEngine"]

# The DeepSpeed classes a checkpoint may hold, by the name stored in the file. Loading rebuilds
# these from their stored fields (no constructor, no pickle); any other name is refused.
OBJECT_TYPES: dict[str, type] = {
    f"{cls.__module__}.{cls.__qualname__}": cls
    for cls in (LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address)
}
_TAG = "__ckptzip_deepspeed_object__"


class CkptzipCheckpointEngine(CheckpointEngine):
    """DeepSpeed ``CheckpointEngine`` whose ``save`` writes a ``.ckz`` container and whose ``load``
    reads one (or, for files that are not ckptzip containers, does what DeepSpeed's
    ``TorchCheckpointEngine`` does: ``torch.load``, which unpickles: trusted files only).

    Args:
        config_params: DeepSpeed's config object (accepted as every engine does; unused).
        codec: ckptzip preset or codec id for every tensor (see :func:`ckptzip.save`).
        torch_fallback: load files that are not ckptzip containers with ``torch.load`` (as
            DeepSpeed would, ``weights_only=False``). ``False`` refuses them instead.

    Each file is written atomically (temporary file, fsync, rename), so a failed save leaves the
    previous file under that name intact; DeepSpeed writes ``latest`` after every rank's files
    are written, as with its own engine.
    """

    def __init__(self, config_params: Any = None, *, codec: str = "auto", torch_fallback: bool = True) -> None:
        super().__init__(config_params)
        self.name = type(self).__name__
        self.codec = codec
        self.torch_fallback = torch_fallback

    def create(self, info: CheckpointCommitInfo) -> None:
        """Nothing to prepare: each file is complete when :meth:`save` returns."""

    def save(self, state_dict: Any, path: str) -> None:
        """Write ``state_dict`` to ``path`` as a ``.ckz`` container (atomically)."""
        try:
            ckptzip.save(_to_plain(state_dict), path, codec=self.codec)
        except UnsupportedObjectError as exc:
            raise UnsupportedObjectError(
                f"{exc} (in DeepSpeed checkpoint file {path!r}: DeepSpeed objects other than "
                f"{sorted(OBJECT_TYPES)} are not stored; values in save_checkpoint(client_state=...) "
                "must be tensors or plain values)"
            ) from exc

    def load(self, path: str, map_location: Any = None) -> Any:
        """Read a file :meth:`save` wrote; ``map_location`` as ``torch.load`` takes it (including
        DeepSpeed's ``lambda storage, loc: storage``)."""
        if not is_ckz(path):
            if not self.torch_fallback:
                raise CorruptCheckpointError(
                    f"{path!r} is not a ckptzip container and torch_fallback=False; it was probably written "
                    "by DeepSpeed's own checkpoint engine (torch.save)"
                )
            return torch.load(path, map_location=map_location, weights_only=False)
        if callable(map_location):
            with ckptzip.open(path) as reader:
                saved = {entry.device or "cpu" for entry in reader.entries()}
            map_location = {device: _mapped(map_location, device) for device in saved}
        return _from_plain(ckptzip.load(path, map_location=map_location), path)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Every file of the tag is already durable (fsynced and renamed into place)."""
        return True

    def preserves_storage_sharing(self) -> bool:
        """ckptzip stores each tensor's own bytes, never the rest of its storage, so DeepSpeed need
        not clone views before saving (it does for ``torch.save``)."""
        return False


def _mapped(map_location: Callable[..., Any], saved: str) -> str:
    """Where ``torch.load`` would put a tensor saved on ``saved`` with a callable ``map_location``."""
    result = map_location(torch.UntypedStorage(0), saved)
    return str(result.device) if result is not None else saved


def _to_plain(obj: Any) -> Any:
    """``obj`` with every allowed DeepSpeed object replaced by a tagged dict of its fields."""

    def replace(value: Any) -> Any:
        name = f"{type(value).__module__}.{type(value).__qualname__}"
        if OBJECT_TYPES.get(name) is not type(value):
            return value
        if isinstance(value, enum.Enum):
            return {_TAG: name, "value": value.value}
        return {_TAG: name, "fields": _map_tree(dict(vars(value)), replace)}

    return _map_tree(obj, replace)


def _from_plain(obj: Any, path: str) -> Any:
    """Undo :func:`_to_plain`: rebuild the allowed DeepSpeed objects from their tagged dicts."""

    def rebuild(value: Any) -> Any:
        if type(value) is not dict or _TAG not in value:
            return value
        name = value[_TAG]
        cls = OBJECT_TYPES.get(name) if isinstance(name, str) else None
        keys = {_TAG, "value"} if cls is not None and issubclass(cls, enum.Enum) else {_TAG, "fields"}
        if cls is None or set(value) != keys:
            raise CorruptCheckpointError(
                f"{path!r} holds a DeepSpeed object {name!r:.80} with keys {sorted(value)}; ckptzip rebuilds only "
                f"{sorted(OBJECT_TYPES)}, each from its stored fields"
            )
        if issubclass(cls, enum.Enum):
            try:
                return cls(value["value"])
            except ValueError as exc:
                raise CorruptCheckpointError(f"{path!r}: {exc}") from exc
        fields = value["fields"]
        if type(fields) is not dict or not all(isinstance(k, str) for k in fields):
            raise CorruptCheckpointError(f"{path!r}: the fields of a stored {name} are not a dict of names")
        obj = cls.__new__(cls)
        obj.__dict__.update(_map_tree(fields, rebuild))
        if dataclasses.is_dataclass(cls) and set(fields) != {f.name for f in dataclasses.fields(cls)}:
            raise CorruptCheckpointError(f"{path!r}: a stored {name} has fields {sorted(fields)}")
        return obj

    return _map_tree(obj, rebuild)


def _map_tree(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """``obj`` with ``fn`` applied to every value, outermost first (a value ``fn`` replaces is not
    entered). Containers (dict, OrderedDict, list, tuple) are rebuilt only where something changed;
    a container met twice is mapped once, so shared sub-objects stay shared."""
    memo: dict[int, Any] = {}

    def visit(value: Any) -> Any:
        new = fn(value)
        if new is not value:
            return new
        if type(value) not in (dict, collections.OrderedDict, list, tuple):
            return value
        if id(value) in memo:
            return memo[id(value)]
        memo[id(value)] = value  # a cycle maps to the original; ckptzip.save refuses it by name
        if isinstance(value, dict):
            items = [(visit(k), visit(v)) for k, v in value.items()]
            changed = any(nk is not k or nv is not v for (nk, nv), (k, v) in zip(items, value.items()))
            out: Any = type(value)(items) if changed else value
            if changed and hasattr(value, "_metadata"):
                out._metadata = value._metadata
        else:
            values = [visit(v) for v in value]
            out = type(value)(values) if any(n is not o for n, o in zip(values, value)) else value
        memo[id(value)] = out
        return out

    return visit(obj)
