"""JAX integration: pytrees of ``jax.Array`` to ``.ckz`` and back, through DLPack.

    from ckptzip.integrations import jax as ckz

    ckz.save({"params": params, "opt_state": opt_state, "step": step}, "step1000.ckz")
    state = ckz.load("step1000.ckz", target=abstract_state)   # same pytree types, shardings

Arrays go to ckptzip as torch views of their buffers (no copy) and come back as ``jax.Array``
(no copy where the decoded buffer suits XLA). The pytree is stored as ckptzip's plain containers:
dicts, lists and tuples as they are; namedtuples (optax states) and other registered pytree
nodes as dicts keyed by their field or key names. ``load`` without a ``target`` returns those
containers; with a ``target`` (the pytree to restore, or its ``jax.ShapeDtypeStruct`` outline)
it rebuilds the target's pytree types and puts each array where the target's leaf lives.

:func:`to_torch` and :func:`from_torch` do the conversions alone, for
:class:`ckptzip.CheckpointManager` or for reading a checkpoint written by PyTorch or TensorFlow.
"""

from __future__ import annotations

import collections
import contextlib
import os
from typing import Any, Union

import torch
from torch.utils.dlpack import from_dlpack

import ckptzip
from ckptzip.errors import TargetMismatchError, UnsupportedObjectError

try:
    import jax
    import jax.dlpack
    import numpy as np
except ImportError as exc:
    raise ImportError(
        "ckptzip.integrations.jax needs JAX, which is not installed; install it with: pip install 'ckptzip[jax]'"
    ) from exc

__all__ = ["from_torch", "load", "save", "to_torch"]

Device = Union[None, "jax.Device", "jax.sharding.Sharding"]

_WIDE = {torch.float64, torch.int64, torch.uint64, torch.complex128}


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _key_name(key: Any) -> Any:
    """The dict key a pytree key entry is stored under: a field name, dict key or position."""
    for attribute in ("name", "key", "idx"):  # GetAttrKey, DictKey / FlattenedIndexKey, SequenceKey
        if hasattr(key, attribute):
            return getattr(key, attribute)
    raise TypeError(f"unknown pytree key entry {key!r}")


def _children(node: Any) -> list[tuple[Any, Any]]:
    """(key, child) pairs of a registered pytree node, one level down."""
    if isinstance(node, tuple) and hasattr(node, "_fields"):  # a namedtuple: its fields, in order
        return list(zip(node._fields, node))
    pairs, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    return [(_key_name(path[0]), child) for path, child in pairs]


def _array_to_torch(a: jax.Array, path: str) -> torch.Tensor:
    if len(a.sharding.device_set) > 1:
        if not a.is_fully_addressable:
            raise UnsupportedObjectError(
                f"the jax.Array at {path or '<root>'!r} is sharded across processes; each process holds only "
                "part of it. Save sharded multi-process state with ckptzip.dcp, or gather it first"
            )
        # One device's copy when replicated; the whole array gathered onto one device otherwise.
        first = a.addressable_shards[0]
        a = first.data if a.is_fully_replicated else jax.device_put(a, first.device)
    try:
        return from_dlpack(a)
    except (BufferError, RuntimeError, TypeError, jax.errors.JaxRuntimeError) as exc:
        raise UnsupportedObjectError(
            f"the jax.Array at {path or '<root>'!r} ({a.dtype}) cannot be handed to ckptzip through DLPack: {exc}"
        ) from exc


def _to_torch(obj: Any, path: str) -> Any:
    if isinstance(obj, jax.Array):
        return _array_to_torch(obj, path)
    if type(obj) in (dict, collections.OrderedDict):
        return type(obj)((k, _to_torch(v, _join(path, k))) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_to_torch(v, _join(path, i)) for i, v in enumerate(obj))
    if obj is None or jax.tree_util.all_leaves([obj]):
        return obj  # NumPy and plain values are stored as they are; ckptzip refuses the rest
    return {k: _to_torch(v, _join(path, k)) for k, v in _children(obj)}  # any other pytree node


def to_torch(tree: Any) -> Any:
    """``tree`` as ckptzip stores it: every ``jax.Array`` a torch view of its buffer (DLPack, no copy).

    Dicts, lists and tuples keep their type; namedtuples and other pytree nodes become dicts keyed
    by field (or key) name. A fully addressable sharded array is taken from one device (replicated)
    or gathered onto one; an array spread over processes is refused.
    """
    jax.block_until_ready(tree)  # every array computed before torch reads its buffer
    return _to_torch(tree, "")


def _tensor_to_jax(t: torch.Tensor, path: str, device: Device) -> jax.Array:
    if t.dtype in _WIDE and not jax.config.read("jax_enable_x64"):
        raise UnsupportedObjectError(
            f"the {t.dtype} tensor at {path or '<root>'!r} needs 64-bit types, which JAX has switched off; "
            "JAX would truncate it. Set jax.config.update('jax_enable_x64', True) before loading"
        )
    try:
        # torch hands a CUDA tensor over only while its device is the current one
        with torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext():
            a = jax.dlpack.from_dlpack(t.contiguous())
    except (BufferError, RuntimeError, TypeError, jax.errors.JaxRuntimeError) as exc:
        raise UnsupportedObjectError(f"the {t.dtype} tensor at {path or '<root>'!r} has no JAX equivalent: {exc}") from exc
    return a if device is None else jax.device_put(a, device)


def _lookup(obj: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        obj = obj[_key_name(key)]
    return obj


def _placement(leaf: Any, device: Device) -> Device:
    sharding = getattr(leaf, "sharding", None)
    return sharding if sharding is not None else device


def _restore_leaf(value: Any, leaf: Any, where: str, device: Device) -> Any:
    if not isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        return value.numpy() if isinstance(value, torch.Tensor) and isinstance(leaf, np.ndarray) else value
    if isinstance(value, torch.Tensor):
        value = _tensor_to_jax(value, where, _placement(leaf, device))
    elif isinstance(value, np.ndarray):
        value = jax.device_put(value, _placement(leaf, device))
    else:
        raise TargetMismatchError(f"the checkpoint holds a {type(value).__name__} at {where!r}, the target an array")
    if value.shape != leaf.shape or value.dtype != leaf.dtype:
        raise TargetMismatchError(
            f"the checkpoint's array at {where!r} is {value.dtype}{list(value.shape)}, "
            f"the target's {leaf.dtype}{list(leaf.shape)}"
        )
    return value


def _from_torch(obj: Any, path: str, device: Device) -> Any:
    if isinstance(obj, torch.Tensor):
        return _tensor_to_jax(obj, path, device)
    if type(obj) in (dict, collections.OrderedDict):
        return type(obj)((k, _from_torch(v, _join(path, k), device)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_from_torch(v, _join(path, i), device) for i, v in enumerate(obj))
    return obj


def from_torch(obj: Any, *, target: Any = None, device: Device = None) -> Any:
    """What :func:`to_torch` made (or any object ckptzip loaded), with every tensor a ``jax.Array``.

    Without ``target``: containers as stored, arrays on ``device`` (a ``jax.Device`` or
    ``Sharding``; ``None``: the tensor's own device, the CPU for CPU tensors). With
    ``target``: a pytree of the target's structure and types, each array placed like the target's
    leaf (its ``sharding``; ``device`` where the leaf has none); shapes and dtypes must match
    (:class:`~ckptzip.errors.TargetMismatchError`). Entries the target does not name are left out.
    """
    if target is None:
        return _from_torch(obj, "", device)
    pairs, treedef = jax.tree_util.tree_flatten_with_path(target)
    leaves = []
    for path, leaf in pairs:
        where = jax.tree_util.keystr(path, simple=True, separator=".")
        try:
            value = _lookup(obj, path)
        except (KeyError, IndexError, TypeError):
            raise TargetMismatchError(f"the target has a leaf at {where!r} that the checkpoint does not hold") from None
        leaves.append(_restore_leaf(value, leaf, where, device))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def save(tree: Any, f: str | os.PathLike[str] | Any, *, codec: str = "auto") -> None:
    """Save a pytree of ``jax.Array`` (and plain values) with :func:`ckptzip.save`; see :func:`to_torch`."""
    ckptzip.save(to_torch(tree), f, codec=codec)


def _map_location(device: Device) -> str:
    """Decode on the GPU that ``device`` (default: JAX's first device) is, so the arrays never
    cross the host; on the CPU otherwise."""
    where = jax.devices()[0] if device is None else device
    if isinstance(where, jax.Device) and where.platform == "gpu":
        return f"cuda:{where.local_hardware_id}"
    return "cpu"


def load(f: Any, *, target: Any = None, device: Device = None, max_bytes: int | None = None) -> Any:
    """Load a ``.ckz`` (written from JAX, PyTorch or TensorFlow) as a pytree of ``jax.Array``.

    ``target`` and ``device`` as for :func:`from_torch`, except that ``device=None`` means JAX's
    default device. On a GPU the file is decoded on that GPU and handed to JAX without a copy;
    otherwise it is decoded on the CPU, then placed. ``max_bytes`` as for :func:`ckptzip.load`.
    """
    return from_torch(ckptzip.load(f, map_location=_map_location(device), max_bytes=max_bytes),
                      target=target, device=device)
