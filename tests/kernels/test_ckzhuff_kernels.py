"""The GPU's ckz-huff coder (kernels/_ckzhuff_triton.py through kernels/ckzhuff.py) against the
CPU's (codecs/_ckzhuff.c): the same bytes from the same chunks, each decoding the other's, and
the same flaw named for every malformed chunk. On a GPU where one runs; else under Triton's
interpreter (`TRITON_INTERPRET=1`, as `make test` runs this file: small chunks, seconds)."""

from __future__ import annotations

import importlib.util

import ckzhuff_cases as cases
import ckzhuff_reference as ref
import numpy as np
import pytest
import torch

from ckptzip.codecs import get_codec, has_codec
from ckptzip.errors import CorruptChunkError
from ckptzip.codecs.ckzhuff import MAX_LEN
from ckptzip.kernels import INTERPRET, run_gpu
from ckptzip.kernels import ckzhuff as gpu_huff
from ckptzip.kernels.ckzhuff import CkzHuffCudaCodec

pytestmark = [
    pytest.mark.skipif(not has_codec("ckz-huff", "cpu"), reason="ckptzip's ckz-huff coder is not built"),
    pytest.mark.skipif(not (torch.cuda.is_available() or (INTERPRET and importlib.util.find_spec("triton"))),
                       reason="needs a CUDA device, or Triton's interpreter (TRITON_INTERPRET=1)"),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = [1, 513, 3000] if INTERPRET else [1, 16, 513, 3000, 65_537, 262_144, 1 << 22]
# The decoder's first levels: the shipped two-level one, and the single level (all 12 bits; the bench's JIT variant)
FIRSTS = [gpu_huff.FIRST, MAX_LEN]
KINDS = ["fp32 sign+exponent", "bf16 gradients", "two symbols", "skewed", "random", "constant", "sparse bitmap"]


def _gpu() -> CkzHuffCudaCodec:
    return CkzHuffCudaCodec()


def _cpu():  # noqa: ANN202
    return get_codec({"id": "ckz-huff"}, "cpu")


def _chunks() -> list[np.ndarray]:
    return [ref.samples(n, n)[kind] for n in SIZES for kind in KINDS]


def test_the_gpu_writes_the_cpus_bytes_and_reads_them() -> None:
    datas = _chunks()
    chunks = [torch.from_numpy(d).to(DEVICE) for d in datas]
    on_gpu = [c.cpu() for c in _gpu().encode(chunks)]
    on_cpu = _cpu().encode([torch.from_numpy(d) for d in datas])
    for data, g, c in zip(datas, on_gpu, on_cpu):
        assert torch.equal(g, c), (data.size, g.numel(), c.numel())
    decoded = _gpu().decode([c.to(DEVICE) for c in on_cpu], [d.size for d in datas])
    for data, d in zip(datas, decoded):
        assert np.array_equal(d.cpu().numpy(), data)


def test_the_encoders_deepest_trees_and_ties_alike() -> None:
    """Counts that make a tree 15 deep (limited to 12) and many equal counts."""
    fib = [1, 1]
    while len(fib) < 16:
        fib.append(fib[-1] + fib[-2])
    deep = np.repeat(np.arange(16, dtype=np.uint8) * 9, fib)
    np.random.default_rng(1).shuffle(deep)
    assert ref.huffman_depths(np.bincount(deep, minlength=256)).max() == 15
    ties = np.repeat(np.arange(40, dtype=np.uint8) * 5, 7)
    np.random.default_rng(2).shuffle(ties)
    for plane in (deep, ties):
        (g,) = _gpu().encode([torch.from_numpy(plane).to(DEVICE)])
        assert g.cpu().numpy().tobytes() == ref.encode(plane.tobytes())


def test_segments_read_and_written_in_place() -> None:
    data = np.concatenate([ref.samples(2048, 3)["fp32 sign+exponent"], ref.samples(1024, 4)["skewed"]])
    base = torch.from_numpy(data).to(DEVICE)
    offsets, lengths = np.array([0, 1024, 2048]), np.array([1024, 1024, 1024])
    out, out_offsets, sizes = _gpu().encode_segments(base, offsets, lengths)
    back = torch.zeros(4096, dtype=torch.uint8, device=DEVICE)
    _gpu().decode_segments(out, out_offsets, sizes, back, np.array([0, 1024, 3072]), lengths)
    assert np.array_equal(back.cpu().numpy()[[*range(2048), *range(3072, 4096)]], data)
    with pytest.raises(ValueError, match="4-byte aligned addresses; source chunk 1 is at offset 1026"):
        _gpu().encode_segments(base, np.array([0, 1026]), np.array([16, 16]))


@pytest.mark.parametrize("name", [name for name, _ in cases.FLAWED])
def test_a_malformed_chunk_is_named_as_the_cpu_names_it(name: str) -> None:
    chunk, n = cases.malformed(name)
    good = cases.valid()
    chunks = [torch.frombuffer(bytearray(c), dtype=torch.uint8) for c in (good, chunk)]
    with pytest.raises(CorruptChunkError) as on_cpu:
        _cpu().decode(chunks, [cases.data().size, n])
    with pytest.raises(CorruptChunkError) as on_gpu:
        _gpu().decode([c.to(DEVICE) for c in chunks], [cases.data().size, n])
    assert str(on_gpu.value) == str(on_cpu.value) and on_gpu.value.chunk == 1


def test_damaged_chunks_decode_to_their_size_or_fail_without_writing_outside() -> None:
    rng = np.random.default_rng(5)
    data = ref.samples(1500, 6)["fp32 sign+exponent"]
    chunk = np.frombuffer(ref.encode(data.tobytes()), np.uint8)
    for trial in range(6 if INTERPRET else 300):
        damaged = chunk.copy()
        if trial % 3 == 0:
            damaged = damaged[: int(rng.integers(0, damaged.size))]
        else:
            bits = rng.integers(0, 8 * damaged.size, int(rng.integers(1, 6)))
            np.bitwise_xor.at(damaged, bits // 8, (1 << (bits % 8)).astype(np.uint8))
        src = torch.zeros(damaged.size + 64, dtype=torch.uint8)
        src[: damaged.size] = torch.from_numpy(damaged)
        slot = torch.full((1500 + 64,), 0xA5, dtype=torch.uint8, device=DEVICE)
        try:
            _gpu().decode_segments(src.to(DEVICE), np.array([0]), np.array([damaged.size]), slot, np.array([32]),
                                   np.array([1500]))
        except CorruptChunkError as exc:
            assert exc.chunk == 0
        back = slot.cpu()
        assert bool((back[:32] == 0xA5).all()) and bool((back[32 + 1500 :] == 0xA5).all())


def _different_codes(count: int, n: int) -> list[np.ndarray]:
    """Chunks whose codes differ from one to the next: other symbols and skews, codes of 1 to 12 bits."""
    rng = np.random.default_rng(7)
    return [((rng.geometric(0.03 + 0.9 * i / count, n) + 37 * i) % 256).astype(np.uint8) for i in range(count)]


def _decode_tables(coded: list[torch.Tensor], raw: list[int], first: int, guard: int) -> tuple[torch.Tensor, list[int]]:
    """table_kernel's tables of these chunks (``guard`` entries more, -7 unless written) and their statuses."""
    lengths = np.array([c.numel() for c in coded])
    src, offsets = gpu_huff._pack([c.to(DEVICE) for c in coded], lengths)
    table = gpu_huff._rows(src, offsets, lengths, src, offsets, np.array(raw))
    scratch = torch.empty(len(coded) * gpu_huff.DEC_ROW, dtype=torch.int32, device=DEVICE)
    tables = torch.full((len(coded) * gpu_huff.TABLE + guard,), -7, dtype=torch.int16, device=DEVICE)
    status = torch.zeros(len(coded), dtype=torch.int32, device=DEVICE)
    run_gpu(gpu_huff.MODULE, "table_kernel", len(coded), src.device, (table, scratch, tables, status), {"FIRST": first},
            gpu_huff.PLAN_WARPS)
    return tables.cpu(), status.cpu().tolist()


@pytest.mark.parametrize("first", FIRSTS)
def test_each_chunks_decode_tables_are_its_own_and_stay_in_its_entries(first: int) -> None:
    """With FIRST == 12 the table kernel once wrote a first level of 4096 entries into 256, over the
    next chunk's table of all codes (on a GPU, in whatever order the programs ran: a chunk whose
    lanes then did not fill their words) and past the last chunk's (the interpreter runs the
    programs in order, so only that write shows there)."""
    datas = _different_codes(3, 1024)
    coded = _cpu().encode([torch.from_numpy(d) for d in datas])
    together, status = _decode_tables(coded, [d.size for d in datas], first, gpu_huff.TABLE)
    assert status == [0, 0, 0]
    assert bool((together[3 * gpu_huff.TABLE :] == -7).all())
    for i, chunk in enumerate(coded):
        alone, _ = _decode_tables([chunk], [datas[i].size], first, 0)
        assert torch.equal(together[i * gpu_huff.TABLE : (i + 1) * gpu_huff.TABLE], alone)


@pytest.mark.parametrize("first", FIRSTS)
def test_either_decoder_reads_chunks_of_different_codes(first: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_huff, "FIRST", first)
    datas = _different_codes(4 if INTERPRET else 64, 1500 if INTERPRET else 65_536)
    coded = _cpu().encode([torch.from_numpy(d) for d in datas])
    for data, back in zip(datas, _gpu().decode([c.to(DEVICE) for c in coded], [d.size for d in datas])):
        assert np.array_equal(back.cpu().numpy(), data)


@pytest.mark.gpu
@pytest.mark.parametrize("first", FIRSTS)
def test_a_large_plane_of_many_chunks_round_trips_through_either_decoder(first: int,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """As bench/coder_gpu.py codes a plane: one call over many chunks in place, each with its own code."""
    monkeypatch.setattr(gpu_huff, "FIRST", first)
    chunk = gpu_huff.CkzHuffCudaCodec.chunk_bytes
    plane = torch.from_numpy(np.concatenate(_different_codes(256, chunk))).cuda()
    offsets = np.arange(256, dtype=np.int64) * chunk
    lengths = np.full(256, chunk, dtype=np.int64)
    out, out_offsets, sizes = _gpu().encode_segments(plane, offsets, lengths)
    back = torch.zeros_like(plane)
    _gpu().decode_segments(out, out_offsets, sizes, back, offsets, lengths)
    assert torch.equal(back, plane)
