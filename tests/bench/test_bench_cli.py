"""`ckptzip bench` on the CPU with the tiny presets: JSON schema, bit-exact flags, RESULTS.md, the
plot, `ckptzip cost --from-bench`, and that failures and mismatches are reported, not fatal."""

from __future__ import annotations

import argparse
import functools
import io
import json
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ckptzip import cli
from ckptzip_bench import results, run
from ckptzip_bench.analysis import (
    CORE,
    TensorSize,
    entropy_by_group,
    group_totals,
    planes_reference,
)
from ckptzip_bench.baselines import TorchSave
from ckptzip_bench.breakdown import CATEGORIES, HOST_OTHER, device_seconds, classify_device_event, classify_frame
from ckptzip_bench.methods import CkptzipFast
from ckptzip_bench.targets import evaluate

METHODS = ["torch.save", "zstd-cpu", "ckptzip-auto", "ckptzip-portable", "nvcomp-zstd"]
EXACT = METHODS[:4]


def bench(argv: list[str]) -> int:
    """Parse ``argv`` the way the ckptzip CLI wires the subcommand, then run it."""
    parser = argparse.ArgumentParser(prog="ckptzip")
    p = parser.add_subparsers(dest="command", required=True).add_parser("bench")
    run.configure(p)
    p.set_defaults(func=run.run)
    args = parser.parse_args(["bench", *argv])
    return int(args.func(args))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench")
    plot = out / "bench.png" if _has_matplotlib() else None
    argv = ["--device", "cpu", "--preset", "tiny", "--moe-preset", "tiny-moe", "--steps", "2", "--reps", "2",
            "--pipeline-reps", "2", "--cache", "warm", "--methods", ",".join(METHODS[:2]), *METHODS[2:], "--profile",
            "--dir", str(out),
            "--out-json", str(out / "bench.json"), "--results-md", str(out / "RESULTS.md")]
    status = bench(argv + (["--plot", str(plot)] if plot else []))
    doc = json.loads((out / "bench.json").read_text())
    return {"status": status, "doc": doc, "dir": out, "plot": plot}


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _methods(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in state["methods"]}


@pytest.mark.slow  # runs `ckptzip bench` (the module's fixture, or its own run)
def test_bench_exits_zero_and_writes_the_json_schema(tiny_run: dict[str, Any]) -> None:
    doc = tiny_run["doc"]
    assert tiny_run["status"] == 0
    assert doc["schema"] == results.SCHEMA
    assert {"date", "command", "argv", "hardware", "settings", "disk", "ceilings", "states", "methods"} <= set(doc)
    assert doc["hardware"]["cpu"]["count"] >= 1
    assert doc["hardware"]["versions"]["torch"] == torch.__version__
    assert doc["settings"]["methods"] == METHODS
    assert (doc["settings"]["pipeline_reps"], doc["settings"]["profile"]) == (2, True)
    assert doc["command"].startswith("ckptzip bench --device cpu --preset tiny --moe-preset tiny-moe --steps 2 ")
    assert "--reps 2 --pipeline-reps 2 --cache warm" in doc["command"] and "--profile" in doc["command"].split()
    assert "ceilings" in doc["ceilings"]["skipped"]
    assert doc["disk"]["write_gbps"] > 0 and doc["disk"]["read_cache"] == "warm"
    assert [s["label"] for s in doc["states"]] == ["dense", "moe"]
    assert [s["status"] for s in doc["states"]] == ["ok", "ok"]
    assert [m["name"] for m in doc["methods"]] == METHODS
    assert {m["state"] for m in doc["methods"]} == {"dense"}


@pytest.mark.slow  # runs `ckptzip bench` (the module's fixture, or its own run)
@pytest.mark.parametrize("label", ["dense", "moe"])
def test_every_method_that_ran_is_bit_exact_with_consistent_numbers(tiny_run: dict[str, Any], label: str) -> None:
    state = next(s for s in tiny_run["doc"]["states"] if s["label"] == label)
    methods = _methods(state)
    assert list(methods) == METHODS
    for name in EXACT:
        m = methods[name]
        assert (m["status"], m["exact"], m["reps"]) == ("ok", True, 2), m
        assert m["ratio"] == pytest.approx(m["raw_bytes"] / m["stored_bytes"])
        assert m["save_seconds"] == statistics.median(m["save_runs"])
        assert m["raw_bytes"] == state["raw_bytes"]
    assert methods["zstd-cpu"]["ratio"] > 1.05 and methods["ckptzip-auto"]["ratio"] > methods["zstd-cpu"]["ratio"]
    assert methods["torch.save"]["classes"] is None
    for name in ("zstd-cpu", "ckptzip-auto", "ckptzip-portable"):
        classes = methods[name]["classes"]
        assert {"weights", "exp_avg", "exp_avg_sq", "gradients", CORE, "total"} <= set(classes)
        assert classes["total"]["raw_bytes"] == state["raw_bytes"]
    if not torch.cuda.is_available():
        skipped = methods["nvcomp-zstd"]
        assert (skipped["status"], skipped["exact"], skipped["ratio"]) == ("skipped", None, None)
        assert "nvcomp" in skipped["reason"].lower()


@pytest.mark.slow  # runs `ckptzip bench` (the module's fixture, or its own run)
@pytest.mark.parametrize("label", ["dense", "moe"])
def test_the_pipeline_section_times_save_to_a_discarding_sink_and_load_from_memory(
    tiny_run: dict[str, Any], label: str
) -> None:
    state = next(s for s in tiny_run["doc"]["states"] if s["label"] == label)
    methods = _methods(state)
    for name in ("torch.save", "ckptzip-auto", "ckptzip-portable"):
        m, p = methods[name], methods[name]["pipeline"]
        assert len(p["save_runs"]) == len(p["load_runs"]) == 2, p
        assert p["save_seconds"] == statistics.median(p["save_runs"])
        assert p["load_seconds"] == statistics.median(p["load_runs"])
        assert p["save_gbps"] == pytest.approx(state["raw_bytes"] / p["save_seconds"] / 1e9)
        assert p["load_gbps"] == pytest.approx(state["raw_bytes"] / p["load_seconds"] / 1e9)
        assert p["first_save_seconds"] > 0 and p["first_load_seconds"] > 0
        if name.startswith("ckptzip-"):
            assert p["stored_bytes"] == m["stored_bytes"]  # the same container, in memory instead of a file
    assert methods["zstd-cpu"]["pipeline"] is None  # it writes a directory, not one file object


@pytest.mark.slow  # runs `ckptzip bench` (the module's fixture, or its own run)
@pytest.mark.parametrize("label", ["dense", "moe"])
def test_the_profile_breaks_one_auto_save_and_load_down_by_category(tiny_run: dict[str, Any], label: str) -> None:
    profile = next(s for s in tiny_run["doc"]["states"] if s["label"] == label)["profile"]
    assert profile["method"] == "ckptzip-auto"
    for op in ("save", "load"):
        p = profile[op]
        lanes = p["lanes"]
        assert p["gpu_profiled"] is False and lanes["gpu"] == {}
        assert p["samples"] > 0 and p["wall_seconds"] > 0
        assert sum(lanes["main"].values()) == pytest.approx(p["wall_seconds"])  # sampled at every tick
        assert set(lanes["main"]) | set(lanes["workers"]) <= set(CATEGORIES)
    work = set(profile["save"]["lanes"]["main"]) | set(profile["save"]["lanes"]["workers"])
    assert work & {"codecs (host calls)", "byte planes (host)", "checksums"}, work


@pytest.mark.slow  # runs `ckptzip bench` (the module's fixture, or its own run)
def test_each_class_has_an_entropy_bound_and_a_codec_on_planes_reference(tiny_run: dict[str, Any]) -> None:
    state = tiny_run["doc"]["states"][0]
    for group in ("weights", "exp_avg", "exp_avg_sq", "gradients", CORE):
        entropy, reference = state["entropy"][group], state["reference"][group]
        assert 1.0 < entropy["bound"] < 2.0
        assert len(entropy["planes"]["float32"]) == 4
        assert entropy["planes"]["float32"][0] < 6 < entropy["planes"]["float32"][-1]  # exponent byte first
        assert reference["best"] in reference["codecs"]
        assert reference["best_ratio"] == max(reference["codecs"].values())
    assert state["reference_backend"] == "cpu"


@pytest.mark.slow  # runs `ckptzip bench` (the module's fixture, or its own run)
def test_targets_are_reported_met_or_not_measured_with_reasons(tiny_run: dict[str, Any]) -> None:
    targets = {t["id"]: t for t in tiny_run["doc"]["states"][0]["targets"]}
    assert {"default-ratio", "default-vs-nvcomp-zstd", "class-weights", "gpu-compress", "gpu-decompress",
            "portable-ratio", "portable-gpu-compress", "save-vs-disk", "save-vs-torch", "restore-vs-disk",
            "restore-vs-torch"} <= set(targets)
    auto = _methods(tiny_run["doc"]["states"][0])["ckptzip-auto"]
    assert targets["default-ratio"]["measured"] == pytest.approx(auto["classes"][CORE]["ratio"])
    assert targets["default-ratio"]["met"] is (auto["classes"][CORE]["ratio"] >= 1.20)
    assert targets["gpu-compress"]["met"] is None
    assert "CUDA" in targets["gpu-compress"]["detail"]
    for tid in ("auto-pipeline-save", "auto-pipeline-load", "portable-pipeline-save", "portable-pipeline-load"):
        assert targets[tid]["met"] is None
        assert targets[tid]["detail"] == "the pipeline targets are for CUDA runs; this state is on cpu"
    if not torch.cuda.is_available():
        assert targets["default-vs-nvcomp-zstd"]["met"] is None
        assert "nvcomp-zstd is skipped" in targets["default-vs-nvcomp-zstd"]["detail"]


@pytest.mark.slow  # runs `ckptzip bench` (the module's fixture, or its own run)
def test_results_md_has_the_tables_command_and_plot(tiny_run: dict[str, Any]) -> None:
    text = (tiny_run["dir"] / "RESULTS.md").read_text()
    doc = tiny_run["doc"]
    assert text.startswith("# ckptzip benchmark results")
    assert doc["command"] in text
    for heading in ("## Headline", "#### Methods", "#### Pipeline without storage", "#### Where the time goes",
                    "#### Ratio per tensor class", "#### Byte planes", "#### Targets"):
        assert heading in text
    assert "| method | save s | load s | save GB/s | load GB/s | storage-bound save GB/s |" in text
    assert "| category | GPU s | main thread s | other threads s |" in text
    assert "ckptzip-auto save to a discarding file object:" in text
    for name in METHODS:
        assert f"| {name} |" in text
    assert "| ckptzip-auto | yes |" in text
    assert "order-0 bound" in text and "best codec on planes" in text
    if tiny_run["plot"] is not None:
        assert tiny_run["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "![compression ratio against throughput per method](bench.png)" in text


@pytest.mark.slow  # runs `ckptzip bench` (the module's fixture, or its own run)
def test_results_module_renders_the_same_file_from_the_json(
    tiny_run: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tiny_run["dir"] / "bench.json"
    again = tmp_path / "RESULTS.md"
    plot = ["--plot", str(tmp_path / "bench.png")] if tiny_run["plot"] is not None else []
    assert results.main([str(source), "--results-md", str(again), *plot]) == 0
    assert again.read_text() == (tiny_run["dir"] / "RESULTS.md").read_text()
    capsys.readouterr()
    assert results.main([str(source), "--headline"]) == 0
    headline = capsys.readouterr().out
    assert headline.startswith("| method | ratio | save s | restore s |")
    assert "| ckptzip-auto |" in headline and "nvcomp-zstd" not in headline


def test_results_module_rejects_a_file_bench_did_not_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"methods": []}))
    assert results.main([str(path)]) == 2
    assert "is not a ckptzip bench result: expected schema 'ckptzip-bench/1'" in capsys.readouterr().err


@pytest.mark.slow  # runs `ckptzip bench` (the module's fixture, or its own run)
def test_cost_reads_the_ratio_from_the_bench_json(tiny_run: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    source = str(tiny_run["dir"] / "bench.json")
    for method in ("ckptzip-auto", "zstd-cpu"):
        assert cli.main(["cost", "--from-bench", source, "--method", method, "--json"]) == 0
        ratio = json.loads(capsys.readouterr().out)["inputs"]["ratio"]
        assert ratio == _methods(tiny_run["doc"]["states"][0])[method]["ratio"]


def _small_run(tmp_path: Path, methods: str, *extra: str) -> tuple[int, dict[str, Any]]:
    status = bench(["--device", "cpu", "--preset", "tiny", "--moe-preset", "none", "--steps", "1", "--reps", "1",
                    "--cache", "warm", "--methods", methods, "--dir", str(tmp_path),
                    "--out-json", str(tmp_path / "b.json"), *extra])
    return status, json.loads((tmp_path / "b.json").read_text())


@pytest.mark.slow  # runs `ckptzip bench` (the module's fixture, or its own run)
def test_a_failing_method_is_reported_and_the_run_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: object, state: object, directory: Path) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(TorchSave, "_save", broken)
    status, doc = _small_run(tmp_path, "torch.save,zstd-cpu")
    methods = _methods(doc["states"][0])
    assert status == 0  # a baseline failing is reported, not an error of the run
    assert methods["torch.save"]["status"] == "failed"
    assert methods["torch.save"]["reason"] == "OSError: [Errno 28] No space left on device"
    assert methods["torch.save"]["ratio"] is None
    assert methods["zstd-cpu"]["status"] == "ok"
    assert list(tmp_path.glob("ckptzip-bench-*")) == []

    monkeypatch.setattr(CkptzipFast, "_save", broken)
    status, doc = _small_run(tmp_path, "ckptzip-fast")
    assert status == 1  # a ckptzip preset failing is
    assert _methods(doc["states"][0])["ckptzip-fast"]["status"] == "failed"


@pytest.mark.slow  # runs `ckptzip bench` (the module's fixture, or its own run)
def test_a_restore_that_is_not_bit_exact_is_reported_without_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = TorchSave._load

    def flip_a_bit(self: TorchSave, directory: Path, device: torch.device) -> Any:
        state = original(self, directory, device)
        weight = state["model"]["blocks.0.attn.qkv.weight"]
        weight.view(torch.uint8).view(-1)[5] ^= 1
        return state

    monkeypatch.setattr(TorchSave, "_load", flip_a_bit)
    status, doc = _small_run(tmp_path, "torch.save")
    m = _methods(doc["states"][0])["torch.save"]
    assert status == 1
    assert (m["status"], m["exact"], m["ratio"]) == ("mismatch", None, None)
    assert m["reason"] == "repetition 1: model.blocks.0.attn.qkv.weight: tensor bytes differ"
    assert "save_seconds" not in m


@pytest.mark.slow  # runs `ckptzip bench` (the module's fixture, or its own run)
def test_a_load_from_memory_that_is_not_bit_exact_is_a_mismatch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def flip_a_bit(self: TorchSave) -> Any:
        def load(f: Any, device: torch.device) -> Any:
            state = torch.load(f, map_location=device, weights_only=True)
            state["model"]["blocks.0.attn.qkv.weight"].view(torch.uint8).view(-1)[7] ^= 1
            return state
        return torch.save, load

    monkeypatch.setattr(TorchSave, "stream_io", flip_a_bit)
    status, doc = _small_run(tmp_path, "torch.save", "--pipeline-reps", "1")
    m = _methods(doc["states"][0])["torch.save"]
    assert status == 1
    assert (m["status"], m["exact"], m["ratio"]) == ("mismatch", None, None)
    assert m["reason"] == "load from host memory: model.blocks.0.attn.qkv.weight: tensor bytes differ"


@pytest.mark.slow  # runs `ckptzip bench` (the module's fixture, or its own run)
def test_no_pipeline_reps_leave_the_section_out(tmp_path: Path) -> None:
    status, doc = _small_run(tmp_path, "torch.save", "--pipeline-reps", "0", "--results-md", str(tmp_path / "R.md"))
    assert status == 0 and "--pipeline-reps 0" in doc["command"]
    assert _methods(doc["states"][0])["torch.save"]["pipeline"] is None
    assert "profile" not in doc["states"][0]
    text = (tmp_path / "R.md").read_text()
    assert "#### Pipeline without storage\n\nNot measured (`--pipeline-reps 0`" in text
    assert "#### Where the time goes" not in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--methods", "torch.save,gzip"], "unknown method(s) gzip; expected names from ckptzip-auto, torch.save"),
        (["--preset", "huge"], "unknown model preset 'huge'; expected one of tiny"),
        (["--dir", "/nonexistent/dir"], "--dir '/nonexistent/dir' is not a directory"),
        (["--preset", "none", "--moe-preset", "none"], "--preset none and --moe-preset none leave nothing"),
        (["--out-json", "/nonexistent/b.json"], "--out-json '/nonexistent/b.json': its directory does not exist"),
    ],
)
def test_unusable_options_exit_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench(["--device", "cpu", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.gpu
def test_on_the_gpu_presets_report_resident_throughput_and_their_first_round(tmp_path: Path) -> None:
    status = bench(["--device", "cuda", "--preset", "none", "--moe-preset", "tiny-moe", "--steps", "2",
                    "--reps", "1", "--cache", "warm", "--methods", "ckptzip-auto,nvcomp-zstd",
                    "--dir", str(tmp_path), "--out-json", str(tmp_path / "b.json")])
    doc = json.loads((tmp_path / "b.json").read_text())
    state = doc["states"][0]
    methods = _methods(state)
    assert status == 0 and state["label"] == "moe" and state["reference_backend"] == "cuda"
    auto = methods["ckptzip-auto"]
    assert auto["exact"] is True and auto["device"]["encode_gbps"] > 0 and auto["device"]["decode_gbps"] > 0
    assert auto["first_round"]["save_seconds"] > 0
    assert methods["nvcomp-zstd"]["device"]["exact"] is True
    assert "ans" in state["reference"]["weights"]["codecs"]
    assert doc["ceilings"]["d2d_copy_gbps"] > 0


@pytest.mark.gpu
def test_on_the_gpu_the_pipeline_and_profile_cover_the_link_and_the_kernels(tmp_path: Path) -> None:
    status = bench(["--device", "cuda", "--preset", "tiny", "--moe-preset", "none", "--steps", "2",
                    "--reps", "2", "--cache", "warm", "--methods", "ckptzip-auto,ckptzip-portable,torch.save",
                    "--profile", "--dir", str(tmp_path), "--out-json", str(tmp_path / "b.json")])
    doc = json.loads((tmp_path / "b.json").read_text())
    state = doc["states"][0]
    methods = _methods(state)
    assert status == 0
    for name in ("ckptzip-auto", "ckptzip-portable", "torch.save"):
        p = methods[name]["pipeline"]
        assert p["save_gbps"] > 0 and p["load_gbps"] > 0, (name, p)
    save, load = state["profile"]["save"], state["profile"]["load"]
    assert save["gpu_profiled"] is True
    assert save["lanes"]["gpu"].get("copy D2H", 0) > 0, save["lanes"]["gpu"]
    assert load["lanes"]["gpu"].get("copy H2D", 0) > 0, load["lanes"]["gpu"]
    kernels = {c for lane in (save, load) for c in lane["lanes"]["gpu"] if c.startswith("GPU kernels:")}
    assert {"GPU kernels: byte planes split/merge", "GPU kernels: nvCOMP codecs"} <= kernels, kernels
    targets = {t["id"]: t for t in state["targets"]}
    for tid in ("auto-pipeline-save", "auto-pipeline-load", "portable-pipeline-save", "portable-pipeline-load"):
        assert targets[tid]["measured"] is not None and targets[tid]["met"] is not None, targets[tid]


# ------------------------------------------------------------------------------ pure parts


def test_group_totals_put_fp32_weights_and_moments_in_the_core_group() -> None:
    sizes = [
        TensorSize("weights", "float32", 400, 300),
        TensorSize("weights", "bfloat16", 200, 150),
        TensorSize("exp_avg_sq", "float32", 400, 200),
        TensorSize("gradients", "float32", 100, 100),
    ]
    totals = group_totals(sizes)
    assert list(totals) == ["weights", "exp_avg_sq", "gradients", CORE, "total"]
    assert totals[CORE] == {"raw_bytes": 800, "stored_bytes": 500, "ratio": 1.6}
    assert totals["weights"]["raw_bytes"] == 600
    assert totals["total"]["stored_bytes"] == 750


@pytest.mark.parametrize(
    ("name", "category"),
    [
        ("Memcpy DtoH (Device -> Pinned)", "copy D2H"),
        ("Memcpy HtoD (Pinned -> Device)", "copy H2D"),
        ("Memcpy DtoD (Device -> Device)", "copy D2D"),
        ("Memset (Device)", "memset"),
        ("_split_kernel", "GPU kernels: byte planes split/merge"),
        ("_merge_kernel", "GPU kernels: byte planes split/merge"),
        ("_segments_words_kernel", "GPU kernels: gather + checksums"),
        ("split_kernel", "GPU kernels: byte planes split/merge"),  # the shipped cubins' names
        ("segments_kernel", "GPU kernels: gather + checksums"),
        ("gather_bytes_kernel", "GPU kernels: gather + checksums"),
        ("void ans_gpu_lib::detail::compress_kernel<...>", "GPU kernels: nvCOMP codecs"),
        ("void at::native::index_elementwise_kernel<128, 4>", "GPU kernels: other"),
    ],
)
def test_gpu_events_are_classified_by_name(name: str, category: str) -> None:
    assert classify_device_event(name) == category


def test_device_seconds_sum_gpu_events_per_category_and_skip_host_events() -> None:
    def event(name: str, device: str, us: float) -> SimpleNamespace:
        return SimpleNamespace(name=name, device_type=SimpleNamespace(name=device),
                               time_range=SimpleNamespace(elapsed_us=lambda: us))

    events = [event("Memcpy DtoH (Device -> Pinned)", "CUDA", 1500.0), event("cudaMemcpyAsync", "CPU", 9000.0),
              event("Memcpy DtoH (Device -> Pageable)", "CUDA", 500.0), event("_split_kernel", "CUDA", 250.0)]
    assert device_seconds(events) == {"copy D2H": 0.002, "GPU kernels: byte planes split/merge": 0.00025}


def _stack(*frames: tuple[str, str]) -> Any:
    """The frame of the innermost of nested calls, the i-th defined in file ``frames[i][0]`` as
    function ``frames[i][1]``: a stack the sampler could see."""
    inner: Any = sys._getframe
    for path, function in reversed(frames):
        namespace: dict[str, Any] = {}
        exec(compile(f"def {function}(call):\n    return call()\n", path, "exec"), namespace)
        inner = functools.partial(namespace[function], inner)
    return inner()


@pytest.mark.parametrize(
    ("frames", "category"),
    [
        ([("/site/ckptzip/engine/writer.py", "_encode"), ("/site/ckptzip/codecs/cpu.py", "encode"),
          ("/usr/lib/python3.12/threading.py", "wait")], "wait: locks, queues, idle threads"),
        ([("/site/ckptzip/engine/writer.py", "_encode"), ("/site/ckptzip/codecs/cpu.py", "encode")],
         "codecs (host calls)"),
        ([("/site/ckptzip/engine/reader.py", "_run"), ("/site/ckptzip/storage/ranges.py", "read_into")], "file I/O"),
        ([("/site/ckptzip/engine/writer.py", "_write"), ("/site/ckptzip/format/writer.py", "append"),
          ("/site/ckptzip/bench/pipeline.py", "write")], "file I/O"),
        ([("/site/ckptzip/engine/reader.py", "verify_checksums")], "checksums"),
        ([("/site/ckptzip/engine/encode.py", "_assemble"), ("/site/torch/cuda/streams.py", "synchronize")],
         "wait for the GPU"),
        ([("/site/torch/serialization.py", "save")], "torch (host)"),
        ([("/site/ckptzip/engine/reader.py", "plan_batches")], HOST_OTHER),
    ],
)
def test_host_stacks_are_classified_by_their_innermost_recognised_frame(
    frames: list[tuple[str, str]], category: str
) -> None:
    assert classify_frame(_stack(*frames)) == category


def test_evaluate_checks_the_pipeline_targets_on_cuda_runs() -> None:
    def method(name: str, save_gbps: float, load_gbps: float) -> dict[str, Any]:
        return {"name": name, "status": "ok", "reason": None, "ratio": 1.2, "stored_bytes": 1, "save_seconds": 1.0,
                "load_seconds": 1.0, "pipeline": {
            "save_gbps": save_gbps, "load_gbps": load_gbps, "save_seconds": 0.5, "load_seconds": 0.7}}

    state = {"device": "cuda", "raw_bytes": 19_380_000_000, "tensors": 987,
             "methods": [method("ckptzip-auto", 40.8, 19.5), method("ckptzip-portable", 15.0, 31.0)]}
    targets = {t["id"]: t for t in evaluate(state, None)}
    assert (targets["auto-pipeline-save"]["measured"], targets["auto-pipeline-save"]["met"]) == (40.8, True)
    assert (targets["auto-pipeline-load"]["measured"], targets["auto-pipeline-load"]["met"]) == (19.5, False)
    assert targets["portable-pipeline-save"]["met"] is True and targets["portable-pipeline-load"]["met"] is True
    assert targets["auto-pipeline-save"]["detail"] == (
        "0.500 s on 19.38 GB in 987 tensors (issue 9 asks >= 8 GB, >= 500 tensors)")
    state["methods"][1]["pipeline"] = {"error": "RuntimeError: CUDA out of memory"}
    targets = {t["id"]: t for t in evaluate(state, None)}
    assert targets["portable-pipeline-load"]["met"] is None
    assert targets["portable-pipeline-load"]["detail"] == "ckptzip-portable: RuntimeError: CUDA out of memory"


def test_entropy_bound_and_reference_on_known_bytes() -> None:
    state = {
        "uniform": torch.arange(4096).to(torch.uint8),  # every byte value equally often: 8 bits/byte
        "weight": torch.zeros(1 << 18),  # one symbol per plane: nothing to code
    }
    entropy = entropy_by_group(state)
    assert entropy["other"]["bound"] == pytest.approx(1.0)
    assert entropy["other"]["planes"] == {"uint8": [8.0]}
    assert entropy["weights"]["bound"] is None
    assert entropy["weights"]["planes"] == {"float32": [0.0, 0.0, 0.0, 0.0]}
    reference = planes_reference(state, "cpu")
    assert reference["weights"]["best_ratio"] > 100
    assert reference["other"]["best_ratio"] > 10  # repeats: a matching coder beats the order-0 bound
    noise = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    reference = planes_reference({"noise": noise}, "cpu")
    assert reference["other"]["codecs"] == {"zstd-3": 1.0, "deflate-1": 1.0}  # kept raw: coding expands it


def test_evaluate_compares_against_disk_and_torch_save() -> None:
    state = {
        "methods": [
            {"name": "ckptzip-auto", "status": "ok", "reason": None, "ratio": 1.25, "stored_bytes": 2_000_000_000,
             "save_seconds": 1.0, "load_seconds": 1.0, "classes": {CORE: {"ratio": 1.25}}},
            {"name": "torch.save", "status": "ok", "reason": None, "ratio": 1.0, "stored_bytes": 2_500_000_000,
             "save_seconds": 2.0, "load_seconds": 1.1},
        ],
    }
    targets = {t["id"]: t for t in evaluate(state, {"write_gbps": 2.0, "read_gbps": 4.0, "read_cache": "cold"})}
    assert (targets["default-ratio"]["measured"], targets["default-ratio"]["met"]) == (1.25, True)
    assert (targets["save-vs-disk"]["measured"], targets["save-vs-disk"]["met"]) == (1.0, True)
    assert (targets["restore-vs-disk"]["measured"], targets["restore-vs-disk"]["met"]) == (2.0, False)
    assert "page cache cold" in targets["restore-vs-disk"]["detail"]
    assert (targets["save-vs-torch"]["measured"], targets["save-vs-torch"]["met"]) == (2.0, True)
    assert targets["restore-vs-torch"]["met"] is False
    assert targets["portable-ratio"]["met"] is None
    assert targets["portable-ratio"]["detail"] == "ckptzip-portable was not run (add it to --methods)"


def test_the_training_job_suite_says_what_it_measures_and_needs_a_gpu(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit) as done:
        bench(["training-job", "--help"])
    assert done.value.code == 0
    assert "``fresh``: new processes with empty Triton and ckptzip caches" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench(["training-job", "--parts", "fresh"]) == 2
    assert capsys.readouterr().err.strip() == ("ckptzip bench training-job: error: it measures a GPU under a "
                                               "training job's conditions and needs a CUDA device")
    assert bench(["training-job", "--parts", "filled,nope"]) == 2
    assert "unknown part(s) nope: choose from filled, repeat, manager, host, fresh" in capsys.readouterr().err


def test_the_discard_store_counts_a_managers_checkpoint_bytes_and_keeps_its_markers() -> None:
    import ckptzip
    from ckptzip_bench.discard import DiscardFileSystem, written

    state = {"w": torch.randn(1 << 16), "step": torch.tensor(3)}
    with ckptzip.CheckpointManager("discard://bench-test", keep_last=2) as manager:
        manager.save(1, state)
        manager.wait()
    stored = written("bench-test")
    expected = io.BytesIO()
    ckptzip.save(state, expected)
    assert stored > 0 and abs(stored - len(expected.getvalue())) < 4096  # the same container, but for its header
    kept = [path for path in DiscardFileSystem.store if "bench-test/" in path]
    assert kept and not any(path.endswith(".ckz") and DiscardFileSystem.store[path].getvalue() for path in kept)


def test_the_tier_suite_refuses_an_unknown_part(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench(["tier", "--parts", "rss,nope"]) == 2
    assert capsys.readouterr().err.strip() == (
        "ckptzip bench tier: error: unknown part(s) nope: choose from rss, restore, replicate, delta")


@pytest.mark.slow  # trains a model and starts fresh processes
def test_the_tier_suite_measures_the_tier_its_restores_and_deltas(tmp_path: Path) -> None:
    out = tmp_path / "tier.json"
    assert bench(["tier", "--parts", "rss,restore,delta", "--mb", "1", "--saves", "3", "--restores", "1",
                  "--steps", "2", "--warmup", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["rss"]["saves"] == 3 and 0 < doc["rss"]["tier_mb_last"] < 3  # two compressed 1 MB checkpoints
    assert doc["restore"]["from"] == ["memory"] and doc["restore"]["gb_per_s"] > 0
    steps = doc["delta"]["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["format"].startswith("2.") and s["identical"] > 0.5 and s["file_ratio"] > 1 for s in steps)


def test_the_gpu_codecs_suite_says_why_it_cannot_run(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptzip_bench import gpu_codecs

    monkeypatch.setattr(gpu_codecs, "nvcomp", SimpleNamespace(UNAVAILABLE_REASON="no CUDA device"))
    assert bench(["gpu-codecs", "--mib", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "ckptzip bench gpu-codecs: error: the GPU codecs cannot run here: no CUDA device")


@pytest.mark.gpu
def test_the_gpu_codecs_suite_round_trips_every_codec_it_probes(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench(["gpu-codecs", "--mib", "4", "--chunk-kib", "64", "--reps", "1", "--single-mib", "1",
                  "--codecs", "ans", "zstd", "gdeflate"]) == 0
    out = capsys.readouterr().out
    assert "All round trips bit-exact." in out and "gdeflate" in out


BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
HEADLINE_JSON = BENCH_DIR / "results" / "headline" / "h200-dense-medium.json"


def test_update_generated_replaces_only_the_lines_between_the_markers() -> None:
    text = f"# Results\n\nby hand\n{results.BEGIN}\nold\nlines\n{results.END}\nby hand too\n"
    assert results.update_generated(text, "new") == f"# Results\n\nby hand\n{results.BEGIN}\nnew\n{results.END}\nby hand too\n"
    for broken in ("no markers", f"{results.END}\n{results.BEGIN}", f"{results.BEGIN}\n{results.BEGIN}\n{results.END}"):
        with pytest.raises(results.BenchResultsError, match="to mark the generated part; add them where the headline"):
            results.update_generated(broken, "new")


def test_results_md_holds_the_headline_its_json_renders(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """bench/RESULTS.md's generated part is what `python -m ckptzip_bench.results --update` writes from
    the headline run's JSON, and the command leaves the hand-written rest, and the plot shown, as they are."""
    text = (BENCH_DIR / "RESULTS.md").read_text(encoding="utf-8")
    doc = results.load_results(HEADLINE_JSON)
    assert results.generated_part(text) == results.headline_block(doc, "bench.png")
    copy = tmp_path / "RESULTS.md"
    copy.write_text(text.replace("| ckptzip-auto | 1.232 |", "| ckptzip-auto | 9.999 |"), encoding="utf-8")
    assert results.main([str(HEADLINE_JSON), "--update", str(copy)]) == 0
    assert capsys.readouterr().out == f"updated the generated part of {copy}\n"
    assert copy.read_text(encoding="utf-8") == text
