"""Flatten saved objects into a JSON tree plus a tensor list, and back. Nothing is pickled.

docs/FORMAT.md ("Values") is the specification of this encoding.
"""

from __future__ import annotations

import base64
import collections
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .errors import CorruptCheckpointError, UnsupportedObjectError
from .format.spec import DTYPE_NAMES, DTYPES, MAX_DIMS, TORCH_DTYPES

# Each level costs up to three interpreter frames and three JSON levels (a dict is
# {"dict": [[k, v]]}); 100 levels stay well inside Python's default recursion limit of 1000.
MAX_DEPTH = 100


@dataclass
class FlatTensor:
    """A tensor found in the tree, with the dotted path it was first seen at."""

    name: str
    tensor: torch.Tensor


@dataclass
class Flattened:
    """Result of :func:`flatten`: the JSON tree and the tensors it refers to by position."""

    tree: Any
    tensors: list[FlatTensor] = field(default_factory=list)


def join_path(path: str, key: object) -> str:
    """The dotted path of ``key`` inside the container at ``path`` (``"optimizer.state.3"``)."""
    return f"{path}.{key}" if path else str(key)


def is_container(obj: Any) -> bool:
    """Whether ckptzip stores ``obj`` as a container of values: a list, a tuple, a dict or an
    OrderedDict (not their subclasses, whose state need not be in their items; a list
    subclass is stored as a list)."""
    return isinstance(obj, list) or type(obj) in (tuple, dict, collections.OrderedDict)


def _children(obj: Any, path: str) -> Iterator[tuple[str, Any]]:
    """``(dotted path, value)`` of each item of a container."""
    if isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield join_path(path, index), value
    else:
        for key, value in obj.items():
            yield join_path(path, key), value


def iter_leaves(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted path, value)`` for every value below the containers of ``obj``, in order. A
    container met again (shared, as a loaded tree may share them) is not walked again: its leaves
    come once, at their first path, so the walk costs O(nodes) however the containers are shared."""
    seen: set[int] = set()
    keep: list[Any] = []  # the containers walked, so their ids stay unique

    def walk(value: Any, at: str) -> Iterator[tuple[str, Any]]:
        if not is_container(value):
            yield at, value
        elif id(value) not in seen:
            seen.add(id(value))
            keep.append(value)
            for child_path, child in _children(value, at):
                yield from walk(child, child_path)

    yield from walk(obj, path)


def expanded_leaves(obj: Any) -> int:
    """How many leaves ``obj`` has once every shared container is expanded into copies, as
    formats without references (DCP's flat state dict) store it: an empty container counts as
    one. Each container is counted once (O(nodes)); the result may be astronomically large
    (a 40-level chain of containers sharing the next twice is 2**40)."""
    counts: dict[int, int] = {}
    keep: list[Any] = []

    def count(value: Any) -> int:
        if not is_container(value):
            return 1
        if id(value) not in counts:
            keep.append(value)
            counts[id(value)] = max(1, sum(count(child) for _, child in _children(value, "")))
        return counts[id(value)]

    return count(obj)


DROP: Any = object()
"""What a function given to :func:`map_tree` returns to leave a value out: a dict entry (for a
key or its value) is dropped, a list or tuple item becomes ``None`` so positions hold."""


def map_tree(
    obj: Any, value: Callable[[Any, str], Any], key: Callable[[Any, str], Any] | None = None, path: str = ""
) -> Any:
    """``obj`` with ``value(leaf, path)`` applied to every leaf below its containers (and
    ``key(dict_key, path)`` to every dict key), the containers rebuilt with their types (and an
    OrderedDict's ``_metadata``). A container in which nothing changed is returned itself, so
    the common case copies nothing. A shared container is mapped once (at its first path) and
    its result shared the same way: O(nodes), and sharing is kept."""
    done: dict[int, tuple[Any, Any]] = {}  # id -> (container, its result): the container keeps the id unique

    def walk(obj: Any, path: str) -> Any:
        if not is_container(obj):
            return value(obj, path)
        if id(obj) not in done:
            done[id(obj)] = (obj, _map_container(obj, path, walk, key))
        return done[id(obj)][1]

    return walk(obj, path)


def _map_container(obj: Any, path: str, walk: Callable[[Any, str], Any], key: Callable[[Any, str], Any] | None
                   ) -> Any:
    if isinstance(obj, (list, tuple)):
        values = [walk(v, join_path(path, i)) for i, v in enumerate(obj)]
        if all(new is old for new, old in zip(values, obj)):
            return obj
        kept = (None if v is DROP else v for v in values)
        return tuple(kept) if type(obj) is tuple else list(kept)
    items, changed = [], False
    for k, v in obj.items():
        new_key = k if key is None else key(k, join_path(path, f"<key {k!r}>"))
        new_value = v if new_key is DROP else walk(v, join_path(path, k))
        changed |= new_key is not k or new_value is not v
        if new_key is not DROP and new_value is not DROP:
            items.append((new_key, new_value))
    if not changed:
        return obj
    out = type(obj)(items)
    if hasattr(obj, "_metadata"):
        out._metadata = obj._metadata  # torch's state_dict metadata, an attribute of the OrderedDict
    return out


class _Flattener:
    def __init__(self) -> None:
        self.tensors: list[FlatTensor] = []
        self._by_view: dict[tuple[Any, ...], int] = {}
        self._names: set[str] = set()
        # Containers by id -> number in pre-order; ``_seen`` keeps them alive so ids stay unique.
        self._numbers: dict[int, int] = {}
        self._seen: list[Any] = []
        self._open: dict[int, str] = {}  # id -> path of the containers being encoded (the current branch)

    def tensor_ref(self, t: torch.Tensor, path: str) -> int:
        key = _view_key(t)
        if key is not None and key in self._by_view:
            return self._by_view[key]
        name = path or "tensor"
        unique, n = name, 1
        while unique in self._names:
            n += 1
            unique = f"{name}#{n}"
        self._names.add(unique)
        self.tensors.append(FlatTensor(unique, t))
        index = len(self.tensors) - 1
        if key is not None:
            self._by_view[key] = index
        return index

    def encode(self, obj: Any, path: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise UnsupportedObjectError(f"object nested deeper than {MAX_DEPTH} levels at {path!r}")
        if isinstance(obj, np.generic):  # before float/str/bytes, which np.float64/str_/bytes_ subclass
            return {"npscalar": [obj.dtype.str, obj.tobytes().hex()]}
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            return {"float": struct.pack(">d", obj).hex()}
        if isinstance(obj, (bytes, bytearray)):
            return {"bytes": base64.b64encode(bytes(obj)).decode("ascii")}
        if isinstance(obj, torch.Tensor):
            return {"tensor": self.tensor_ref(_plain_tensor(obj, path), path)}
        if isinstance(obj, np.ndarray):
            return {"ndarray": self.tensor_ref(_ndarray_to_tensor(obj, path), path)}
        if isinstance(obj, torch.dtype):
            return {"dtype": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"device": str(obj)}
        if isinstance(obj, torch.Size):
            return {"size": list(obj)}
        if isinstance(obj, list) or type(obj) in (tuple, dict, collections.OrderedDict):
            return self.container(obj, path, depth)
        raise UnsupportedObjectError(
            f"cannot store an object of type {type(obj).__module__}.{type(obj).__qualname__} at "
            f"{path or '<root>'!r}: ckptzip stores tensors, NumPy arrays and plain values (int, float, "
            "bool, str, bytes, None, dict, list, tuple) so that loading never runs code. Convert it to "
            "one of those (for example a dict of its fields) before saving."
        )

    def container(self, obj: Any, path: str, depth: int) -> Any:
        """A list, tuple, dict or OrderedDict; ``{"alias": k}`` if it was already encoded."""
        number = self._numbers.get(id(obj))
        if number is not None:
            if id(obj) in self._open:
                raise UnsupportedObjectError(
                    f"the value at {path or '<root>'!r} is the {type(obj).__name__} at "
                    f"{self._open[id(obj)] or '<root>'!r} that contains it (a reference cycle); ckptzip "
                    "stores shared sub-objects but not cycles. Break the cycle before saving."
                )
            return {"alias": number}
        self._numbers[id(obj)] = len(self._seen)
        self._seen.append(obj)
        self._open[id(obj)] = path
        try:
            return self.encode_container(obj, path, depth)
        finally:
            del self._open[id(obj)]

    def encode_container(self, obj: Any, path: str, depth: int) -> Any:
        if isinstance(obj, list):
            return [self.encode(v, join_path(path, i), depth + 1) for i, v in enumerate(obj)]
        if type(obj) is tuple:
            return {"tuple": [self.encode(v, join_path(path, i), depth + 1) for i, v in enumerate(obj)]}
        pairs = [
            [self.encode(k, path, depth + 1), self.encode(v, join_path(path, k), depth + 1)] for k, v in obj.items()
        ]
        if isinstance(obj, collections.OrderedDict):
            meta = getattr(obj, "_metadata", None)
            return {"odict": pairs, "meta": self.encode(meta, join_path(path, "_metadata"), depth + 1)}
        return {"dict": pairs}


def _view_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """Identity of a tensor view, so the same view stored twice is stored once."""
    if t.numel() == 0:
        return None
    return (
        t.untyped_storage().data_ptr(), t.device, t.dtype, t.storage_offset(), tuple(t.shape), t.stride(),
        t.is_conj(), t.is_neg(),
    )


def _plain_tensor(t: torch.Tensor, path: str) -> torch.Tensor:
    if t.layout != torch.strided:
        raise UnsupportedObjectError(
            f"tensor at {path!r} has layout {t.layout}; only dense (strided) tensors are stored. "
            "Call .to_dense() first."
        )
    if t.is_quantized or t.is_nested:
        raise UnsupportedObjectError(f"tensor at {path!r} is quantized or nested; store its dense parts instead.")
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        raise UnsupportedObjectError(
            f"tensor at {path!r} is a {type(t).__qualname__}; store a plain tensor (for a DTensor use "
            "ckptzip.dcp, or .full_tensor())."
        )
    _check_storable(t, path)
    return t if type(t) is torch.Tensor and not t.requires_grad else t.detach()


def _check_storable(t: torch.Tensor, path: str) -> None:
    """Refuse what the format cannot hold, so that whatever save accepts, load accepts."""
    if t.is_meta:
        raise UnsupportedObjectError(
            f"tensor at {path!r} is on the meta device and has no data to store; materialize it "
            "(for example module.to_empty(device='cpu') and initialize or load it) before saving."
        )
    if t.dtype not in DTYPE_NAMES:
        raise UnsupportedObjectError(
            f"tensor at {path!r} has dtype {t.dtype}, which the ckptzip format cannot store (it stores "
            f"{', '.join(DTYPES)}); convert it (for example .view(torch.uint8) for raw bits) before saving."
        )
    if t.dim() > MAX_DIMS:
        raise UnsupportedObjectError(
            f"tensor at {path!r} has {t.dim()} dimensions; the ckptzip format stores at most {MAX_DIMS}. "
            "Reshape it before saving."
        )


def _ndarray_to_tensor(a: np.ndarray, path: str) -> torch.Tensor:
    """A tensor sharing (or, for a non-native byte order, holding a native copy of) ``a``'s values."""
    if not a.dtype.isnative:  # big-endian data: same values, stored (and loaded) little-endian
        a = a.astype(a.dtype.newbyteorder("="))
    try:
        t = torch.from_numpy(a if a.flags.c_contiguous else a.copy(order="C"))  # keeps 0-d arrays 0-d
    except TypeError as exc:
        raise UnsupportedObjectError(f"NumPy array at {path!r} has dtype {a.dtype}, which torch cannot hold") from exc
    _check_storable(t, path)
    return t


def is_storable(obj: Any) -> bool:
    """Whether :func:`flatten` stores ``obj`` as it is (raises no ``UnsupportedObjectError``)."""
    try:
        flatten(obj)
    except UnsupportedObjectError:
        return False
    return True


def flatten(obj: Any) -> Flattened:
    """Encode ``obj`` as a JSON-able tree; tensors go to a table the tree refers to by position."""
    flattener = _Flattener()
    try:
        tree = flattener.encode(obj, "", 0)
    except RecursionError as exc:  # a caller already deep in its own stack
        raise UnsupportedObjectError(f"object nested too deeply to store ({exc}); flatten it first") from None
    return Flattened(tree, flattener.tensors)


_UNFINISHED = object()  # the slot of a container whose decoding has begun but not ended


class _Unflattener:
    def __init__(self, tensor: Callable[[int], Any], ntensors: int,
                 array: Callable[[int], Any] | None = None) -> None:
        self.tensor = tensor
        self.array = array or (lambda i: tensor(i).cpu().numpy())
        self.ntensors = ntensors
        self.containers: list[Any] = []  # decoded containers, numbered in pre-order as when encoded

    def container(self, build: Callable[[], Any]) -> Any:
        """Number a container before its contents (pre-order), as the encoder does."""
        number = len(self.containers)
        self.containers.append(_UNFINISHED)
        self.containers[number] = obj = build()
        return obj

    def alias(self, body: Any) -> Any:
        if type(body) is not int or not 0 <= body < len(self.containers):
            raise CorruptCheckpointError(
                f"tree refers to container {body!r:.40}, expected an index in [0, {len(self.containers)}): "
                "the containers decoded so far"
            )
        obj = self.containers[body]
        if obj is _UNFINISHED:
            raise CorruptCheckpointError(f"tree refers to container {body} from inside itself (a cycle)")
        return obj

    def index(self, value: Any, what: str) -> int:
        if type(value) is not int or not 0 <= value < self.ntensors:
            raise CorruptCheckpointError(
                f"tree refers to {what} {value!r}, expected an index in [0, {self.ntensors})"
            )
        return value

    def decode(self, node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise CorruptCheckpointError(f"tree nested deeper than {MAX_DEPTH} levels")
        if node is None or (isinstance(node, (bool, str, int)) and not isinstance(node, float)):
            return node
        if isinstance(node, list):
            return self.container(lambda: [self.decode(v, depth + 1) for v in node])
        if not isinstance(node, dict) or not node:
            raise CorruptCheckpointError(f"tree holds {type(node).__name__} {node!r:.80}, expected a tagged value")
        tag = next(iter(node))
        body = node[tag]
        try:
            return self._decode_tagged(tag, body, node, depth)
        except (TypeError, ValueError, KeyError, struct.error) as exc:
            if isinstance(exc, CorruptCheckpointError):
                raise
            raise CorruptCheckpointError(f"tree holds a malformed {tag!r} value: {exc}") from exc

    def _decode_tagged(self, tag: str, body: Any, node: dict[str, Any], depth: int) -> Any:
        expected_keys = {"odict": {"odict", "meta"}}.get(tag, {tag})
        if set(node) != expected_keys:
            raise CorruptCheckpointError(f"tree value has keys {sorted(node)}, expected {sorted(expected_keys)}")
        if tag == "float":
            if not isinstance(body, str) or len(body) != 16:
                raise ValueError("expected 16 hex digits")
            return struct.unpack(">d", bytes.fromhex(body))[0]
        if tag == "bytes":
            return base64.b64decode(_str(body), validate=True)
        if tag == "tensor":
            return self.tensor(self.index(body, "tensor"))
        if tag == "ndarray":
            return self.array(self.index(body, "array"))
        if tag == "npscalar":
            dtype, raw = _pair(body)
            values = np.frombuffer(bytes.fromhex(_str(raw)), dtype=np.dtype(_str(dtype)))
            if values.shape != (1,):
                raise ValueError(f"expected the bytes of one {dtype}, found {len(values)} values")
            return values[0]
        if tag == "dtype":
            return _torch_dtype(_str(body))
        if tag == "device":
            return _torch_device(_str(body))
        if tag == "size":
            return torch.Size(_size_list(body))
        if tag == "alias":
            return self.alias(body)
        if tag == "tuple":
            return self.container(lambda: tuple(self.decode(v, depth + 1) for v in _list(body)))
        if tag in ("dict", "odict"):
            return self.container(lambda: self._decode_dict(tag, body, node, depth))
        raise CorruptCheckpointError(f"tree holds unknown value tag {tag!r}")


    def _decode_dict(self, tag: str, body: Any, node: dict[str, Any], depth: int) -> dict[Any, Any]:
        out: dict[Any, Any] = {} if tag == "dict" else collections.OrderedDict()
        for pair in _list(body):
            key, value = _pair(pair)
            key = self.decode(key, depth + 1)
            try:
                out[key] = self.decode(value, depth + 1)
            except TypeError as exc:
                raise CorruptCheckpointError(f"tree holds an unhashable dict key {key!r:.80}") from exc
        if tag == "odict":
            meta = self.decode(node["meta"], depth + 1)
            if meta is not None:  # torch's state_dict metadata, an attribute of the OrderedDict
                setattr(out, "_metadata", meta)  # noqa: B010 (out is typed dict, which has no _metadata)
        return out


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"expected a string, found {type(v).__name__}")
    return v


def _list(v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise TypeError(f"expected an array, found {type(v).__name__}")
    return v


def _pair(v: Any) -> list[Any]:
    if not isinstance(v, list) or len(v) != 2:
        raise TypeError(f"expected a pair, found {v!r:.80}")
    return v


def _size_list(v: Any) -> list[int]:
    """The sizes of a ``torch.Size``: int64 values, as torch holds them (a larger one made a
    Size whose ``str`` raises, or a raw ``ValueError``)."""
    if not isinstance(v, list) or not all(type(x) is int and 0 <= x < 1 << 63 for x in v):
        raise TypeError(f"expected a list of integers in [0, 2**63), found {v!r:.80}")
    return v


def _torch_dtype(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown torch dtype {name!r:.40}") from None


def _torch_device(name: str) -> torch.device:
    try:
        return torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {name!r:.40}") from exc


def unflatten(tree: Any, tensor: Callable[[int], torch.Tensor], ntensors: int) -> Any:
    """Rebuild the saved object; ``tensor(i)`` returns entry i of the tensor table."""
    return _decode(_Unflattener(tensor, ntensors), tree)


def plain_values(tree: Any, ntensors: int) -> dict[str, Any]:
    """Every value of the saved object that holds no tensor or array (a leaf, or a container of
    such values: ``optimizer.param_groups.0``), by its dotted path (as :func:`iter_leaves` names
    it, and the tensors' names are made): what a lazy reader gives without decoding a tensor."""
    slot = object()  # stands for every tensor and array
    obj = _decode(_Unflattener(lambda _: slot, ntensors, lambda _: slot), tree)
    values: dict[str, Any] = {}
    plain: dict[int, bool] = {}  # per container: whether it holds no tensor (a shared one is walked once)

    def walk(value: Any, at: str) -> bool:
        if is_container(value):
            if id(value) not in plain:  # every child walked: the values beside a tensor count too
                plain[id(value)] = all([walk(child, child_path) for child_path, child in _children(value, at)])
            held = plain[id(value)]
        else:
            held = value is not slot
        if held:
            values[at] = value
        return held

    walk(obj, "")
    return values


def _decode(unflattener: _Unflattener, tree: Any) -> Any:
    try:
        return unflattener.decode(tree, 0)
    except RecursionError as exc:  # a caller already deep in its own stack
        raise CorruptCheckpointError(f"tree nested too deeply to load ({exc})") from None
