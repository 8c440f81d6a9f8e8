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

import os
import warnings
from typing import Any, Literal, get_args

import ckptzip
from ckptzip.errors import CorruptCheckpointError, UnsupportedObjectError
from ckptzip.format import is_ckz
from ckptzip.tree import DROP, is_storable, map_tree

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
            if not is_ckz(f):
                return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
            checkpoint = ckptzip.load(f, map_location=map_location)
        if not isinstance(checkpoint, dict):
            raise CorruptCheckpointError(
                f"{str(path)!r} is a ckptzip file holding a {type(checkpoint).__name__}, not a Lightning checkpoint "
                "(a dict); load it with ckptzip.load() instead"
            )
        return checkpoint

    def _replace_unsupported(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """``checkpoint`` with every value (or dict key) ckptzip cannot store replaced as
        ``on_unsupported`` says; copies only the containers on the way to such a value."""
        paths: list[str] = []

        def replace(value: Any, path: str) -> Any:
            if is_storable(value):
                return value
            paths.append(f"{path or '<root>'} ({type(value).__module__}.{type(value).__qualname__})")
            return repr(value) if self.on_unsupported == "repr" else DROP

        replaced: dict[str, Any] = map_tree(checkpoint, replace, replace)
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
