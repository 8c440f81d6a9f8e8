"""CLI hardening (issue #13): no tracebacks for odd names or bad inputs, no silent overwrites."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_same
from safetensors.torch import load_file

import ckptzip
from ckptzip.cli import main

SRC = str(Path(__file__).resolve().parents[2] / "src")
STATE = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(3)}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYTHONIOENCODING": "utf-8"}
    return subprocess.run([sys.executable, "-m", "ckptzip", *args], capture_output=True, text=True, env=env, timeout=300)


def test_inspect_prints_a_lone_surrogate_in_a_name_as_an_escape(tmp_path: Path) -> None:
    ckptzip.save({"w\udc80x": torch.ones(2)}, tmp_path / "s.ckz")
    done = _run("inspect", str(tmp_path / "s.ckz"))
    assert done.returncode == 0, done.stderr
    assert "w\\udc80x" in done.stdout and "Traceback" not in done.stderr


def test_a_corrupt_safetensors_input_is_an_error_exit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    assert main(["compress", str(tmp_path / "bad.safetensors"), str(tmp_path / "out.ckz")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ckptzip: error: could not read '{tmp_path / 'bad.safetensors'}' as a .safetensors file: ")
    assert not (tmp_path / "out.ckz").exists()


def test_tied_tensors_decompress_to_safetensors_as_copies(tmp_path: Path) -> None:
    tied = torch.arange(6, dtype=torch.float32)
    ckptzip.save({"embed": tied, "head": tied, "other": torch.zeros(2)}, tmp_path / "t.ckz")
    assert main(["decompress", str(tmp_path / "t.ckz"), str(tmp_path / "t.safetensors")]) == 0
    back = load_file(tmp_path / "t.safetensors")
    assert_same(dict(sorted(back.items())), {"embed": tied, "head": tied, "other": torch.zeros(2)})


@pytest.mark.parametrize("command", ["compress", "decompress", "convert"])
def test_an_existing_output_is_kept_unless_forced(tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / ("in.pt" if command == "compress" else "in.ckz")
    torch.save(STATE, src) if command == "compress" else ckptzip.save(STATE, src)
    dst = tmp_path / ("out.pt" if command == "decompress" else "out.ckz")
    dst.write_bytes(b"precious")
    assert main([command, str(src), str(dst)]) == 1
    assert capsys.readouterr().err == f"ckptzip: error: {str(dst)!r} exists; pass --force to replace it\n"
    assert dst.read_bytes() == b"precious"
    assert main([command, str(src), str(dst), "--force"]) == 0
    loaded = torch.load(dst, weights_only=True) if command == "decompress" else ckptzip.load(dst)
    assert_same(loaded, STATE)


@pytest.mark.parametrize("spelling", ["dotdot", "symlink", "same"])
def test_the_source_as_destination_is_refused_however_spelled(
    tmp_path: Path, spelling: str, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "a.ckz"
    ckptzip.save(STATE, src)
    (tmp_path / "sub").mkdir()
    dst = {"dotdot": tmp_path / "sub" / ".." / "a.ckz", "symlink": tmp_path / "link.ckz", "same": src}[spelling]
    if spelling == "symlink":
        dst.symlink_to(src)
    before = src.read_bytes()
    assert main(["convert", str(src), str(dst), "--codec", "raw", "--force"]) == 1
    assert f"{str(dst)!r} is the source {str(src)!r}; write to another path" in capsys.readouterr().err
    assert src.read_bytes() == before


@pytest.mark.parametrize("top", ["0", "-3", "x"])
def test_inspect_top_must_be_at_least_one(tmp_path: Path, top: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["inspect", str(tmp_path / "s.ckz"), "--top", top])
    assert info.value.code == 2
    assert "argument --top: expected an integer >= 1" in capsys.readouterr().err


def test_dcp_convert_keeps_an_existing_output_unless_forced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckptzip.save(STATE, tmp_path / "one.ckz")
    (tmp_path / "dir").mkdir()
    assert main(["dcp-convert", str(tmp_path / "one.ckz"), str(tmp_path / "dir")]) == 1
    assert f"{str(tmp_path / 'dir')!r} exists; pass --force" in capsys.readouterr().err
    assert os.listdir(tmp_path / "dir") == []
    assert main(["dcp-convert", str(tmp_path / "one.ckz"), str(tmp_path / "dir"), "--force"]) == 0
    assert main(["dcp-convert", str(tmp_path / "dir"), str(tmp_path / "one.ckz")]) == 1
    assert main(["dcp-convert", str(tmp_path / "dir"), str(tmp_path / "two.ckz")]) == 0
    assert_same(ckptzip.load(tmp_path / "two.ckz"), STATE)


def test_compress_refuses_a_fifo_input_instead_of_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "in.pt")
    done = _run("compress", str(tmp_path / "in.pt"), str(tmp_path / "out.ckz"))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"ckptzip: error: no checkpoint at '{tmp_path / 'in.pt'}': the path is a FIFO, not a checkpoint file" in done.stderr


def test_top_level_help_lists_every_command_without_markup(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "Commands: compress, decompress, convert, inspect, verify, demo, warmup, cost, dcp-convert, bench" in out
    assert "``" not in out


def _imported(*args: str) -> set[str]:
    """Every module that ``python -X importtime ARGS`` imports (its stderr names each one)."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("args", [("--help",), ("--version",), ("cost", "--help"), ("dcp-convert", "--help"),
                                  ("warmup", "--help")])
def test_help_imports_neither_torch_nor_the_commands(args: tuple[str, ...]) -> None:
    """Issue #22: ``ckptzip --help`` took 3 s, 2 s of it importing torch; a command's modules are
    imported only when it is chosen (and these commands' help needs no torch)."""
    modules = _imported("-m", "ckptzip", *args)
    assert "ckptzip.cli" in modules
    heavy = {m for m in modules if m.split(".")[0] in ("torch", "numpy") or m.startswith(("ckptzip.api", "ckptzip.demo", "ckptzip_bench"))}
    assert not heavy, sorted(heavy)


def test_import_ckptzip_is_lazy_and_keeps_its_names() -> None:
    code = (
        "import sys, ckptzip; assert 'torch' not in sys.modules; "
        "assert issubclass(ckptzip.UsageError, ckptzip.CkptzipError) and 'torch' not in sys.modules; "
        "import ckptzip.api, ckptzip.manager; "
        "assert ckptzip.save is ckptzip.api.save and ckptzip.CheckpointManager is ckptzip.manager.CheckpointManager; "
        "ns = {}; exec('from ckptzip import *', ns); assert set(ckptzip.__all__) <= set(ns) <= set(dir(ckptzip)) | {'__builtins__'}"
    )
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        ckptzip.nothing  # noqa: B018


def test_subpackages_are_attributes_imported_on_first_use_and_star_keeps_the_builtin_open() -> None:
    """Issue #44: the README's ``ckptzip.dcp.CompressedStorageWriter(...)`` and
    ``ckptzip.integrations.lightning.CkptzipCheckpointIO()`` raised AttributeError after ``import
    ckptzip``; ``from ckptzip import *`` bound ``open`` over the built-in."""
    code = (
        "import builtins, sys, ckptzip\n"
        "assert 'dcp' in dir(ckptzip) and 'ckptzip.dcp' not in sys.modules and 'torch' not in sys.modules\n"
        "assert ckptzip.dcp.CompressedStorageWriter is sys.modules['ckptzip.dcp._writer'].CompressedStorageWriter\n"
        "assert ckptzip.integrations.lightning.CkptzipCheckpointIO.__module__ == 'ckptzip.integrations.lightning'\n"
        "assert ckptzip.manager.CheckpointManager is ckptzip.CheckpointManager\n"
        "assert not hasattr(ckptzip.integrations, 'nothing')\n"
        "ns = {}; exec('from ckptzip import *', ns)\n"
        "assert 'open' not in ns and 'load' in ns and 'open' not in ckptzip.__all__\n"
        "exec('from ckptzip import *; assert open is builtins.open', {'builtins': builtins})\n"
    )
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr


def test_positional_arguments_have_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["compress", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "src input: torch.save or .safetensors file dst output: .ckz" in out


def test_sizes_line_says_which_file_is_smaller_and_quiet_drops_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save({"w": torch.zeros(4096)}, tmp_path / "a.pt")
    assert main(["compress", str(tmp_path / "a.pt"), str(tmp_path / "a.ckz")]) == 0
    assert "a.ckz is " in capsys.readouterr().out
    assert main(["decompress", str(tmp_path / "a.ckz"), str(tmp_path / "b.pt")]) == 0
    out = capsys.readouterr().out
    assert "b.pt is " in out and "x larger than a.ckz, " in out
    assert main(["decompress", "-q", "--force", str(tmp_path / "a.ckz"), str(tmp_path / "b.pt")]) == 0
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", "")  # no summary, and no progress bar off a terminal


def test_inspect_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckptzip.save({"w": torch.zeros(64, 8), "b": torch.ones(3)}, tmp_path / "a.ckz")
    assert main(["inspect", "--json", "--top", "1", str(tmp_path / "a.ckz")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in report["tensors"]] == ["w"]
    assert (report["bytes"], report["tensors"][0]["bytes"], report["tensors"][0]["shape"]) == (64 * 8 * 4 + 12, 2048, [64, 8])


GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def test_inspect_json_holds_everything_the_text_shows(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue #44: --json had no class totals, references or portability."""
    path = str(GOLDEN / "cpu_zstd_v2_1_delta.ckz")
    assert main(["inspect", path]) == 0
    text = capsys.readouterr().out
    assert main(["inspect", "--json", path]) == 0
    report = json.loads(capsys.readouterr().out)
    with ckptzip.open(path) as reader:
        entries = reader.entries()
        assert report["ratio"] == reader.ratio and report["bases"] == [b.to_json() for b in reader.bases]
    assert report["classes"]["total"] == {"tensors": 13, "bytes": sum(e.nbytes for e in entries),
                                          "compressed": sum(e.compressed_nbytes for e in entries),
                                          "ratio": report["ratio"]}
    assert f"total            {report['classes']['total']['tensors']}  " in text
    assert set(report["classes"]) == {"weights", "exp_avg", "exp_avg_sq", "other", "total"}
    assert {k: v["tensors"] for k, v in report["references"].items()} == {"cast": 2, "copy": 1, "xor": 8}
    assert report["references"]["copy"] == {"tensors": 1, "bytes": 262144, "not_stored": 262144, "sparse": 0}
    assert "duplicates stored once: 1 tensors, 256.0 KiB (256.0 KiB not stored)" in text
    assert report["bases"][0]["step"] == 100 and "needs base checkpoint step 100" in text
    assert report["portability"] == {"portable": True, "gpu_only_codecs": [], "codecs_needing_the_c_decoder": [],
                                     "note": "portable: every codec has a CPU decoder; loads on any machine"}
    assert report["portability"]["note"] in text
    rows = {t["name"]: t for t in report["tensors"]}
    assert rows["exp_avg_copy"]["ratio"] is None and rows["exp_avg_copy"]["codec"] == "copy of optimizer.state.0.exp_avg"
    assert rows["optimizer.state.0.exp_avg"]["ratio"] == 262144 / 80


def test_inspect_json_says_a_gpu_only_file_is_not_portable(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--json", str(GOLDEN / "gpu_ans_v1_0.ckz")]) == 0
    where = json.loads(capsys.readouterr().out)["portability"]
    assert (where["portable"], where["gpu_only_codecs"]) == (False, ["ans"])
    assert where["note"].startswith("GPU-only codecs: ans; loading needs an NVIDIA GPU")


def test_inspect_and_verify_point_a_directory_to_dcp_convert(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("inspect", "verify"):
        assert main([command, str(tmp_path)]) == 1
        assert f"is a directory; {command} reads one .ckz file. For a DCP checkpoint directory, `ckptzip " \
            f"dcp-convert {tmp_path} FILE.ckz` makes one" in capsys.readouterr().err


def test_verify_checks_every_checksum_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckptzip.save({"w": torch.arange(4096, dtype=torch.float32)}, tmp_path / "a.ckz")
    assert main(["verify", str(tmp_path / "a.ckz")]) == 0
    assert ": 1 tensors (16.0 KiB), every checksum verified, " in capsys.readouterr().out
    assert os.listdir(tmp_path) == ["a.ckz"]
    data = bytearray((tmp_path / "a.ckz").read_bytes())
    data[200] ^= 0xFF
    (tmp_path / "a.ckz").write_bytes(bytes(data))
    assert main(["verify", str(tmp_path / "a.ckz")]) == 1
    assert "ckptzip: error: " in capsys.readouterr().err


def test_dcp_convert_reads_a_plain_filesystem_writer_directory_when_trusted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    state = {"w": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4), "step": 5}
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "plain"), no_dist=True)
    assert main(["dcp-convert", str(tmp_path / "plain"), str(tmp_path / "a.ckz")]) == 1
    assert "is a plain DCP checkpoint (FileSystemWriter's .metadata), whose metadata and non-tensor values are " \
        "pickles, which reading them runs; if you trust it, pass --trusted-objects" in capsys.readouterr().err
    assert main(["dcp-convert", "--trusted-objects", str(tmp_path / "plain"), str(tmp_path / "a.ckz")]) == 0
    assert_same(ckptzip.load(tmp_path / "a.ckz"), state)
