"""PyTorch Lightning integration: a ``CheckpointIO`` plugin that writes ``.ckz`` checkpoints.

    from ckptzip.integrations.lightning import CkptzipCheckpointIO

    trainer = Trainer(plugins=[CkptzipCheckpointIO()])

Every checkpoint the Trainer (or Fabric) writes through its strategy becomes a ckptzip container;
file names are Lightning's (see docs/INTEGRATIONS.md for ``.ckz`` names). Loading detects the
container by its magic bytes, so checkpoints written before the plugin was enabled still load.

Works with the ``lightning`` package and with the standalone ``pytorch_lightning``: the class
derives from one package's ``CheckpointIO`` and is registered as a virtual subclass of the other's.
"""

from __future__ import annotations

import collections
import os
import warnings
from typing import Any, Literal, get_args

import ckptzip
from ckptzip.errors import CorruptCheckpointError, UnsupportedObjectError
from ckptzip.format.spec import MAGIC
from ckptzip.tree import flatten

try:
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.fabric.utilities.cloud_io import get_filesystem
except ImportError:  # standalone pytorch_lightning only
    try:
        from lightning_fabric.plugins import TorchCheckpointIO  # type: ignore[assignment]
        from lightning_fabric.utilities.cloud_io import get_filesystem
    except ImportError as exc:
        raise ImportError(
            "ckptzip.integrations.lightning needs PyTorch Lightning, which is not installed; "
            "install it with: pip install 'ckptzip[lightning]'"
        ) from exc

__all__ = ["CkptzipCheckpointIO", "OnUnsupported"]

OnUnsupported = Literal["error", "repr", "drop"]

_DROP = object()


class CkptzipCheckpointIO(TorchCheckpointIO):
    """Save Lightning checkpoints with :func:`ckptzip.save`, load them with :func:`ckptzip.load`.

    Args:
        codec: ckptzip preset or codec id for every tensor (see :func:`ckptzip.save`).
        on_unsupported: what to do with a value ckptzip cannot store without pickling (an object
            in ``hyper_parameters`` or in a callback's state, for example):
            ``"error"`` raises :class:`~ckptzip.errors.UnsupportedObjectError` naming its path;
            ``"repr"`` stores ``repr(value)`` instead; ``"drop"`` leaves the dict entry out (a
            list or tuple item becomes ``None``, so positions hold). Both of the latter warn
            with the affected paths. Dict keys follow the same rule.
    """

    def __init__(self, codec: str = "auto", on_unsupported: OnUnsupported = "error") -> None:
        super().__init__()
        if on_unsupported not in get_args(OnUnsupported):
            raise ValueError(f"on_unsupported must be one of {get_args(OnUnsupported)}, got {on_unsupported!r}")
        self.codec = codec
        self.on_unsupported = on_unsupported

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path`` as a ``.ckz`` container; a failed save leaves no file."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        if self.on_unsupported != "error":
            checkpoint = self._replace_unsupported(checkpoint)
        fs = get_filesystem(path)
        fs.makedirs(os.path.dirname(str(path)), exist_ok=True)
        try:
            if _is_local(fs):
                ckptzip.save(checkpoint, path, codec=self.codec)
            else:  # the transaction discards the object if saving fails
                with fs.transaction, fs.open(str(path), "wb") as f:
                    ckptzip.save(checkpoint, f, codec=self.codec)
        except UnsupportedObjectError as exc:
            raise UnsupportedObjectError(
                f"{exc} In a Lightning checkpoint such values usually come from save_hyperparameters() "
                "(exclude them with ignore=[...]) or from a callback's state_dict(); or construct "
                "CkptzipCheckpointIO(on_unsupported='repr' or 'drop') to store their repr or leave them out."
            ) from exc

    def load_checkpoint(
        self, path: Any, map_location: Any = "cpu", weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load a ``.ckz`` checkpoint; any other file is loaded as ``TorchCheckpointIO`` would.

        ``map_location`` defaults to the CPU, as with ``TorchCheckpointIO``; Lightning moves the
        state to the training device afterwards. ``weights_only`` only matters for non-ckptzip
        files: loading a ``.ckz`` never runs code.
        """
        fs = get_filesystem(path)
        if not fs.exists(str(path)):
            raise ckptzip.CheckpointNotFoundError(f"no checkpoint at {str(path)!r}")
        with fs.open(str(path), "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
            f.seek(0)
            checkpoint = ckptzip.load(f, map_location=map_location)
        if not isinstance(checkpoint, dict):
            raise CorruptCheckpointError(
                f"{str(path)!r} is a ckptzip file holding a {type(checkpoint).__name__}, not a Lightning checkpoint "
                "(a dict); load it with ckptzip.load() instead"
            )
        return checkpoint

    def _replace_unsupported(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        paths: list[str] = []
        replaced: dict[str, Any] = _replace(checkpoint, "", self.on_unsupported, paths)
        if paths:
            action = "stored as repr() strings" if self.on_unsupported == "repr" else "left out"
            warnings.warn(
                f"ckptzip cannot store {len(paths)} value(s) of this checkpoint without pickling; they were "
                f"{action}: {', '.join(paths)}",
                UserWarning,
                stacklevel=3,
            )
        return replaced


def _is_local(fs: Any) -> bool:
    return "file" in ((fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol)


def _storable(value: Any) -> bool:
    try:
        flatten(value)
    except UnsupportedObjectError:
        return False
    return True


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _replace(obj: Any, path: str, policy: str, paths: list[str]) -> Any:
    """``obj`` with every value ckptzip cannot store replaced per ``policy`` (``_DROP`` to drop it).

    Recurses into exactly the containers ckptzip recurses into and returns ``obj`` itself when
    nothing inside it changed, so the common case copies nothing.
    """
    if type(obj) in (dict, collections.OrderedDict):
        items, changed = [], False
        for key, value in obj.items():
            new_key = _replace(key, _join(path, f"<key {key!r}>"), policy, paths)
            new_value = value if new_key is _DROP else _replace(value, _join(path, key), policy, paths)
            changed |= new_key is not key or new_value is not value
            if new_key is not _DROP and new_value is not _DROP:
                items.append((new_key, new_value))
        if not changed:
            return obj
        out = type(obj)(items)
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata
        return out
    if type(obj) in (list, tuple):
        values = [_replace(v, _join(path, i), policy, paths) for i, v in enumerate(obj)]
        if all(new is old for new, old in zip(values, obj)):
            return obj
        return type(obj)(None if v is _DROP else v for v in values)
    if _storable(obj):
        return obj
    paths.append(f"{path or '<root>'} ({type(obj).__module__}.{type(obj).__qualname__})")
    return repr(obj) if policy == "repr" else _DROP


def _register_with_other_lightning_package() -> None:
    """Make ``isinstance(plugin, CheckpointIO)`` hold for the package this class does not derive from."""
    for module in ("lightning_fabric.plugins", "lightning.fabric.plugins"):
        try:
            base = __import__(module, fromlist=["CheckpointIO"]).CheckpointIO
        except ImportError:
            continue
        if not issubclass(CkptzipCheckpointIO, base):
            base.register(CkptzipCheckpointIO)


_register_with_other_lightning_package()
