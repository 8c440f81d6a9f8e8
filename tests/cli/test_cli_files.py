"""The files users have (issue #23): torch.save files holding objects that torch's weights_only
unpickler refuses (``compress --trust-pickle``), and .pt files that ``torch.load(weights_only=True)``
reads (``decompress`` of a state holding NumPy values)."""

from __future__ import annotations

import argparse
import collections
from pathlib import Path, PurePosixPath
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import ckptzip
from ckptzip.cli import main
from helpers import assert_same

Point = collections.namedtuple("Point", ["x", "y"])


@pytest.fixture(autouse=True)
def _default_safe_globals() -> Iterator[None]:
    """torch.load's weights_only allow-list as torch ships it: libraries imported by other tests
    widen it for the whole process (megatron-core registers Namespace, PosixPath and more)."""
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    yield
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(saved)


class EmaWeights(collections.OrderedDict[str, torch.Tensor]):
    """A state-dict class of a user's own."""


def _lightning_like(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A checkpoint as Lightning and HF trainers write them: weights and optimizer state, with
    hyperparameters as an argparse.Namespace holding a path, a defaultdict, a namedtuple and an
    OrderedDict subclass."""
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    state = {
        "state_dict": model.state_dict(),
        "optimizer_states": [optimizer.state_dict()],
        "lr_schedulers": [scheduler.state_dict()],
        "hyper_parameters": argparse.Namespace(lr=0.1, data_dir=PurePosixPath("data/train"), layers=[4, 3]),
        "loops": collections.defaultdict(list, fit=[1, 2]),
        "origin": Point(1, 2),
        "ema": EmaWeights(weight=model.weight.detach().clone()),
        "epoch": 3,
    }
    torch.save(state, tmp_path / "run.ckpt")
    return tmp_path / "run.ckpt", state


def test_a_refused_pickle_is_a_clean_error_naming_trust_pickle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, _ = _lightning_like(tmp_path)
    assert main(["compress", str(src), str(tmp_path / "run.ckz")]) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err and "add_safe_globals" not in err
    assert "holds pickled objects that torch.load(weights_only=True) refuses (Unsupported global: GLOBAL " \
        "argparse.Namespace was not an allowed global by default)" in err
    assert "if you trust the file, pass --trust-pickle" in err
    assert not (tmp_path / "run.ckz").exists()


def test_trust_pickle_converts_what_ckptzip_stores_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, state = _lightning_like(tmp_path)
    assert main(["compress", "--trust-pickle", str(src), str(tmp_path / "run.ckz")]) == 0
    err = capsys.readouterr().err
    assert "ckptzip: warning: --trust-pickle loads " in err and "which runs any code pickled in the file" in err
    assert "note: converted 5 entries to values ckptzip stores:\n" \
        "  hyper_parameters: argparse.Namespace -> dict\n" \
        "  hyper_parameters.data_dir: pathlib.PurePosixPath -> str\n" \
        "  loops: collections.defaultdict -> dict\n" \
        "  origin: test_cli_files.Point -> dict\n" \
        "  ema: test_cli_files.EmaWeights -> collections.OrderedDict\n" in err
    back = ckptzip.load(tmp_path / "run.ckz")
    assert back["hyper_parameters"] == {"lr": 0.1, "data_dir": "data/train", "layers": [4, 3]}
    assert (back["loops"], back["origin"], back["epoch"]) == ({"fit": [1, 2]}, {"x": 1, "y": 2}, 3)
    assert_same(back["ema"], collections.OrderedDict(state["ema"]))
    for key in ("state_dict", "optimizer_states", "lr_schedulers"):
        assert_same(back[key], state[key])


def test_an_object_ckptzip_cannot_store_is_an_error_or_with_skip_unsupported_left_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)  # the object, not its state_dict
    torch.save({"w": model.weight.detach(), "scheduler": scheduler, "callbacks": [len, 5]}, tmp_path / "a.pt")
    argv = ["compress", "--trust-pickle", str(tmp_path / "a.pt"), str(tmp_path / "a.ckz")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "ckptzip: error: ckptzip cannot store 2 object(s) of this state: scheduler: " \
        "torch.optim.lr_scheduler.StepLR; callbacks.0: builtin_function_or_method. Pass --skip-unsupported" in err
    assert not (tmp_path / "a.ckz").exists()

    assert main([*argv, "--skip-unsupported"]) == 0
    assert "note: left out 2 entries that ckptzip cannot store (--skip-unsupported):\n" \
        "  scheduler: torch.optim.lr_scheduler.StepLR\n  callbacks.0: builtin_function_or_method\n" \
        in capsys.readouterr().err
    back = ckptzip.load(tmp_path / "a.ckz")
    assert set(back) == {"w", "callbacks"} and back["callbacks"] == [None, 5]
    assert_same(back["w"], model.weight.detach())


def test_an_error_names_ten_objects_and_an_unsupported_whole_state_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save({f"f{i}": len for i in range(12)}, tmp_path / "many.pt")
    assert main(["compress", "--trust-pickle", str(tmp_path / "many.pt"), str(tmp_path / "many.ckz")]) == 1
    assert "cannot store 12 object(s) of this state: f0: builtin_function_or_method; " in (err := capsys.readouterr().err)
    assert "; f9: builtin_function_or_method; and 2 more. Pass --skip-unsupported" in err
    torch.save(len, tmp_path / "one.pt")
    argv = ["compress", "--trust-pickle", "--skip-unsupported", str(tmp_path / "one.pt"), str(tmp_path / "one.ckz")]
    assert main(argv) == 1
    assert "ckptzip: error: the state is a builtin_function_or_method, which ckptzip cannot store" in capsys.readouterr().err


def test_compress_help_says_what_trust_pickle_means(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["compress", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--trust-pickle load SRC with torch.load(weights_only=False), which RUNS ANY CODE PICKLED IN THE FILE" in out
    assert "--skip-unsupported leave out the objects ckptzip cannot store" in out


def test_decompress_writes_numpy_values_as_tensors_that_weights_only_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    arrays = {"mean": np.linspace(0, 1, 7, dtype=np.float32), "counts": np.arange(6, dtype=np.int64).reshape(2, 3)}
    state = {
        "w": torch.randn(5, 3), "stats": arrays, "rng": [np.float64(0.25), np.int32(-3)], "name": "run", "step": 7,
        "lr": 0.5,
    }
    ckptzip.save(state, tmp_path / "s.ckz")
    assert main(["decompress", str(tmp_path / "s.ckz"), str(tmp_path / "s.pt")]) == 0
    assert "note: wrote 4 entries holding NumPy values as tensors of the same dtype and bits, so that " \
        "torch.load(weights_only=True) reads the file:\n  stats.mean: numpy.ndarray -> torch.Tensor\n" \
        "  stats.counts: numpy.ndarray -> torch.Tensor\n  rng.0: numpy.float64 -> torch.Tensor\n" \
        "  rng.1: numpy.int32 -> torch.Tensor\n" in capsys.readouterr().err
    back = torch.load(tmp_path / "s.pt", weights_only=True)
    assert_same(back["w"], state["w"])
    for key, array in arrays.items():
        assert_same(back["stats"][key], torch.from_numpy(array))
    assert_same(back["rng"], [torch.tensor(0.25, dtype=torch.float64), torch.tensor(-3, dtype=torch.int32)])
    assert (back["name"], back["step"], back["lr"]) == ("run", 7, 0.5)
    assert main(["compress", str(tmp_path / "s.pt"), str(tmp_path / "again.ckz")]) == 0
    assert_same(ckptzip.load(tmp_path / "again.ckz"), back)


def test_decompress_names_the_entries_weights_only_will_refuse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckptzip.save({"w": torch.ones(3), "tag": np.str_("fp32")}, tmp_path / "s.ckz")
    assert main(["decompress", str(tmp_path / "s.ckz"), str(tmp_path / "s.pt")]) == 0
    assert "warning: torch.load(weights_only=True) will refuse " in (err := capsys.readouterr().err)
    assert " for 1 entry (NumPy values torch cannot hold); load it with weights_only=False, or keep the .ckz:\n" \
        "  tag: numpy.str_\n" in err
    assert torch.load(tmp_path / "s.pt", weights_only=False)["tag"] == "fp32"


def test_a_real_lightning_checkpoint_with_a_path_in_its_hyperparameters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pl = pytest.importorskip("lightning.pytorch")

    class Model(pl.LightningModule):
        def __init__(self, hparams: argparse.Namespace) -> None:
            super().__init__()
            self.save_hyperparameters(hparams)
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
            return self.layer(batch[0]).sum()

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)]

    trainer = pl.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, accelerator="cpu")
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    trainer.fit(Model(argparse.Namespace(lr=0.1, data=Path("data/train"))), data)
    trainer.save_checkpoint(tmp_path / "real.ckpt")
    capsys.readouterr()

    argv = ["compress", str(tmp_path / "real.ckpt"), str(tmp_path / "real.ckz")]
    assert main(argv) == 1
    assert "refuses (Unsupported global: GLOBAL pathlib.PosixPath was not an allowed global by default)" \
        in capsys.readouterr().err
    assert main([*argv, "--trust-pickle"]) == 0
    assert "  hyper_parameters.data: pathlib.PosixPath -> str\n" in capsys.readouterr().err
    back, original = ckptzip.load(tmp_path / "real.ckz"), torch.load(tmp_path / "real.ckpt", weights_only=False)
    assert back["hyper_parameters"] == {"lr": 0.1, "data": "data/train"}
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "global_step"):
        assert_same(back[key], original[key])
