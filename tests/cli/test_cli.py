"""The file commands of the CLI, as a user runs them: compress, decompress, convert, inspect."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ckptzip
from ckptzip.cli import main
from helpers import adamw_state, assert_same


def _state() -> dict:
    model, optimizer = adamw_state(steps=2)
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 2}


def test_compress_decompress_round_trip_of_a_torch_save_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = _state()
    torch.save(state, tmp_path / "state.pt")
    assert main(["compress", str(tmp_path / "state.pt"), str(tmp_path / "state.ckz")]) == 0
    assert "state.pt" in capsys.readouterr().out
    assert_same(ckptzip.load(tmp_path / "state.ckz"), torch.load(tmp_path / "state.pt", weights_only=True))
    assert main(["decompress", str(tmp_path / "state.ckz"), str(tmp_path / "back.pt")]) == 0
    assert_same(torch.load(tmp_path / "back.pt", weights_only=True), torch.load(tmp_path / "state.pt", weights_only=True))


def test_safetensors_in_and_out(tmp_path: Path) -> None:
    weights = {k: v.contiguous() for k, v in _state()["model"].items()}
    save_file(weights, tmp_path / "w.safetensors")
    assert main(["compress", str(tmp_path / "w.safetensors"), str(tmp_path / "w.ckz"), "--codec", "zstd"]) == 0
    assert main(["decompress", str(tmp_path / "w.ckz"), str(tmp_path / "back.safetensors")]) == 0
    from safetensors.torch import load_file

    back = load_file(tmp_path / "back.safetensors")
    assert_same(dict(sorted(back.items())), dict(sorted(weights.items())))


def test_decompress_to_safetensors_refuses_non_tensor_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckptzip.save(_state(), tmp_path / "s.ckz")
    assert main(["decompress", str(tmp_path / "s.ckz"), str(tmp_path / "s.safetensors")]) == 1
    assert "safetensors holds a flat dict of name -> tensor" in capsys.readouterr().err
    assert not (tmp_path / "s.safetensors").exists()


def test_decompress_to_safetensors_names_the_entries_in_the_way(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue #44: a training state was refused without saying which entries were in the way."""
    state = {"model": {"w": torch.ones(2)}, "optimizer": {"state": {}}, "step": 5, "w": torch.zeros(1), 3: torch.ones(1)}
    state.update({f"extra{i}": i for i in range(10)})
    ckptzip.save(state, tmp_path / "s.ckz")
    assert main(["decompress", str(tmp_path / "s.ckz"), str(tmp_path / "s.safetensors")]) == 1
    assert capsys.readouterr().err == (
        "ckptzip: error: safetensors holds a flat dict of name -> tensor; 14 of the 15 entries of this checkpoint are "
        "not a tensor under a string name: 'model': dict; 'optimizer': dict; 'step': int; 3: torch.Tensor; "
        "'extra0': int; 'extra1': int; 'extra2': int; 'extra3': int; 'extra4': int; 'extra5': int; and 4 more. "
        "Write a torch.save file instead (DST.pt), or save one dict of tensors of it with safetensors "
        "(safetensors.torch.save_file(ckptzip.load(SRC)['model'], ...), say)\n")
    ckptzip.save(torch.ones(2), tmp_path / "t.ckz")
    assert main(["decompress", str(tmp_path / "t.ckz"), str(tmp_path / "t.safetensors")]) == 1
    assert "this checkpoint holds a torch.Tensor. Write a torch.save file" in capsys.readouterr().err


def test_convert_changes_the_codec_and_keeps_the_bits(tmp_path: Path) -> None:
    state = _state()
    ckptzip.save(state, tmp_path / "a.ckz", codec="raw")
    assert main(["convert", str(tmp_path / "a.ckz"), str(tmp_path / "b.ckz"), "--codec", "portable"]) == 0
    with ckptzip.open(tmp_path / "b.ckz") as reader:
        assert "zstd" in {c for e in reader.entries() for c in e.codecs}
    assert_same(ckptzip.load(tmp_path / "b.ckz"), state)


def test_inspect_prints_the_ratio_table_and_class_totals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckptzip.save(_state(), tmp_path / "s.ckz")
    assert main(["inspect", str(tmp_path / "s.ckz")]) == 0
    out = capsys.readouterr().out
    assert "tensor" in out and "compressed" in out and "ratio" in out
    assert "exp_avg_sq" in out and "total" in out
    assert "portable: every codec has a CPU decoder" in out


def test_inspect_says_when_a_file_needs_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    golden = Path(__file__).parents[1] / "golden" / "gpu_ans_v1_0.ckz"
    assert main(["inspect", str(golden)]) == 0
    assert "GPU-only codecs: ans; loading needs an NVIDIA GPU with nvCOMP" in capsys.readouterr().out


class Custom:
    """Any class: torch.load(weights_only=True) refuses to build it."""


def test_compress_refuses_a_pickle_that_is_not_plain_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save({"obj": Custom()}, tmp_path / "evil.pt")
    assert main(["compress", str(tmp_path / "evil.pt"), str(tmp_path / "evil.ckz")]) == 1
    assert "weights_only=True" in capsys.readouterr().err
    assert not (tmp_path / "evil.ckz").exists()


def test_a_damaged_file_is_an_error_exit_naming_the_damage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckptzip.save(_state(), tmp_path / "s.ckz")
    data = bytearray((tmp_path / "s.ckz").read_bytes())
    data[100] ^= 0x10
    (tmp_path / "s.ckz").write_bytes(bytes(data))
    assert main(["decompress", str(tmp_path / "s.ckz"), str(tmp_path / "s.pt")]) == 1
    assert "is damaged" in capsys.readouterr().err


def test_warmup_keeps_tritons_key_for_the_processes_after_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from ckptzip.kernels import _triton_key
    from helpers import STAND_IN_TRITON_KEY, stand_in_triton

    triton = stand_in_triton(tmp_path / "triton", monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(_triton_key.ENV, str(tmp_path / "cache"))
    assert main(["warmup"]) == 0
    out = capsys.readouterr().out
    (kept,) = (tmp_path / "cache").iterdir()
    assert kept.read_text() == STAND_IN_TRITON_KEY and f"Triton's cache key: kept in {kept}" in out
    assert "no CUDA device here: the GPU kernels compile on the first GPU save or load" in out
    assert triton.calls == [1]
    monkeypatch.setenv(_triton_key.ENV, "")
    assert main(["warmup"]) == 0
    assert "Triton's cache key: not kept (CKPTZIP_CACHE_DIR is empty" in capsys.readouterr().out
