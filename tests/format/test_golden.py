"""Committed golden files decode on every run, so files written by earlier releases (and on the
GPU) keep reading. tests/golden/make_golden.py wrote them; tests/golden_state.py rebuilds the
state they hold from integer arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest

import ckptzip
from ckptzip.codecs import has_codec
from golden_state import golden_state
from helpers import assert_same

GOLDEN = Path(__file__).parents[1] / "golden"
PORTABLE = ["cpu_zstd_v1_0.ckz", "gpu_zstd_v1_0.ckz", "cpu_zstd_v2_0.ckz"]


@pytest.mark.parametrize("name", PORTABLE)
def test_portable_golden_files_decode_on_the_cpu(name: str) -> None:
    assert_same(ckptzip.load(GOLDEN / name, map_location="cpu"), golden_state())


def test_format_2_golden_file_has_wsum64_chunk_digests() -> None:
    with ckptzip.open(GOLDEN / "cpu_zstd_v2_0.ckz") as reader:
        assert reader._reader.index.version == (2, 0)
        assert reader._reader.digest_is_wsum64


def test_gpu_zstd_golden_file_was_coded_by_nvcomp_zstd() -> None:
    with ckptzip.open(GOLDEN / "gpu_zstd_v1_0.ckz") as reader:
        entries = {e.name: e for e in reader.entries()}
    assert entries["model.embed.weight"].device == "cuda:0"
    assert entries["model.embed.weight"].codecs == ["raw", "raw", "raw", "zstd"]


def test_gpu_only_golden_file_reports_how_to_read_it_without_a_gpu() -> None:
    if has_codec("ans", "cuda"):
        pytest.skip("this machine decodes ans on its GPU")
    with pytest.raises(ckptzip.CodecUnavailableError) as info:
        ckptzip.load(GOLDEN / "gpu_ans_v1_0.ckz", map_location="cpu")
    message = str(info.value)
    assert "'ans' is GPU-only" in message
    assert "ckptzip convert SRC DST --codec portable" in message
    assert "tensor 'model.embed.weight' stream 3" in message


def test_gpu_only_golden_file_still_opens_lazily_without_a_gpu() -> None:
    with ckptzip.open(GOLDEN / "gpu_ans_v1_0.ckz", map_location="cpu") as reader:
        assert "ans" in {c for e in reader.entries() for c in e.codecs}
        assert_same(reader["model.norm.weight"], golden_state()["model"]["norm.weight"])


@pytest.mark.gpu
@pytest.mark.parametrize("name", [*PORTABLE, "gpu_ans_v1_0.ckz"])
@pytest.mark.parametrize("location", ["cuda", "cpu"])
def test_golden_files_decode_on_the_gpu(name: str, location: str) -> None:
    if not has_codec("ans", "cuda"):
        pytest.skip("nvCOMP is not installed")
    got = ckptzip.load(GOLDEN / name, map_location=location)
    assert got["model"]["embed.weight"].device.type == location
    assert_same(got, golden_state())


def test_dcp_checkpoint_of_ckptzip_0_1_loads() -> None:
    """tests/golden/dcp_v1 was written by ckptzip 0.1.0 (ckptzip-dcp metadata version 1: one
    format-1 container per item, addressed by byte range)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ckptzip.dcp import CompressedStorageReader

    target = {"w": torch.zeros(40, 50), "ids": torch.zeros(11, dtype=torch.int64),
              "bf": torch.zeros(3000, dtype=torch.bfloat16), "opt": {"step": torch.tensor(0.0), "lr": 0.0, "name": ""}}
    dcp.load(target, storage_reader=CompressedStorageReader(GOLDEN / "dcp_v1"), no_dist=True)
    want = {"w": torch.arange(2000, dtype=torch.float32).reshape(40, 50) / 7, "ids": torch.arange(11),
            "bf": torch.linspace(-2, 2, 3000).bfloat16(), "opt": {"step": torch.tensor(7.0), "lr": 0.5, "name": "adamw"}}
    assert_same(target, want)


def test_format_2_1_golden_file_with_casts_and_a_duplicate_decodes() -> None:
    """cpu_zstd_v2_1_refs.ckz: the bf16 embedding and the fp16 head are casts, a moment is a copy."""
    from golden_state import golden_state_2_1

    with ckptzip.open(GOLDEN / "cpu_zstd_v2_1_refs.ckz") as reader:
        assert reader._reader.index.version == (2, 1)
        sources = {e.name: e.source for e in reader.entries() if e.source}
        assert_same(reader.load(), golden_state_2_1())
    assert sources == {"model.embed.weight_bf16": {"cast": 0}, "model.head.weight": {"cast": 11},
                       "exp_avg_copy": {"copy": 5}}


def test_format_2_1_golden_delta_file_decodes_against_its_base() -> None:
    """cpu_zstd_v2_1_delta.ckz stores XOR deltas against cpu_zstd_v2_1_refs.ckz."""
    from golden_state import golden_delta_state

    with ckptzip.open(GOLDEN / "cpu_zstd_v2_1_refs.ckz") as base:
        base_hash, base_tensors = base.content_hash, base.named_tensors()
    with ckptzip.open(GOLDEN / "cpu_zstd_v2_1_delta.ckz") as reader:
        (ref,) = reader.bases
        assert (ref.step, ref.name, ref.content_hash) == (100, "cpu_zstd_v2_1_refs.ckz", base_hash)
        assert {e.name for e in reader.entries() if e.source_kind == "xor"} >= {"model.embed.weight"}
        assert_same(reader.load(base_tensors=[base_tensors]), golden_delta_state())
    with pytest.raises(ckptzip.CkptzipError, match="XOR delta against the base checkpoint step 100"):
        ckptzip.load(GOLDEN / "cpu_zstd_v2_1_delta.ckz")


def test_format_2_2_golden_sparse_delta_file_decodes_against_its_base() -> None:
    """cpu_zstd_v2_2_sparse.ckz stores XOR deltas coded sparse against cpu_zstd_v2_1_refs.ckz:
    one element in 64 of the embeddings moved, the unchanged tensors' residues all zero."""
    from golden_state import golden_sparse_delta_state

    from ckptzip.report import pipeline_label, sources_note

    with ckptzip.open(GOLDEN / "cpu_zstd_v2_1_refs.ckz") as base:
        base_tensors = base.named_tensors()
    with ckptzip.open(GOLDEN / "cpu_zstd_v2_2_sparse.ckz") as reader:
        assert reader._reader.index.version == (2, 2)
        entries = {e.name: e for e in reader.entries()}
        assert_same(reader.load(base_tensors=[base_tensors]), golden_sparse_delta_state())
        note = sources_note(reader.entries(), reader.bases)
    assert entries["model.embed.weight"].transforms == [{"id": "sparse", "itemsize": 4, "count": 1024}]
    assert entries["model.embed.weight_bf16"].transforms == [{"id": "sparse", "itemsize": 2, "count": 1024}]
    assert {entries[n].transforms[0]["count"] for n in ("optimizer.state.0.exp_avg", "tokens", "fp8")} == {0}
    assert pipeline_label(entries["model.embed.weight"]) == "xor+sparse(1.6%)[zstd×5]"
    assert "stored as XOR deltas: 9 tensors, 1.0 MiB (1.0 MiB not stored; 7 coded sparse)" in note


def test_ckz_huff_golden_files_decode_on_the_cpu_and_the_encoder_still_writes_them() -> None:
    """cpu_ckzhuff_v2_1.ckz ("huff" preset, CPU): it loads, and saving its state again writes its
    chunks byte for byte (the encoder's choices are part of what the GPU's kernels reproduce);
    cpu_ckzhuff_v2_2_sparse.ckz: sparse XOR residues, bitmaps and values, in ckz-huff."""
    import io

    from golden_state import golden_sparse_delta_state

    with ckptzip.open(GOLDEN / "cpu_ckzhuff_v2_1.ckz") as reader:
        assert {c for e in reader.entries() for c in e.codecs} == {"ckz-huff", "raw"}
        assert_same(reader.load(), golden_state())
    again = io.BytesIO()
    ckptzip.save(golden_state(), again, codec="huff")
    assert _data_section(again.getvalue()) == _data_section((GOLDEN / "cpu_ckzhuff_v2_1.ckz").read_bytes())
    with ckptzip.open(GOLDEN / "cpu_zstd_v2_1_refs.ckz") as base:
        base_tensors = base.named_tensors()
    with ckptzip.open(GOLDEN / "cpu_ckzhuff_v2_2_sparse.ckz") as reader:
        entries = {e.name: e for e in reader.entries()}
        assert_same(reader.load(base_tensors=[base_tensors]), golden_sparse_delta_state())
    assert entries["model.embed.weight"].codecs[0] == "ckz-huff"  # the bitmap


def test_gpu_written_ckz_huff_golden_file_decodes_on_the_cpu() -> None:
    """gpu_ckzhuff_v2_1.ckz was written by ckz-huff's GPU kernels (an H100): it loads on the CPU,
    and its stored chunks are the CPU encoder's byte for byte (the files differ only in the
    devices their index records)."""
    with ckptzip.open(GOLDEN / "gpu_ckzhuff_v2_1.ckz", map_location="cpu") as reader:
        entries = {e.name: e for e in reader.entries()}
        assert_same(reader.load(), golden_state())
    assert entries["model.embed.weight"].device == "cuda:0"
    assert "ckz-huff" in entries["model.embed.weight"].codecs
    gpu, cpu = ((GOLDEN / name).read_bytes() for name in ("gpu_ckzhuff_v2_1.ckz", "cpu_ckzhuff_v2_1.ckz"))
    assert _data_section(gpu) == _data_section(cpu)


def _data_section(file: bytes) -> bytes:
    """A file's stored chunks: from the preamble to the index (which names the writer's version)."""
    return file[16 : int.from_bytes(file[-32:-24], "little")]


@pytest.mark.gpu
@pytest.mark.parametrize("location", ["cuda", "cpu"])
def test_ckz_huff_golden_file_decodes_on_the_gpu(location: str) -> None:
    if not has_codec("ckz-huff", "cuda"):
        pytest.skip("ckz-huff's kernels do not run here")
    got = ckptzip.load(GOLDEN / "cpu_ckzhuff_v2_1.ckz", map_location=location)
    assert got["model"]["embed.weight"].device.type == location
    assert_same(got, golden_state())
