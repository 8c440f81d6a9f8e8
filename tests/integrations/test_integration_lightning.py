"""CkptzipCheckpointIO with real Lightning Trainers on a tiny CPU model."""

from __future__ import annotations

import argparse
import copy
import pathlib
from typing import Any

import pytest
import torch
from helpers import assert_same, state_copy

pl = pytest.importorskip("lightning.pytorch")

import ckptzip  # noqa: E402
from ckptzip.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedObjectError, UsageError  # noqa: E402
from ckptzip.format.spec import MAGIC  # noqa: E402
from ckptzip.integrations.lightning import CkptzipCheckpointIO  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*number of training batches.*log_every_n_steps:UserWarning"),
]


def make_module_class(namespace: Any) -> type:
    class Tiny(namespace.LightningModule):
        def __init__(self, hidden: int = 8, lr: float = 0.05, name: str = "tiny", extra: Any = None) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).squeeze(1), y)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}

    return Tiny


Tiny = make_module_class(pl)


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 3, generator=g), torch.randn(16, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=4)


def trainer(root: pathlib.Path, max_epochs: int, namespace: Any = pl, **kwargs: Any) -> Any:
    return namespace.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=max_epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        **kwargs,
    )


def ckz_callback(dirpath: pathlib.Path) -> Any:
    callback = pl.callbacks.ModelCheckpoint(dirpath=dirpath, save_last=True)
    callback.FILE_EXTENSION = ".ckz"
    return callback


class RecordingIO(CkptzipCheckpointIO):
    """Keeps a deep copy of every checkpoint dict Lightning hands over."""

    def __init__(self) -> None:
        super().__init__()
        self.saved: dict[str, dict] = {}

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.saved[str(path)] = copy.deepcopy(checkpoint)
        super().save_checkpoint(checkpoint, path, storage_options)


def test_lightning_checkpoint_round_trips_exactly(tmp_path: pathlib.Path) -> None:
    io = RecordingIO()
    torch.manual_seed(0)
    trainer(tmp_path, 2, plugins=[io], callbacks=[ckz_callback(tmp_path / "ckpt")]).fit(Tiny(), loader())

    # save_top_k=1 removed the epoch-0 checkpoint through the plugin
    assert sorted(pathlib.Path(p).name for p in io.saved) == ["epoch=0-step=4.ckz", "epoch=1-step=8.ckz", "last.ckz"]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch=1-step=8.ckz", "last.ckz"]
    for path, expected in io.saved.items():
        if "epoch=0" in path:
            continue
        assert pathlib.Path(path).read_bytes()[: len(MAGIC)] == MAGIC
        loaded = io.load_checkpoint(path)
        assert_same(loaded, expected, device=True)
        assert set(loaded) >= {"state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks"}
        assert loaded["hyper_parameters"] == {"hidden": 8, "lr": 0.05, "name": "tiny", "extra": None}


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty:UserWarning")
@pytest.mark.parametrize("io_class", [CkptzipCheckpointIO, pl.plugins.TorchCheckpointIO])
def test_resume_from_last_matches_uninterrupted_training(tmp_path: pathlib.Path, io_class: type) -> None:
    torch.manual_seed(0)
    straight = Tiny()
    straight_trainer = trainer(tmp_path / "straight", 4, enable_checkpointing=False)
    straight_trainer.fit(straight, loader())

    ckpt_dir = tmp_path / "ckpt"
    torch.manual_seed(0)
    trainer(tmp_path, 2, plugins=[io_class()], callbacks=[ckz_callback(ckpt_dir)]).fit(Tiny(), loader())
    torch.manual_seed(1)  # different init: everything must come from the checkpoint
    resumed = Tiny()
    resumed_trainer = trainer(tmp_path, 4, plugins=[CkptzipCheckpointIO()], callbacks=[ckz_callback(ckpt_dir)])
    resumed_trainer.fit(resumed, loader(), ckpt_path="last")

    assert resumed_trainer.global_step == straight_trainer.global_step == 16
    assert_same(state_copy(resumed), state_copy(straight), device=True)
    assert_same(resumed_trainer.optimizers[0].state_dict(), straight_trainer.optimizers[0].state_dict(), device=True)


def test_pytorch_lightning_namespace_is_supported(tmp_path: pathlib.Path) -> None:
    standalone = pytest.importorskip("pytorch_lightning")
    torch.manual_seed(0)
    model = make_module_class(standalone)()
    trainer(tmp_path, 1, namespace=standalone, plugins=[CkptzipCheckpointIO()]).fit(model, loader())
    (path,) = (tmp_path / "checkpoints").iterdir()
    assert path.read_bytes()[: len(MAGIC)] == MAGIC
    assert_same(ckptzip.load(path)["state_dict"], model.state_dict(), device=True)


def test_fabric_save_and_load(tmp_path: pathlib.Path) -> None:
    import lightning

    fabric = lightning.Fabric(accelerator="cpu", devices=1, plugins=[CkptzipCheckpointIO()])
    torch.manual_seed(0)
    model, optimizer = fabric.setup(*_model_and_optimizer())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    fabric.save(tmp_path / "state.ckz", {"model": model, "optimizer": optimizer, "step": 1})
    assert (tmp_path / "state.ckz").read_bytes()[: len(MAGIC)] == MAGIC

    restored_model, restored_optimizer = fabric.setup(*_model_and_optimizer())
    state = {"model": restored_model, "optimizer": restored_optimizer, "step": 0}
    assert fabric.load(tmp_path / "state.ckz", state) == {}
    assert state["step"] == 1
    assert_same(restored_model.state_dict(), model.state_dict(), device=True)
    assert_same(restored_optimizer.state_dict(), optimizer.state_dict(), device=True)


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.Adam(model.parameters())


def checkpoint_with_unsupported_values() -> dict[str, Any]:
    return {
        "state_dict": {"w": torch.arange(4.0)},
        "hyper_parameters": {"lr": 0.1, "data_dir": pathlib.Path("/data"), "dims": [1, pathlib.Path("/x")]},
        "callbacks": {pathlib.Path("/key"): 1, "ok": {"n": 2}},
    }


def test_unsupported_value_raises_with_its_path(tmp_path: pathlib.Path) -> None:
    with pytest.raises(UnsupportedObjectError) as info:
        CkptzipCheckpointIO(on_unsupported="error").save_checkpoint(checkpoint_with_unsupported_values(), tmp_path / "a.ckpt")
    message = str(info.value)
    assert "'hyper_parameters.data_dir'" in message and "PosixPath" in message
    assert "save_hyperparameters()" in message and "on_unsupported='repr' or 'drop'" in message
    assert not (tmp_path / "a.ckpt").exists()


def test_unsupported_hyperparameter_fails_fit_with_a_clear_error(tmp_path: pathlib.Path) -> None:
    model = Tiny(extra=pathlib.Path("/data"))
    with pytest.raises(UnsupportedObjectError, match=r"'hyper_parameters\.extra'"):
        trainer(tmp_path, 1, plugins=[CkptzipCheckpointIO(on_unsupported="error")]).fit(model, loader())


class Opaque:
    """A value with no plain form: neither ckptzip nor --trust-pickle's conversions store it."""


def test_by_default_what_trust_pickle_converts_is_converted_once_said(tmp_path: pathlib.Path) -> None:
    """Issue #44: a Namespace or Path in the hyperparameters failed the first checkpoint."""
    model = Tiny(extra={"args": argparse.Namespace(lr=0.1, out=pathlib.Path("/out")), pathlib.Path("/k"): 1})
    with pytest.warns(UserWarning) as caught:
        trainer(tmp_path, 2, plugins=[CkptzipCheckpointIO()]).fit(model, loader())
    said = [str(w.message) for w in caught if "ckptzip" in str(w.message)]
    assert said == [  # once, though two checkpoints were written
        "ckptzip cannot store 3 value(s) of this checkpoint without pickling; they were converted to values it "
        "stores, which is what loads back: hyper_parameters.extra.args: argparse.Namespace -> dict, "
        "hyper_parameters.extra.args.out: pathlib.PosixPath -> str, hyper_parameters.extra.<key PosixPath('/k')>: "
        "pathlib.PosixPath -> str"]
    (path,) = (tmp_path / "checkpoints").iterdir()
    assert ckptzip.load(path)["hyper_parameters"]["extra"] == {"args": {"lr": 0.1, "out": "/out"}, "/k": 1}


def test_as_a_callback_it_checks_the_hyperparameters_at_setup_before_training(tmp_path: pathlib.Path) -> None:
    """Issue #44: the plugin failed at the first checkpoint, an epoch in; as a callback it fails
    when the Trainer sets up."""
    for io, match in ((CkptzipCheckpointIO(), r"1 object\(s\) of this state: hyper_parameters\.extra: "
                       r"test_integration_lightning\.Opaque\. In a Lightning checkpoint such values usually come "
                       r"from save_hyperparameters\(\)"),
                      (CkptzipCheckpointIO(on_unsupported="error"), r"'hyper_parameters\.extra'.*save_hyperparameters")):
        extra = Opaque() if io.on_unsupported == "convert" else pathlib.Path("/data")
        model = Tiny(extra=extra)
        run = trainer(tmp_path, 1, callbacks=[io])
        with pytest.raises(UnsupportedObjectError, match=match):
            run.fit(model, loader())
        assert run.global_step == 0 and not (tmp_path / "checkpoints").exists()


def test_as_a_callback_it_becomes_the_checkpoint_io_and_says_its_conversions_at_setup(tmp_path: pathlib.Path) -> None:
    io = CkptzipCheckpointIO()
    model = Tiny(extra=argparse.Namespace(data=pathlib.Path("/data")))
    run = trainer(tmp_path, 1, callbacks=[io])
    with pytest.warns(UserWarning, match=r"2 value\(s\).*converted.*hyper_parameters\.extra: argparse\.Namespace"):
        run.fit(model, loader())
    assert run.strategy.checkpoint_io is io
    (path,) = (tmp_path / "checkpoints").iterdir()
    assert path.read_bytes()[: len(MAGIC)] == MAGIC
    assert ckptzip.load(path)["hyper_parameters"]["extra"] == {"data": "/data"}
    again = trainer(tmp_path / "again", 1, plugins=[io], callbacks=[io])  # in both: the same one
    again.fit(Tiny(), loader())
    assert again.strategy.checkpoint_io is io


def test_as_a_callback_it_may_be_inside_lightnings_asynchronous_checkpoint_io(tmp_path: pathlib.Path) -> None:
    io = CkptzipCheckpointIO()
    wrapper = pl.plugins.AsyncCheckpointIO(io)
    trainer(tmp_path, 1, plugins=[wrapper], callbacks=[io]).fit(Tiny(), loader())
    assert wrapper.checkpoint_io is io
    (path,) = (tmp_path / "checkpoints").iterdir()
    assert path.read_bytes()[: len(MAGIC)] == MAGIC
    with pytest.raises(UsageError, match=r"already has a checkpoint IO \(AsyncCheckpointIO\) besides this "
                       r"CkptzipCheckpointIO: give one of them \(a wrapper takes this one inside: "
                       r"plugins=\[AsyncCheckpointIO\(io\)\], callbacks=\[io\]\)"):
        trainer(tmp_path / "b", 1, plugins=[pl.plugins.AsyncCheckpointIO()], callbacks=[io]).fit(Tiny(), loader())


def test_as_a_callback_beside_another_checkpoint_io_is_a_usage_error(tmp_path: pathlib.Path) -> None:
    class Other(pl.plugins.TorchCheckpointIO):
        pass

    with pytest.raises(UsageError, match=r"already has a checkpoint IO \(.*Other\) besides this CkptzipCheckpointIO"):
        trainer(tmp_path, 1, plugins=[Other()], callbacks=[CkptzipCheckpointIO()]).fit(Tiny(), loader())


def test_as_a_callback_with_the_standalone_pytorch_lightning(tmp_path: pathlib.Path) -> None:
    standalone = pytest.importorskip("pytorch_lightning")
    io = CkptzipCheckpointIO()
    run = trainer(tmp_path, 1, namespace=standalone, callbacks=[io])
    run.fit(make_module_class(standalone)(), loader())
    assert run.strategy.checkpoint_io is io
    (path,) = (tmp_path / "checkpoints").iterdir()
    assert path.read_bytes()[: len(MAGIC)] == MAGIC


def test_on_unsupported_repr(tmp_path: pathlib.Path) -> None:
    checkpoint = checkpoint_with_unsupported_values()
    with pytest.warns(UserWarning, match=r"3 value\(s\).*repr\(\) strings: hyper_parameters\.data_dir \(pathlib"):
        CkptzipCheckpointIO(on_unsupported="repr").save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    loaded = ckptzip.load(tmp_path / "a.ckpt")
    assert loaded["hyper_parameters"] == {"lr": 0.1, "data_dir": "PosixPath('/data')", "dims": [1, "PosixPath('/x')"]}
    assert loaded["callbacks"] == {"PosixPath('/key')": 1, "ok": {"n": 2}}
    assert_same(loaded["state_dict"], checkpoint["state_dict"], device=True)
    assert isinstance(checkpoint["hyper_parameters"]["data_dir"], pathlib.Path)  # caller's dict untouched


def test_on_unsupported_drop(tmp_path: pathlib.Path) -> None:
    with pytest.warns(UserWarning, match=r"left out: hyper_parameters\.data_dir"):
        CkptzipCheckpointIO(on_unsupported="drop").save_checkpoint(
            checkpoint_with_unsupported_values(), tmp_path / "a.ckpt"
        )
    loaded = ckptzip.load(tmp_path / "a.ckpt")
    assert loaded["hyper_parameters"] == {"lr": 0.1, "dims": [1, None]}
    assert loaded["callbacks"] == {"ok": {"n": 2}}


@pytest.mark.filterwarnings("error")
def test_policy_leaves_a_storable_checkpoint_alone(tmp_path: pathlib.Path) -> None:
    checkpoint = {"state_dict": {"w": torch.ones(2)}, "hyper_parameters": {"lr": 0.1, "betas": (0.9, 0.99)}}
    CkptzipCheckpointIO(on_unsupported="drop").save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    assert_same(ckptzip.load(tmp_path / "a.ckpt"), checkpoint, device=True)


def test_loads_a_torch_checkpoint_written_before_the_plugin(tmp_path: pathlib.Path) -> None:
    checkpoint = {"state_dict": {"w": torch.arange(3.0)}, "epoch": 2}
    torch.save(checkpoint, tmp_path / "old.ckpt")
    assert_same(CkptzipCheckpointIO().load_checkpoint(tmp_path / "old.ckpt"), checkpoint, device=True)


def test_remote_paths_go_through_fsspec_and_a_failed_save_leaves_nothing() -> None:
    pytest.importorskip("fsspec")
    io = CkptzipCheckpointIO()
    checkpoint = {"state_dict": {"w": torch.arange(5, dtype=torch.bfloat16)}, "epoch": 1}
    io.save_checkpoint(checkpoint, "memory://ckptzip-test/run/a.ckpt")
    assert_same(io.load_checkpoint("memory://ckptzip-test/run/a.ckpt"), checkpoint, device=True)
    io.remove_checkpoint("memory://ckptzip-test/run/a.ckpt")
    with pytest.raises(UnsupportedObjectError):
        CkptzipCheckpointIO(on_unsupported="error").save_checkpoint(
            checkpoint_with_unsupported_values(), "memory://ckptzip-test/run/a.ckpt")
    with pytest.raises(CheckpointNotFoundError, match=r"no checkpoint at 'memory://ckptzip-test/run/a\.ckpt'"):
        io.load_checkpoint("memory://ckptzip-test/run/a.ckpt")


def test_ckz_that_is_not_a_checkpoint_dict_is_rejected(tmp_path: pathlib.Path) -> None:
    ckptzip.save(torch.ones(2), tmp_path / "tensor.ckz")
    with pytest.raises(CorruptCheckpointError, match=r"is a ckptzip file holding a Tensor, not a Lightning checkpoint \(a dict\)"):
        CkptzipCheckpointIO().load_checkpoint(tmp_path / "tensor.ckz")


def test_missing_checkpoint_is_a_file_not_found_error(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        CkptzipCheckpointIO().load_checkpoint(tmp_path / "nope.ckpt")


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"on_unsupported must be one of \('convert', 'error', 'repr', 'drop'\), got 'pickle'"):
        CkptzipCheckpointIO(on_unsupported="pickle")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="takes no storage_options"):
        CkptzipCheckpointIO().save_checkpoint({}, "x.ckpt", storage_options={"a": 1})
