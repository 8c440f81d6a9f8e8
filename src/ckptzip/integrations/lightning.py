"""PyTorch Lightning integration: a ``CheckpointIO`` plugin that writes ``.ckz`` checkpoints.

    from ckptzip.integrations.lightning import CkptzipCheckpointIO

    trainer = Trainer(callbacks=[CkptzipCheckpointIO()])  # or plugins=[...]; Fabric(plugins=[...])

Every checkpoint the Trainer (or Fabric) writes through its strategy becomes a ckptzip container;
file names are Lightning's (see docs/INTEGRATIONS.md for ``.ckz`` names). Loading detects the
container by its magic bytes, so checkpoints written before the plugin was enabled still load.

Works with the ``lightning`` package and with the standalone ``pytorch_lightning``: the class
derives from one package's ``CheckpointIO`` and is registered as a virtual subclass of the other's.
"""

from __future__ import annotations

import abc
import importlib
import os
import warnings
from typing import Any, Literal, get_args

import ckptzip
from ckptzip.errors import CorruptCheckpointError, UnsupportedObjectError, UsageError
from ckptzip.format import is_ckz
from ckptzip.plain import storable
from ckptzip.tree import DROP, flatten, is_storable, map_tree

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

try:  # the Trainer's callbacks: setup() checks the checkpoint's hyperparameters before training
    from lightning.pytorch import Callback
except ImportError:
    try:
        from pytorch_lightning import Callback  # type: ignore[assignment]
    except ImportError:  # Fabric alone: no Trainer, no callbacks
        Callback = object  # type: ignore[assignment,misc]

__all__ = ["CkptzipCheckpointIO", "OnUnsupported"]

OnUnsupported = Literal["convert", "error", "repr", "drop"]

_HINT = ("In a Lightning checkpoint such values usually come from save_hyperparameters() (exclude them with "
         "ignore=[...]) or from a callback's state_dict(); or construct CkptzipCheckpointIO(on_unsupported='repr' or "
         "'drop') to store their repr or leave them out.")


class CkptzipCheckpointIO(TorchCheckpointIO, Callback):
    """Save Lightning checkpoints with :func:`ckptzip.save`, load them with :func:`ckptzip.load`.

    A ``CheckpointIO`` plugin (``Trainer(plugins=[...])``, ``Fabric(plugins=[...])``) and, with
    the Trainer, a callback: in ``Trainer(callbacks=[CkptzipCheckpointIO()])`` it makes itself the
    Trainer's checkpoint IO and checks the hyperparameters when the Trainer sets up, so that a
    value it cannot store fails (or is converted, with a warning) before training rather than at
    the first checkpoint, an epoch in.

    Args:
        codec: ckptzip preset or codec id for every tensor (see :func:`ckptzip.save`).
        on_unsupported: what to do with a value ckptzip cannot store without pickling (an object
            in ``hyper_parameters`` or in a callback's state, for example):
            ``"convert"`` (the default) stores what ``ckptzip compress --trust-pickle``
            converts in its plain form (an ``argparse.Namespace``, a dict subclass or a
            namedtuple as a dict, a path as its string, which is what loads back), with a
            warning naming each, and raises :class:`~ckptzip.errors.UnsupportedObjectError`
            naming any other; ``"error"`` raises for every such value, naming its path;
            ``"repr"`` stores ``repr(value)`` instead; ``"drop"`` leaves the dict entry out (a
            list or tuple item becomes ``None``, so positions hold). Warnings name the affected
            paths, each once. Dict keys follow the same rule.
    """

    def __init__(self, codec: str = "auto", on_unsupported: OnUnsupported = "convert") -> None:
        super().__init__()
        if on_unsupported not in get_args(OnUnsupported):
            raise ValueError(f"on_unsupported must be one of {get_args(OnUnsupported)}, got {on_unsupported!r}")
        self.codec = codec
        self.on_unsupported = on_unsupported
        self._warned: set[str] = set()  # the paths a warning named already

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """As a Trainer callback: become the Trainer's checkpoint IO, and check the
        hyperparameters its checkpoints will hold now."""
        _install(trainer.strategy, self)
        stored = self._storable(_hyperparameters(trainer, pl_module))
        try:
            flatten(stored)  # what ckptzip.save would refuse
        except UnsupportedObjectError as exc:
            raise _hinted(exc) from exc

    def teardown(self, *args: Any, **kwargs: Any) -> None:
        """The plugin's ``teardown()`` and the callback's ``teardown(trainer, module, stage)``:
        neither has anything to release."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path`` as a ``.ckz`` container; a failed save leaves no file."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        checkpoint = self._storable(checkpoint)
        fs = get_filesystem(path)
        fs.makedirs(os.path.dirname(str(path)), exist_ok=True)
        try:
            if _is_local(fs):
                ckptzip.save(checkpoint, path, codec=self.codec)
            else:  # the transaction discards the object if saving fails
                with fs.transaction, fs.open(str(path), "wb") as f:
                    ckptzip.save(checkpoint, f, codec=self.codec)
        except UnsupportedObjectError as exc:
            raise _hinted(exc) from exc

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

    def _storable(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """``checkpoint`` as ckptzip stores it under ``on_unsupported`` (in ``"error"``, itself:
        ckptzip.save names what it cannot store); copies only the containers on the way to a
        changed value."""
        if self.on_unsupported == "error":
            return checkpoint
        if self.on_unsupported == "convert":
            plain = storable(checkpoint, advice=_HINT)  # raises naming what has no plain form
            self._warn(plain.converted, "were converted to values it stores, which is what loads back")
            converted: dict[str, Any] = plain.state
            return converted
        return self._replace_unsupported(checkpoint)

    def _replace_unsupported(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """``checkpoint`` with every value (or dict key) ckptzip cannot store stored as its repr
        or left out, as ``on_unsupported`` says."""
        paths: list[str] = []

        def replace(value: Any, path: str) -> Any:
            if is_storable(value):
                return value
            paths.append(f"{path or '<root>'} ({type(value).__module__}.{type(value).__qualname__})")
            return repr(value) if self.on_unsupported == "repr" else DROP

        replaced: dict[str, Any] = map_tree(checkpoint, replace, replace)
        self._warn(paths, "were stored as repr() strings" if self.on_unsupported == "repr" else "were left out")
        return replaced

    def _warn(self, paths: list[str], what: str) -> None:
        """Warn of the changes to ``paths`` not warned of before (a Trainer saves the same
        hyperparameters at every checkpoint)."""
        new = [p for p in paths if p not in self._warned]
        if new:
            self._warned.update(new)
            warnings.warn(f"ckptzip cannot store {len(new)} value(s) of this checkpoint without pickling; they {what}: "
                          f"{', '.join(new)}", UserWarning, stacklevel=4)


def _hinted(exc: UnsupportedObjectError) -> UnsupportedObjectError:
    return UnsupportedObjectError(f"{exc} {_HINT}")


def _install(strategy: Any, io: CkptzipCheckpointIO) -> None:
    """Make ``io`` the checkpoint IO of ``strategy`` in place of Lightning's default; another
    CheckpointIO given too is a conflict (a wrapper such as ``AsyncCheckpointIO`` takes ``io``
    when it is made)."""
    holder = strategy.checkpoint_io  # the default unless a plugin was given
    if holder is io or getattr(holder, "checkpoint_io", None) is io:
        return
    if type(holder) not in _classes("TorchCheckpointIO"):  # the default, of either Lightning package
        raise UsageError(
            f"the Trainer already has a checkpoint IO ({type(holder).__qualname__}) besides this CkptzipCheckpointIO: "
            "give one of them (a wrapper takes this one inside: plugins=[AsyncCheckpointIO(io)], callbacks=[io])")
    strategy.checkpoint_io = io


def _hyperparameters(trainer: Any, pl_module: Any) -> dict[str, Any]:
    """The module's and the datamodule's hyperparameters as Lightning puts them in a checkpoint."""
    state: dict[str, Any] = {}
    for obj in (pl_module, getattr(trainer, "datamodule", None)):
        if obj is not None and obj.hparams:
            if isinstance(obj.hparams, dict):
                state[obj.CHECKPOINT_HYPER_PARAMS_KEY] = dict(obj.hparams)
            else:  # an OmegaConf container, which Lightning stores with its type
                state[obj.CHECKPOINT_HYPER_PARAMS_KEY] = obj.hparams
                state[obj.CHECKPOINT_HYPER_PARAMS_TYPE] = type(obj.hparams)
    return state


def _is_local(fs: Any) -> bool:
    return "file" in ((fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol)


def _classes(name: str) -> tuple[type, ...]:
    """Class ``name`` of the plugins of each Lightning package installed (``lightning.fabric``,
    the standalone ``lightning_fabric``)."""
    found = []
    for module in ("lightning_fabric.plugins", "lightning.fabric.plugins"):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except ImportError:
            continue
    return tuple(found)


def _register_with_other_lightning_package() -> None:
    """Make ``isinstance(plugin, CheckpointIO)`` hold for the package this class does not derive from."""
    for base in _classes("CheckpointIO"):
        if isinstance(base, abc.ABCMeta) and not issubclass(CkptzipCheckpointIO, base):
            base.register(CkptzipCheckpointIO)


_register_with_other_lightning_package()
