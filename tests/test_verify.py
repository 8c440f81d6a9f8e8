"""Issue #44: ``verify`` holds a batch of decoded tensors at a time, not the whole state, checks
every checksum, and reads a GPU's file on a machine without a GPU, as load does."""

from __future__ import annotations

import dataclasses
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptzip
from ckptzip import api
from ckptzip.cli import main
from ckptzip.codecs import has_codec
from ckptzip.errors import CorruptCheckpointError

GOLDEN = Path(__file__).parent / "golden"
KIB = 1 << 10


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    layers = {f"layer{i}.w": torch.randn(64, 256, generator=g) for i in range(12)}  # 64 KiB each
    master = torch.randn(128, 256, generator=g)
    return {"model": layers, "master": master, "half": master.bfloat16(), "dup": layers["layer3.w"].clone(),
            "big": torch.randn(1024, 256, generator=g), "step": 7}


def _record_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], int]]:
    """Each read_tensors call of the reader: its indices and the bytes it returned, asserting
    that every tensor an earlier call returned is gone before the next call decodes."""
    calls: list[tuple[list[int], int]] = []
    alive: list[weakref.ref[torch.Tensor]] = []
    real = api.read_tensors

    def recording(reader: Any, indices: list[int], *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        held = [ref for ref in alive if ref() is not None]
        assert not held, f"{len(held)} tensors of an earlier batch are still held"
        out = real(reader, indices, *args, **kwargs)
        alive.extend(weakref.ref(t) for t in out)
        calls.append((list(indices), sum(t.numel() * t.element_size() for t in out)))
        return out

    monkeypatch.setattr(api, "read_tensors", recording)
    return calls


def test_verify_holds_one_batch_of_decoded_tensors_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckptzip.save(_state(), tmp_path / "a.ckz")
    calls = _record_reads(monkeypatch)
    with ckptzip.open(tmp_path / "a.ckz") as reader:
        entries = reader.entries()
        reader.verify(batch_bytes=200 * KIB)
    names = [entries[i].name for indices, _ in calls for i in indices]
    assert sorted(names) == sorted(e.name for e in entries)  # every tensor once
    assert len(calls) > 5
    big = next(i for i, e in enumerate(entries) if e.name == "big")
    for indices, nbytes in calls:
        assert nbytes <= 200 * KIB or indices == [big], (indices, nbytes)  # a larger tensor alone
    half = next(i for i, e in enumerate(entries) if e.name == "half")
    assert any(half in indices and entries[half].source_target in indices for indices, _ in calls)  # with its source


def test_verify_batches_group_references_with_what_they_are_made_from(tmp_path: Path) -> None:
    ckptzip.save(_state(), tmp_path / "a.ckz")
    with ckptzip.open(tmp_path / "a.ckz") as reader:
        entries = reader.entries()
    batches = api.verify_batches(entries, 1)  # every group alone
    references = [i for i, e in enumerate(entries) if e.is_reference]
    assert {entries[i].source_kind for i in references} == {"cast", "copy"}
    for i in references:
        assert any(i in b and entries[i].source_target in b for b in batches)
    assert sorted(i for b in batches for i in b) == list(range(len(entries)))
    (whole,) = api.verify_batches(entries, 1 << 40)
    assert sorted(whole) == list(range(len(entries)))


def test_verify_reports_damage_in_a_later_batch_by_its_tensor(tmp_path: Path) -> None:
    state = {f"t{i}": torch.arange(16384, dtype=torch.int32) * (i + 1) for i in range(6)}
    ckptzip.save(state, tmp_path / "a.ckz", codec="raw")
    with ckptzip.open(tmp_path / "a.ckz") as reader:
        chunk = reader.entries()[5].streams[0].chunks[0]
    data = bytearray((tmp_path / "a.ckz").read_bytes())
    data[chunk.offset + 100] ^= 0x40
    (tmp_path / "a.ckz").write_bytes(bytes(data))
    with ckptzip.open(tmp_path / "a.ckz") as reader, pytest.raises(CorruptCheckpointError, match="tensor 't5'"):
        reader.verify(batch_bytes=64 * KIB)


@pytest.mark.parametrize("name", ["gpu_gdeflate_v2_1.ckz", "gpu_zstd_v1_0.ckz"])
def test_verify_reads_a_gpu_written_file_where_load_does(name: str, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #44: verify said 'pass map_location='cpu'', an option it does not have."""
    if name.startswith("gpu_gdeflate") and not has_codec("gdeflate", "cpu"):
        pytest.skip("ckptzip's GDeflate decoder is not built here")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without a GPU
    with ckptzip.open(GOLDEN / name) as reader:
        assert {e.device for e in reader.entries()} == {"cuda:0"}
        assert api.local_location(reader.entries()) == {"cuda:0": "cpu"}
    assert main(["verify", str(GOLDEN / name)]) == 0
    assert ": 11 tensors (1011.0 KiB), every checksum verified, " in capsys.readouterr().out


def test_local_location_keeps_a_gpu_this_machine_has(monkeypatch: pytest.MonkeyPatch) -> None:
    with ckptzip.open(GOLDEN / "gpu_zstd_v1_0.ckz") as gpu, ckptzip.open(GOLDEN / "cpu_zstd_v2_0.ckz") as cpu:
        entries = [*gpu.entries(), dataclasses.replace(gpu.entries()[0], device="cuda:3"), cpu.entries()[0]]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert api.local_location(entries) == {"cuda:0": "cuda:0", "cuda:3": "cuda", "cpu": "cpu"}


@pytest.mark.gpu
def test_verify_decodes_a_gpu_file_on_its_gpu_a_batch_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {f"w{i}": torch.randn(1 << 16, device="cuda", generator=g).bfloat16() for i in range(8)}
    ckptzip.save(state, tmp_path / "g.ckz")
    calls = _record_reads(monkeypatch)
    devices: list[torch.device] = []
    recording = api.read_tensors

    def on(reader: Any, indices: list[int], targets: list[torch.device], *args: Any, **kwargs: Any) -> Any:
        devices.extend(targets)
        return recording(reader, indices, targets, *args, **kwargs)

    monkeypatch.setattr(api, "read_tensors", on)
    assert main(["verify", str(tmp_path / "g.ckz")]) == 0
    assert {d.type for d in devices} == {"cuda"} and len(calls) == 1  # 1 MiB: one batch
    with ckptzip.open(tmp_path / "g.ckz") as reader:
        reader.map_location = api.local_location(reader.entries())
        reader.verify(batch_bytes=300 * KIB)
    assert len(calls) == 1 + 4

