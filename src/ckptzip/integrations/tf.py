"""TensorFlow / Keras integration: variables to ``.ckz`` and back, through DLPack.

    from ckptzip.integrations import tf as ckz

    ckz.save_model(model, "step1000.ckz")          # weights, RNG seed states, optimizer variables
    ckz.restore_model(fresh_model, "step1000.ckz")
    model.fit(..., callbacks=[ckz.CkptzipCallback("ckpt", every_n_steps=500)])

Like a ``tf.train.Checkpoint``, :func:`save` and :func:`restore` take a nested dict/list/tuple
whose leaves are ``tf.Variable`` or Keras variables, ``tf.Tensor``, Keras models and layers,
Keras optimizers, ``tf.Module`` objects and plain values. Tensors reach ckptzip as torch views of
TensorFlow's buffers (DLPack, no copy, on the GPU too); restoring decodes where the variables
live and assigns. A model, layer, optimizer or module is stored as a dict of its variables by
path, in the order of its ``variables``, and restored in that order (shapes and dtypes checked):
Keras numbers layer names per process (``dense_3``), so a fresh model's paths differ from the
saved ones while its order does not.
"""

from __future__ import annotations

import collections
import os
from typing import Any

import torch
from torch.utils.dlpack import from_dlpack

import ckptzip
from ckptzip.errors import TargetMismatchError

try:
    import keras
    import tensorflow as tf
except ImportError as exc:
    raise ImportError(
        "ckptzip.integrations.tf needs TensorFlow, which is not installed; install it with: pip install 'ckptzip[tf]'"
    ) from exc

__all__ = [
    "CkptzipCallback",
    "from_torch",
    "load",
    "model_state",
    "restore",
    "restore_model",
    "save",
    "save_model",
    "to_torch",
]

_VARIABLE_TYPES = (tf.Variable, keras.Variable)
_OWNER_TYPES = (keras.layers.Layer, keras.optimizers.Optimizer, tf.Module)


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _variables(owner: Any) -> list[Any]:
    return list(owner.variables)


def _by_path(variables: list[Any]) -> dict[str, Any]:
    """``{path: variable}`` in order; a path seen before gets ``#2``, ``#3``... appended."""
    named: dict[str, Any] = {}
    for i, v in enumerate(variables):
        base = str(getattr(v, "path", None) or getattr(v, "name", None) or i)
        name, n = base, 1
        while name in named:
            n += 1
            name = f"{base}#{n}"
        named[name] = v
    return named


def _tensor_to_torch(x: Any) -> torch.Tensor:
    """A torch view of a variable's or tensor's buffer; later assignments to the variable do not
    change it (TensorFlow copies a buffer on write while a view of it is alive)."""
    return from_dlpack(tf.experimental.dlpack.to_dlpack(tf.convert_to_tensor(x)))


def to_torch(tree: Any) -> Any:
    """``tree`` as ckptzip stores it: tensors and variables as torch views (DLPack, no copy),
    each model, layer, optimizer or module as ``{variable path: tensor}``."""
    if isinstance(tree, _VARIABLE_TYPES) or tf.is_tensor(tree):
        return _tensor_to_torch(tree)
    if isinstance(tree, _OWNER_TYPES):
        return {name: _tensor_to_torch(v) for name, v in _by_path(_variables(tree)).items()}
    if type(tree) in (dict, collections.OrderedDict):
        return type(tree)((k, to_torch(v)) for k, v in tree.items())
    if type(tree) in (list, tuple):
        return type(tree)(to_torch(v) for v in tree)
    return tree  # plain values and NumPy arrays as they are; ckptzip refuses the rest


def _device_of(x: Any) -> str:
    return getattr(getattr(x, "value", x), "device", "") or ""


def _tensor_to_tf(t: torch.Tensor) -> tf.Tensor:
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()  # TensorFlow reads the buffer on its own stream
    return tf.experimental.dlpack.from_dlpack(t.contiguous().__dlpack__())


def from_torch(obj: Any) -> Any:
    """``obj`` (anything ckptzip loaded) with every torch tensor a ``tf.Tensor`` on its device."""
    if isinstance(obj, torch.Tensor):
        return _tensor_to_tf(obj)
    if type(obj) in (dict, collections.OrderedDict):
        return type(obj)((k, from_torch(v)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(from_torch(v) for v in obj)
    return obj


def _assign(variable: Any, value: Any, where: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TargetMismatchError(f"the checkpoint holds a {type(value).__name__} at {where!r}, the target a variable")
    dtype = tf.as_dtype(variable.dtype)
    shape = tuple(variable.shape)
    if tuple(value.shape) != shape or str(value.dtype).removeprefix("torch.") != dtype.name:
        raise TargetMismatchError(
            f"the checkpoint's tensor at {where!r} is {str(value.dtype).removeprefix('torch.')}{list(value.shape)}, "
            f"the variable {getattr(variable, 'path', variable.name)!r} is {dtype.name}{list(shape)}"
        )
    variable.assign(_tensor_to_tf(value))


def _restore_owner(owner: Any, stored: Any, where: str) -> None:
    variables = _variables(owner)
    if not isinstance(stored, dict) or len(stored) != len(variables):
        held = f"{len(stored)} tensors" if isinstance(stored, dict) else f"a {type(stored).__name__}"
        hint = ""
        if isinstance(stored, dict) and len(variables) < len(stored):
            hint = (
                " Build it first: optimizer.build(model.trainable_variables), or use restore_model()"
                if isinstance(owner, keras.optimizers.Optimizer)
                else " Build it first (call it on a batch) so that it has its variables"
            )
        raise TargetMismatchError(
            f"the {type(owner).__name__} at {where or '<root>'!r} has {len(variables)} variables, "
            f"the checkpoint holds {held} there.{hint}"
        )
    for variable, (name, value) in zip(variables, stored.items()):
        _assign(variable, value, _join(where, name))


def _restore(target: Any, stored: Any, where: str) -> None:
    if isinstance(target, _VARIABLE_TYPES):
        _assign(target, stored, where)
    elif isinstance(target, _OWNER_TYPES):
        _restore_owner(target, stored, where)
    elif isinstance(target, (dict, list, tuple)):
        keys = target.keys() if isinstance(target, dict) else range(len(target))
        for key in keys:
            try:
                value = stored[key]
            except (KeyError, IndexError, TypeError):
                raise TargetMismatchError(
                    f"the target has an entry at {_join(where, key)!r} that the checkpoint does not hold"
                ) from None
            _restore(target[key], value, _join(where, key))


def _first_gpu(tree: Any) -> str | None:
    """``cuda:N`` for the first variable of ``tree`` on a GPU, or ``None``."""
    found: list[str] = []

    def visit(obj: Any) -> None:
        if found:
            return
        if isinstance(obj, _VARIABLE_TYPES):
            spec = tf.DeviceSpec.from_string(_device_of(obj))
            if spec.device_type == "GPU":
                found.append(f"cuda:{spec.device_index or 0}")
        elif isinstance(obj, _OWNER_TYPES):
            for v in _variables(obj):
                visit(v)
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                visit(v)

    visit(tree)
    return found[0] if found else None


def save(tree: Any, f: str | os.PathLike[str] | Any, *, codec: str = "auto") -> None:
    """Save variables, tensors, models, optimizers and plain values with :func:`ckptzip.save`."""
    ckptzip.save(to_torch(tree), f, codec=codec)


def restore(tree: Any, f: Any, *, max_bytes: int | None = None) -> Any:
    """Assign what ``f`` holds to the variables of ``tree`` (the structure given to :func:`save`).

    Decodes on the GPU of the first GPU variable (handing tensors to TensorFlow without a copy),
    otherwise on the CPU. Entries of the file that ``tree`` does not name are ignored; anything
    ``tree`` names that the file lacks or holds with another shape or dtype raises
    :class:`~ckptzip.errors.TargetMismatchError` (variables before it may already be assigned).
    Returns the loaded object, tensors as ``tf.Tensor`` (plain values such as a step count too).
    """
    stored = ckptzip.load(f, map_location=_first_gpu(tree) or "cpu", max_bytes=max_bytes)
    _restore(tree, stored, "")
    return from_torch(stored)


def load(f: Any, *, max_bytes: int | None = None) -> Any:
    """Load a ``.ckz`` (written from TensorFlow, PyTorch or JAX) with every tensor a ``tf.Tensor``
    on the CPU."""
    return from_torch(ckptzip.load(f, map_location="cpu", max_bytes=max_bytes))


def model_state(model: keras.Model) -> dict[str, Any]:
    """What :func:`save_model` stores: ``{"model": model}``, plus ``"optimizer"`` once compiled."""
    optimizer = getattr(model, "optimizer", None)
    return {"model": model} if optimizer is None else {"model": model, "optimizer": optimizer}


def save_model(model: keras.Model, f: str | os.PathLike[str] | Any, *, codec: str = "auto") -> None:
    """Save a Keras model's variables (weights and RNG seed states) and its optimizer's variables."""
    save(model_state(model), f, codec=codec)


def _built_model_state(model: keras.Model) -> dict[str, Any]:
    """:func:`model_state`, after giving an optimizer that has no variables yet its variables."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not optimizer.built:
        optimizer.build(model.trainable_variables)
    return model_state(model)


def restore_model(model: keras.Model, f: Any, *, max_bytes: int | None = None) -> Any:
    """Restore what :func:`save_model` saved into a built (and, for the optimizer, compiled) model
    of the same architecture; builds the optimizer's variables first if it has none yet.
    Returns what :func:`restore` returns."""
    return restore(_built_model_state(model), f, max_bytes=max_bytes)


class CkptzipCallback(keras.callbacks.Callback):
    """Saves the model and optimizer every ``every_n_steps`` optimizer steps with a
    :class:`ckptzip.CheckpointManager` (atomic, in the background, keep-last-K).

    Args:
        directory: local path or fsspec URL, as for :class:`~ckptzip.CheckpointManager`.
        every_n_steps: save when ``optimizer.iterations`` is a multiple of this.
        keep_last, codec, async_save: passed to the manager.

    :meth:`restore_latest` puts the newest checkpoint into a model before ``fit``. Call
    :meth:`close` when done (it waits for the last save and releases the directory).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        every_n_steps: int,
        keep_last: int | None = 3,
        codec: str = "auto",
        async_save: bool = True,
    ) -> None:
        super().__init__()
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.manager = ckptzip.CheckpointManager(directory, keep_last=keep_last, codec=codec, async_save=async_save)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        step = int(self.model.optimizer.iterations.numpy())
        if self.manager.should_save(step, every=self.every_n_steps):
            self.manager.save(step, to_torch({**model_state(self.model), "step": step}))

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        self.manager.wait()

    def restore_latest(self, model: keras.Model) -> int | None:
        """Restore the newest valid checkpoint into ``model`` (built and compiled, same
        architecture); returns its step, or ``None`` (nothing restored) when there is none."""
        if self.manager.latest_step() is None:
            return None
        target = _built_model_state(model)
        stored = self.manager.restore(map_location=_first_gpu(target) or "cpu")
        _restore(target, stored, "")
        return int(stored["step"])

    def close(self) -> None:
        self.manager.close()

