"""The GPU memory budget (ckptzip/memory/gpu.py): what a call may use, the error below the minimum, no
memory kept after a call, batches that shrink to what is free, and the manager's choice."""

from __future__ import annotations

import gc
import io
import logging
import sys
import threading
from typing import Any
from collections.abc import Iterator

import pytest
import torch

import ckptzip
from ckptzip.engine import encode as engine_encode
from ckptzip.memory import gpu as gpu_memory
from ckptzip.engine import plan as engine_plan
from ckptzip.engine import reader as engine_reader
from ckptzip.engine import pipeline as engine_pipeline
from ckptzip.engine import staged as engine_staged
from ckptzip.engine import stager as engine_stager
from ckptzip.engine import writer as engine_writer
from ckptzip.engine.policy import Policy
from helpers import assert_same, assert_same_tensor

MIB = 1 << 20
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _state(n: int = 6, elements: int = 1 << 22) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(3)
    state = {f"w{i}": torch.randn(elements, generator=g, device="cuda") * 0.02 for i in range(n)}
    state["g"] = (torch.randn(elements, generator=g, device="cuda") * 1e-3).bfloat16()
    state["step"] = torch.tensor(5, device="cuda")
    return state


@pytest.fixture(autouse=True)
def _give_back_the_filler() -> Iterator[None]:
    """Tests fill the GPU: hand what torch cached back to the driver for the tests after them."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def _fill(leave: int) -> torch.Tensor | None:
    """Take what is free on the GPU except ``leave`` bytes, as a training job's tensors do."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    return torch.empty(free - leave, dtype=torch.uint8, device="cuda") if free > leave else None


def test_the_cap_comes_from_the_argument_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gpu_memory.ENV, raising=False)
    assert gpu_memory.cap(None) is None
    assert gpu_memory.cap(512 * MIB) == 512 * MIB
    monkeypatch.setenv(gpu_memory.ENV, "300")
    assert gpu_memory.cap(None) == 300 * MIB
    assert gpu_memory.cap(1 << 30) == 1 << 30  # the argument wins
    monkeypatch.setenv(gpu_memory.ENV, "lots")
    with pytest.raises(ckptzip.CkptzipError, match=r"CKPTZIP_GPU_MEMORY_MB='lots': expected a whole number of MiB"):
        gpu_memory.cap(None)
    for bad in (0, -5, 1.5, True, "1G"):
        with pytest.raises(ckptzip.CkptzipError, match=r"gpu_memory must be a number of bytes above 0"):
            gpu_memory.cap(bad)  # type: ignore[arg-type]


def test_a_budget_below_the_minimum_names_the_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gpu_memory.ENV, raising=False)
    monkeypatch.setattr(gpu_memory, "available", lambda device: 200 * MIB)
    device = torch.device("cuda", 0)
    with pytest.raises(ckptzip.GpuMemoryError, match=r"save on cuda:0 needs at least 256 MiB of GPU memory beside "
                                                      r"the state; 200 MiB can be had there .*Nothing was written"):
        gpu_memory.budget(device, None, "save")
    monkeypatch.setattr(gpu_memory, "available", lambda device: 8 << 30)
    with pytest.raises(ckptzip.GpuMemoryError, match=r"8192 MiB can be had there .*, capped at 100 MiB"):
        gpu_memory.budget(device, 100 * MIB, "load")
    assert isinstance(ckptzip.GpuMemoryError("x"), MemoryError)


def test_a_snapshot_whose_coding_fails_gives_its_staging_buffers_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # a host snapshot's batches take pinned buffers of the manager's pool as they go; one that fails
    # after some batches must not keep them (the pool would grow by that much with every failure)
    class Pool:
        buffer_bytes = 64

        def __init__(self) -> None:
            self.released: list[torch.Tensor] = []

        def reserve(self, nbytes: int) -> None:
            pass

        def release(self, buffer: torch.Tensor) -> None:
            self.released.append(buffer)

    taken = [torch.zeros(64, dtype=torch.uint8) for _ in range(2)]

    def failing(encode: object, stager: engine_stager.Stager, sink: object) -> None:
        for buffer in taken:  # two batches staged, then the third runs out of memory
            stager._deliver(engine_stager.Job((buffer[:10], 10), first=True, release=buffer))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    monkeypatch.setattr(engine_staged, "run_pipeline", failing)
    pool = Pool()
    with pytest.raises(ckptzip.GpuMemoryError, match=r"^snapshot ran out of GPU memory \(CUDA out of memory\. "
                                                      r"Tried to allocate 2\.00 MiB\)"):
        w = [torch.ones(4)]
        engine_staged.stage_table(engine_staged.staged_table(["w"], w, None), Policy.parse("auto"),
                                  engine_plan.GpuLimits.of(w, Policy.parse("auto"), None, 1 << 20), pool)  # type: ignore[arg-type]
    assert [b.data_ptr() for b in pool.released] == [b.data_ptr() for b in taken]


def test_staged_batches_fill_the_pools_buffers_back_to_back() -> None:
    class Pool:
        buffer_bytes = 100

        def __init__(self) -> None:
            self.taken: list[torch.Tensor] = []

        def acquire(self) -> torch.Tensor:
            self.taken.append(torch.zeros(self.buffer_bytes, dtype=torch.uint8))
            return self.taken[-1]

    pool = Pool()
    packing = engine_stager.Packing(pool)  # type: ignore[arg-type]
    pieces = []
    for batch in (30, 90, 180, 0, 5):  # a batch's bytes, taken as stage() does
        start = 0
        while True:
            piece, release = packing.take(batch - start)
            pieces.append((piece, release))
            start += piece.numel()
            if start == batch:
                break
    assert [p.numel() for p, _ in pieces] == [30, 70, 20, 80, 100, 0, 5]
    assert [r is not None for _, r in pieces] == [False, True, False, True, True, False, False]
    assert len(pool.taken) == 4 and packing.buffer is pool.taken[3] and packing.fill == 5  # 305 bytes in 4 buffers
    # each piece lies where the last one ended
    assert [p.data_ptr() for p, _ in pieces[:2]] == [pool.taken[0].data_ptr(), pool.taken[0].data_ptr() + 30]
    assert pieces[2][0].data_ptr() == pool.taken[1].data_ptr() and pieces[3][0].data_ptr() == pool.taken[1].data_ptr() + 20


@gpu
@needs_cuda
def test_a_host_snapshots_batches_share_their_staging_buffers_and_give_them_all_back() -> None:
    from ckptzip.memory.pinned import PinnedPool
    from ckptzip.tree import flatten

    state = _state(n=6, elements=(3 << 20) // 4 + 1000)  # 3 MiB and a bit, each: batches end mid-buffer
    flat = flatten(state)
    pool = PinnedPool(1 << 20, sys.maxsize)
    tensors = [t.tensor for t in flat.tensors]
    staged = engine_staged.stage_table(engine_staged.staged_table([t.name for t in flat.tensors], tensors, None),
                                       Policy.parse("auto"), engine_plan.GpuLimits.of(tensors, Policy.parse("auto"), None,
                                                                                      4 << 20), pool)
    buffers = {id(job.release) for job in staged.jobs if job.release is not None}
    assert len(buffers) == -(-staged.nbytes // (1 << 20))  # packed: no partly used buffer a batch
    assert staged.occupied_bytes == len(buffers) << 20
    buf = io.BytesIO()
    engine_staged.write_staged(buf, staged, flat.tree, Policy.parse("auto"))
    assert pool._free.qsize() == pool._created  # every buffer back in the pool
    assert_same(ckptzip.load(buf.getvalue()), state)


def test_batches_are_sized_from_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    device = torch.device("cuda", 0)
    monkeypatch.setattr(gpu_memory, "available", lambda device: 2 << 30)
    budget = gpu_memory.budget(device, None, "save")
    assert budget.nbytes == 2 << 30
    assert budget.batch_bytes(6, 1 << 30) == (2 << 30) // 6 // MIB * MIB
    assert gpu_memory.budget(device, None, "save").batch_bytes(6, 64 * MIB) == 64 * MIB  # at most the cap
    monkeypatch.setattr(gpu_memory, "available", lambda device: 300 * MIB)
    assert gpu_memory.budget(device, None, "save").batch_bytes(6, 1 << 30) == 50 * MIB


def test_batches_overlap_in_blocks_and_where_the_budget_holds_enough_of_them(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(engine_plan, "_keys", lambda tensors, policy, limits=None: [engine_plan.BatchKey("cuda", cuda)])
    monkeypatch.setattr(Policy, "gpu_scratch_bytes", lambda self: 0)
    policy = Policy.parse("auto")
    free = [0]
    monkeypatch.setattr(gpu_memory, "available", lambda device: free[0])

    def limits(batch_cap: int | None = None) -> engine_plan.GpuLimits:
        return engine_plan.GpuLimits.of([torch.empty(0)], policy, None, batch_cap)

    free[0] = 2 << 30  # the budget limits the batches: blocks, overlapped
    assert cuda in limits().block and limits().overlap == {cuda}
    free[0] = 64 << 30  # two lanes of 2 GiB batches: not overlapped
    assert limits().lanes == 2 and not limits().overlap
    free[0] = 16 << 30  # one lane of 2 GiB batches, not twelve of them
    assert limits().lanes == 1 and not limits().block and not limits().overlap
    free[0] = 3300 * MIB  # a host snapshot's 256 MiB batches: twelve fit, overlapped without blocks
    assert not limits(256 * MIB).block and limits(256 * MIB).overlap == {cuda}
    free[0] = 2800 * MIB
    assert not limits(256 * MIB).block and not limits(256 * MIB).overlap


def test_gpus_whose_batches_are_small_code_them_in_the_codecs_small_batch_chunks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = [torch.device("cuda", 0), torch.device("cuda", 1)]
    monkeypatch.setattr(engine_plan, "_keys", lambda tensors, policy, limits=None: [
        engine_plan.BatchKey("cuda", d) for d in cuda])
    free = {0: 64 << 30, 1: 2 << 30}
    monkeypatch.setattr(gpu_memory, "available", lambda device: free[device.index])
    monkeypatch.setattr(Policy, "gpu_scratch_bytes", lambda self: 0)  # gdeflate asks none
    policy = Policy.parse("auto")
    limits = engine_plan.GpuLimits.of([torch.empty(0), torch.empty(0)], policy, None)
    assert list(limits.block) == [cuda[1]]  # 2 GiB: batches of a twelfth, in blocks
    assert limits.policy_on(cuda[0], policy) is policy  # 2 GiB batches
    small = limits.policy_on(cuda[1], policy)
    assert small == Policy("auto", small_batches=True)
    capped = engine_plan.GpuLimits.of([torch.empty(0), torch.empty(0)], policy, None, 256 * MIB)
    assert not capped.block and capped.policy_on(cuda[0], policy) == small  # host snapshots' 256 MiB batches
    free[1] = 10 << 30  # blocks of about 850 MiB: launches of many chunks
    roomy = engine_plan.GpuLimits.of([torch.empty(0), torch.empty(0)], policy, None)
    assert list(roomy.block) == [cuda[1]] and roomy.policy_on(cuda[1], policy) is policy
    gdeflate = type("Gdeflate", (), {"chunk_bytes": 256 << 10, "small_batch_chunk_bytes": 128 << 10,
                                     "max_chunk_bytes": 1 << 31, "backend": "cuda"})()
    raw = type("Raw", (), {"chunk_bytes": 16 << 20, "small_batch_chunk_bytes": None,
                           "max_chunk_bytes": 1 << 62, "backend": "cpu"})()
    assert [policy.chunk_bytes_for(c) for c in (gdeflate, raw)] == [256 << 10, 16 << 20]  # type: ignore[arg-type]
    assert [small.chunk_bytes_for(c) for c in (gdeflate, raw)] == [128 << 10, 16 << 20]  # type: ignore[arg-type]
    chosen = Policy("auto", chunk_bytes=1 << 20, small_batches=True)
    assert chosen.chunk_bytes_for(gdeflate) == 1 << 20  # type: ignore[arg-type]  # a chunk size set is kept


def test_batches_of_blocks_are_packed_first_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(engine_plan, "_keys", lambda tensors, policy, limits=None: [
        engine_plan.BatchKey("cuda", gpu)] * len(tensors))
    sizes = ([172] * 3 + [86]) * 3 + ([64] * 3 + [32]) * 4  # MiB: a 7B-like layer's tensors
    tensors = [torch.empty(n * MIB, dtype=torch.uint8) for n in sizes]
    limits = engine_plan.GpuLimits({gpu: 330 * MIB}, {gpu: 330 * MIB}, {gpu: 2310 * MIB},
                                     block={gpu: 332 * MIB})
    plan = engine_plan.save_batches(tensors, Policy.parse("auto"), limits)
    batches = [idx for _, idx in plan]
    assert sorted(i for idx in batches for i in idx) == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in idx) <= 330 for idx in batches)
    assert len(batches) == 9  # in table order, one batch at a time: 12
    unlimited = engine_plan.GpuLimits({gpu: 330 * MIB}, {gpu: 330 * MIB}, {gpu: 64 << 30})
    # not in blocks: batches cut once they reach the size, in table order
    assert len(engine_plan.save_batches(tensors, Policy.parse("auto"), unlimited)) == 8


def test_two_gpu_batches_are_coded_at_once_only_where_every_budget_holds_them_at_full_size() -> None:
    full = engine_plan.TWO_LANE_WORKING_SETS * engine_plan.SAVE_BATCH_BYTES["cuda"]
    ample, short = gpu_memory.Budget(torch.device("cuda", 0), full), gpu_memory.Budget(torch.device("cuda", 1), full - MIB)
    assert engine_plan.lanes([ample], 256 * MIB) == 2
    assert engine_plan.lanes([ample, short], 256 * MIB) == 1
    assert engine_plan.lanes([short], 256 * MIB) == 1  # small batches (host snapshots) on a filled GPU: one lane
    assert engine_plan.lanes([ample], 2 * engine_plan.SAVE_BATCH_BYTES["cuda"]) == 1  # larger batches need more
    assert engine_plan.lanes([], 256 * MIB) == 1  # no GPU batch


@gpu
@needs_cuda
def test_two_lanes_write_the_file_one_lane_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: set[str] = set()
    real, of = engine_pipeline.start_batch, engine_plan.GpuLimits.of

    def spy(*args: object, **kwargs: object) -> object:
        threads.add(threading.current_thread().name.split("_")[0])
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_pipeline, "start_batch", spy)
    monkeypatch.setattr(engine_plan.GpuLimits, "of",  # 32 MiB batches: many of them
                        classmethod(lambda cls, tensors, policy, gpu_memory, batch_cap=None: of(tensors, policy, gpu_memory,
                                                                                               32 * MIB)))
    state = _state(n=12)
    two = io.BytesIO()
    ckptzip.save(state, two)
    assert "ckptzip-lane" in threads
    monkeypatch.setattr(engine_plan, "lanes", lambda budgets, batch_cap: 1)
    one = io.BytesIO()
    ckptzip.save(state, one)
    assert one.getvalue() == two.getvalue()
    assert_same(ckptzip.load(two.getvalue()), state)


@gpu
@needs_cuda
def test_two_lanes_decode_many_gpu_batches_bit_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state(n=12)
    buf = io.BytesIO()
    ckptzip.save(state, buf)
    threads: set[str] = set()
    real = engine_reader.decode_batch

    def spy(*args: object, **kwargs: object) -> object:
        threads.add(threading.current_thread().name.split("_")[0])
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_reader, "decode_batch", spy)
    monkeypatch.setattr(engine_plan, "LOAD_BATCH_BYTES", {**engine_plan.LOAD_BATCH_BYTES, "cuda": 16 * MIB})
    assert_same(ckptzip.load(buf.getvalue()), state)
    assert "ckptzip-lane" in threads


@gpu
@needs_cuda
def test_save_and_load_work_with_the_gpu_filled_to_one_gib() -> None:
    state = _state(n=12, elements=1 << 24)  # 12 x 64 MiB of fp32 beside a bf16 tensor
    buf = io.BytesIO()
    filler = _fill(1 << 30)
    try:
        ckptzip.save(state, buf)
    finally:
        del filler
    saved = {k: v.cpu() for k, v in state.items()}
    state.clear()
    torch.cuda.empty_cache()
    size = sum(t.nbytes for t in saved.values())
    filler = _fill(size + (1 << 30))  # a load: room for the tensors it returns, and 1 GiB
    try:
        loaded = ckptzip.load(buf.getvalue())
    finally:
        del filler
    assert_same({k: v.cpu() for k, v in loaded.items()}, saved)


@gpu
@needs_cuda
def test_a_save_on_a_filled_gpu_codes_every_batch_at_its_planned_size(caplog: pytest.LogCaptureFixture) -> None:
    """Batches carved from torch's cache on a filled GPU left its free bytes in pieces: on an H200
    with 2 GiB free, batches of a 15 GB state ran out of memory with 0.6-1 GiB cached unused, and
    this state's save raised GpuMemoryError. Their buffers are now blocks of one size."""
    g = torch.Generator(device="cuda").manual_seed(5)
    state: dict[str, torch.Tensor] = {}
    for i, rows in enumerate((4096, 11008, 4096, 2048, 11008, 4096) * 3):
        state[f"w{i}"] = torch.randn(rows, 2048, generator=g, device="cuda") * 0.02
        state[f"g{i}"] = (torch.randn(rows, 2048, generator=g, device="cuda") * 1e-3).bfloat16()
    filler = _fill(768 * MIB)
    buf = io.BytesIO()
    try:
        with caplog.at_level(logging.INFO, logger="ckptzip"):
            for _ in range(3):
                buf = io.BytesIO()
                ckptzip.save(state, buf)
    finally:
        del filler
    assert not [r.getMessage() for r in caplog.records if "ran out of memory" in r.getMessage()]
    assert_same(ckptzip.load(buf.getvalue()), state)


@gpu
@needs_cuda
def test_a_codec_whose_scratch_does_not_fit_codes_on_the_host(caplog: pytest.LogCaptureFixture) -> None:
    """nvCOMP's zstd (``portable`` on a GPU) asks about 1 GiB of scratch whatever it codes: with
    less than that to be had, a save raised GpuMemoryError; its tensors are now coded on the host."""
    from ckptzip.engine.policy import Policy

    scratch = Policy.parse("portable").gpu_scratch_bytes()
    assert scratch > 256 * MIB
    state = _state(n=4)
    filler = _fill(scratch // 2)
    buf = io.BytesIO()
    try:
        with caplog.at_level(logging.INFO, logger="ckptzip"):
            ckptzip.save(state, buf, codec="portable")
        loaded = ckptzip.load(buf.getvalue())  # decoded on the GPU, in launches whose scratch fits
    finally:
        del filler
    assert any("coding the tensors of cuda:0 on the host: codec portable needs" in r.getMessage()
               for r in caplog.records)
    assert_same(loaded, state)


@gpu
@needs_cuda
def test_reserved_memory_does_not_grow_with_saves_and_loads() -> None:
    state = _state()
    buf = io.BytesIO()
    ckptzip.save(state, buf)
    data = buf.getvalue()
    loaded = ckptzip.load(data)  # its outputs, once freed, stay in torch's cache for the next load
    del loaded
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    for _ in range(5):
        ckptzip.save(state, io.BytesIO())
        loaded = ckptzip.load(data)
        del loaded
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() <= before + 64 * MIB


@gpu
@needs_cuda
def test_below_the_minimum_a_save_raises_and_leaves_the_previous_file(tmp_path: object) -> None:
    import pathlib

    path = pathlib.Path(str(tmp_path)) / "c.ckz"
    state = _state(n=2)
    ckptzip.save(state, path)
    before = path.read_bytes()
    filler = _fill(64 * MIB)
    try:
        with pytest.raises(ckptzip.GpuMemoryError, match=r"save on cuda:0 needs at least 256 MiB"):
            ckptzip.save({k: v * 2 for k, v in list(state.items())[:1]}, path)
    finally:
        del filler
    assert path.read_bytes() == before


@gpu
@needs_cuda
def test_a_small_cap_codes_large_tensors_in_ranges_on_the_gpu_and_stays_bit_exact() -> None:
    state = _state(n=3, elements=1 << 26)  # 256 MiB tensors, over a sixth of a 256 MiB budget
    buf = io.BytesIO()
    ckptzip.save(state, buf, gpu_memory=256 * MIB)
    with ckptzip.open(buf.getvalue()) as reader:
        entries = {e.name: e for e in reader.entries()}
    for i in range(3):
        streams = entries[f"w{i}"].streams
        assert len(streams) == 4 and "gdeflate" in {s.codec["id"] for s in streams}  # byte planes, coded by nvCOMP
        # the sign/exponent plane: 64 MiB from 2 ranges, in gdeflate's chunks for small batches (128 KiB)
        assert {c.raw_length for c in streams[3].chunks} == {128 << 10} and len(streams[3].chunks) == 512
    assert_same(ckptzip.load(buf.getvalue(), gpu_memory=256 * MIB), state)
    whole = io.BytesIO()
    ckptzip.save(state, whole)  # unconstrained: whole-tensor batches, the same table
    with ckptzip.open(whole.getvalue()) as reader:
        assert [(e.name, e.checksum, [s.codec for s in e.streams]) for e in reader.entries()] == [
            (e.name, e.checksum, [s.codec for s in e.streams]) for e in entries.values()]


@gpu
@needs_cuda
def test_a_batch_that_runs_out_of_memory_is_encoded_in_halves(monkeypatch: pytest.MonkeyPatch) -> None:
    real = engine_pipeline.start_batch
    sizes: list[int] = []

    def flaky(tensors: list[torch.Tensor], policy: object, backend: str, sparse: object = None,
              entropies: object = None) -> object:
        sizes.append(len(tensors))
        if backend == "cuda" and len(tensors) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return real(tensors, policy, backend, sparse, entropies)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_pipeline, "start_batch", flaky)
    state = _state(n=6)
    buf = io.BytesIO()
    ckptzip.save(state, buf)
    assert max(sizes) > 2 and sizes[-1] <= 2
    assert_same(ckptzip.load(buf.getvalue()), state)


@gpu
@needs_cuda
def test_a_filled_gpus_batches_read_their_entropies_ahead_and_finish_after_the_next_starts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    start, finish = engine_pipeline.start_batch, engine_pipeline.PendingBatch.finish

    def started(*args: object, **kwargs: object) -> object:
        events.append("start")
        return start(*args, **kwargs)  # type: ignore[arg-type]

    def finished(self: engine_pipeline.PendingBatch) -> object:
        events.append("finish")
        return finish(self)

    def no_wait(hist: torch.Tensor) -> object:
        raise AssertionError("a batch waited for its split's byte counts")

    monkeypatch.setattr(engine_pipeline, "start_batch", started)
    monkeypatch.setattr(engine_pipeline.PendingBatch, "finish", finished)
    monkeypatch.setattr(engine_encode, "_plane_entropies", no_wait)
    state = _state(n=8)  # 16 MiB tensors
    buf = io.BytesIO()
    ckptzip.save(state, buf, gpu_memory=640 * MIB)  # batches in blocks: a few tensors each
    assert events.count("start") > 2 and events[:3] == ["start", "start", "finish"]
    assert_same(ckptzip.load(buf.getvalue()), state)


@gpu
@needs_cuda
def test_a_gpu_without_room_to_sample_its_entropies_ahead_codes_its_batches_one_after_another(
        monkeypatch: pytest.MonkeyPatch) -> None:
    waited: list[int] = []
    wait = engine_encode._plane_entropies

    def scarce(*args: object) -> object:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")

    def counted(hist: torch.Tensor) -> object:
        waited.append(hist.shape[0])
        return wait(hist)

    monkeypatch.setattr(engine_pipeline, "sampled_plane_entropies", scarce)
    monkeypatch.setattr(engine_encode, "_plane_entropies", counted)
    state = _state(n=8)
    buf = io.BytesIO()
    ckptzip.save(state, buf, gpu_memory=640 * MIB)
    assert len(waited) > 1  # every batch waited for its split, none failed
    assert_same(ckptzip.load(buf.getvalue()), state)


@gpu
@needs_cuda
def test_a_started_batch_whose_finish_runs_out_of_memory_is_coded_smaller(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    finish = engine_pipeline.PendingBatch.finish
    failed: list[int] = []

    def scarce(self: engine_pipeline.PendingBatch) -> object:
        if not failed:
            failed.append(len(self.batch.transforms))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 96.00 MiB")
        return finish(self)

    monkeypatch.setattr(engine_pipeline.PendingBatch, "finish", scarce)
    state = _state(n=8)
    buf = io.BytesIO()
    with caplog.at_level(logging.INFO, logger="ckptzip"):
        ckptzip.save(state, buf, gpu_memory=640 * MIB)
    assert failed and failed[0] > 1
    assert len([r for r in caplog.records if "ran out of memory" in r.getMessage()]) == 1
    assert_same(ckptzip.load(buf.getvalue()), state)


@gpu
@needs_cuda
def test_a_lone_tensor_that_runs_out_of_memory_is_coded_in_ranges_and_later_batches_are_split_first(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    real = engine_pipeline.start_batch
    tried: list[int] = []

    def scarce(tensors: list[torch.Tensor], policy: object, backend: str, sparse: object = None,
               entropies: object = None) -> object:
        nbytes = sum(t.nbytes for t in tensors)
        tried.append(nbytes)
        if backend == "cuda" and nbytes >= 64 * MIB:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 192.00 MiB")
        return real(tensors, policy, backend, sparse, entropies)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_pipeline, "start_batch", scarce)
    monkeypatch.setattr(engine_plan, "OVERLAP_WORKING_SETS", 7)  # batches of 130 MiB (a seventh): two tensors
    state = _state(n=4, elements=1 << 24)  # four 64 MiB fp32 tensors, each too large here
    buf = io.BytesIO()
    with caplog.at_level(logging.INFO, logger="ckptzip"):
        ckptzip.save(state, buf, gpu_memory=910 * MIB)
    # the first batch (w0, w1 and the 8-byte step, packed first fit) fails; its halves are coded
    # lazily, after the next batch (w2 and w3) is tried: 8 bytes smaller than the one that failed,
    # it fails too; then w0 alone; everything after is split before it is tried
    assert [n for n in tried if n >= 64 * MIB] == [128 * MIB + 8, 128 * MIB, 64 * MIB]
    failures = [r for r in caplog.records if "ran out of memory" in r.getMessage()]
    assert len(failures) == 3
    with ckptzip.open(buf.getvalue()) as reader:
        for entry in reader.entries():
            if entry.name.startswith("w"):
                assert "gdeflate" in {s.codec["id"] for s in entry.streams}  # the GPU's plane codec, not the host's
    assert_same(ckptzip.load(buf.getvalue()), state)


@gpu
@needs_cuda
def test_the_manager_says_why_it_takes_host_snapshots(tmp_path: object, caplog: pytest.LogCaptureFixture) -> None:
    state = _state(n=8, elements=1 << 24)  # 512 MiB of fp32 and 32 MiB of bf16: 0.53 GiB
    filler = _fill(1536 * MIB)  # held through the save, as a training's peak would be
    try:
        with caplog.at_level(logging.WARNING, logger="ckptzip"), ckptzip.CheckpointManager(str(tmp_path)) as manager:
            _step_an_optimizer()  # the training's peak is known from here on
            manager.save(1, state)
            manager.wait()
            assert manager.last_snapshot == "host", (manager.last_snapshot_reason, torch.cuda.mem_get_info())
            assert "a device copy of the state needs 0.53 GiB on cuda:0 and its coding 2.00 GiB" in (
                manager.last_snapshot_reason or "")
    finally:
        del filler
    assert any("taking host snapshots" in r.getMessage() for r in caplog.records)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()  # the peak without the filler
    with ckptzip.CheckpointManager(str(tmp_path)) as manager:
        assert_same(manager.restore(), state)
        manager.save(2, state)
        manager.wait()
        assert manager.last_snapshot == "device", manager.last_snapshot_reason


def _step_an_optimizer() -> None:
    """One step of a torch optimizer, which a manager made before it takes as training having begun."""
    p = torch.nn.Parameter(torch.zeros(4, device="cuda"))
    p.grad = torch.ones(4, device="cuda")
    torch.optim.SGD([p], lr=0.1).step()


@gpu
@needs_cuda
def test_a_gpu_batch_of_empty_tensors_alone_encodes() -> None:
    # a batch halved after running out of memory can hold only empty tensors
    state = {"e": torch.empty(0, device="cuda"), "f": torch.empty(0, 3, device="cuda", dtype=torch.int64)}
    buf = io.BytesIO()
    ckptzip.save(state, buf)
    assert_same(ckptzip.load(buf.getvalue()), state)


def test_a_load_that_runs_out_of_gpu_memory_tries_smaller_batches_then_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:

    buf = io.BytesIO()
    ckptzip.save({"w": torch.randn(1000)}, buf)
    real = engine_reader._read_stored
    tried: list[int] = []

    def scarce(*args: object, shrink: int = 1, **kwargs: object) -> object:
        tried.append(shrink)
        if shrink < 16:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args, shrink=shrink, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_reader, "_read_stored", scarce)
    assert torch.equal(ckptzip.load(buf.getvalue())["w"], ckptzip.load(buf.getvalue())["w"])
    assert tried[:3] == [1, 4, 16]

    def never(*args: object, **kwargs: object) -> object:
        raise RuntimeError("nvCOMP: out of memory")

    monkeypatch.setattr(engine_reader, "_read_stored", never)
    with pytest.raises(ckptzip.GpuMemoryError, match=r"load ran out of GPU memory even in batches 16 times smaller "
                                                      r"\(nvCOMP: out of memory\)"):
        ckptzip.load(buf.getvalue())


def test_a_load_retry_reuses_the_outputs_of_the_attempt_that_ran_out_of_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Allocated afresh per attempt, a retry's outputs met the failed attempt's still held (on the
    H200 a 1 GiB-free load failed its retries allocating a 500 MiB output)."""

    state = {"w": torch.randn(1000), "b": torch.arange(7, dtype=torch.int64)}
    buf = io.BytesIO()
    ckptzip.save(state, buf)
    real = engine_reader._read_stored
    outputs: list[list[int]] = []

    def scarce(reader: object, targets: list[Any], *args: object, shrink: int = 1, **kwargs: object) -> object:
        outputs.append([t.out.data_ptr() for t in targets])
        if shrink < 16:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(reader, targets, *args, shrink=shrink, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_reader, "_read_stored", scarce)
    assert_same(ckptzip.load(buf.getvalue()), state)
    assert len(outputs) == 3 and outputs[0] == outputs[1] == outputs[2]


def test_a_save_that_runs_out_of_gpu_memory_outside_its_batches_raises_gpu_memory_error(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    import pathlib

    path = pathlib.Path(str(tmp_path)) / "c.ckz"
    ckptzip.save({"w": torch.ones(10)}, path)
    before = path.read_bytes()

    def scarce(*args: object, **kwargs: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")

    monkeypatch.setattr(engine_writer, "encode_all", scarce)
    with pytest.raises(ckptzip.GpuMemoryError, match=r"save ran out of GPU memory \(CUDA out of memory. Tried to "
                                                      r"allocate 64.00 MiB\); no GPU budget can be had now"):
        ckptzip.save({"w": torch.zeros(10)}, path)
    assert path.read_bytes() == before


@gpu
@needs_cuda
def test_prepare_reserves_host_staging_before_the_first_save(tmp_path: object) -> None:
    state = _state(n=4)
    nbytes = sum(t.nbytes for t in state.values() if t.is_cuda)
    with ckptzip.CheckpointManager(str(tmp_path), snapshot="host") as manager:
        thread = manager._snapshots.reserve_host(list(state.values()))
        assert thread is not None
        thread.join()
        staging = manager._snapshots._staging
        raw = sum(b.numel() for b in manager._snapshots._buffers._free.get((torch.device("cpu"), True), []))
        assert raw > 0  # the pinned buffer of the share copied raw
        assert staging._created * staging.buffer_bytes + raw >= nbytes
        manager.save(1, state)
        manager.wait()
        assert_same(manager.restore(), state)


def test_tensors_decoded_on_a_gpu_for_the_host_are_read_in_rounds_that_fit(monkeypatch: pytest.MonkeyPatch) -> None:

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(gpu_memory, "budget", lambda device, cap, what: gpu_memory.Budget(device, 1000))
    nbytes = [300, 300, 50, 400, 100]
    devices = [cpu, cpu, gpu, cpu, cpu]
    works = [gpu] * 5  # GPU-only codecs: every entry decodes on the GPU
    assert engine_reader._rounds(devices, works, nbytes, None) == [[2, 0], [1], [3, 4]]
    assert engine_reader._rounds([gpu], [gpu], nbytes[:1], None) == [[0]]


@gpu
@needs_cuda
def test_a_gpu_load_that_fails_midway_gives_every_pinned_buffer_back_and_its_retry_completes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads in flight when a load attempt failed kept their pinned buffers: after a few failed
    attempts the pool was empty and the retry waited for a buffer forever (the H200's 1 GiB-free
    loads, through ckptzip.load and DCP, hung there)."""
    from ckptzip.memory.pinned import pinned_pool

    state = {f"w{i}": torch.randn(1 << 20, device="cuda") for i in range(96)}
    buf = io.BytesIO()
    ckptzip.save(state, buf)
    data = buf.getvalue()
    real = engine_reader.decode_batch
    calls = {"n": 0}

    def failing(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] in (2, 5):  # once in each of the first two attempts
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 500.00 MiB")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_reader, "decode_batch", failing)
    monkeypatch.setattr(engine_plan, "LOAD_BATCH_BYTES", {"cuda": 8 << 20, "cpu": 8 << 20})
    assert_same(ckptzip.load(data, gpu_memory=1 << 30), state)
    pool = pinned_pool()
    assert pool._free.qsize() == pool._created


def test_read_tensors_decodes_into_given_tensors_where_they_fit() -> None:
    from ckptzip.engine.reader import read_tensors
    from ckptzip.format import ContainerReader

    state = {"w": torch.randn(300), "i": torch.arange(10, dtype=torch.int32), "h": torch.randn(5).half()}
    buf = io.BytesIO()
    ckptzip.save(state, buf)
    reader = ContainerReader(io.BytesIO(buf.getvalue()))
    names = [e.name for e in reader.tensors]
    into = {"w": torch.empty(300), "i": torch.empty(10, dtype=torch.int64), "h": torch.empty(5, dtype=torch.half)}
    indices = list(range(len(names)))
    got = read_tensors(reader, indices, [torch.device("cpu")] * len(names), into=[into[n] for n in names])
    for name, value in zip(names, got):
        assert_same_tensor(value, state[name])
        # the right dtype and size: decoded in place; int64 for an int32 entry: a new tensor
        assert (value.data_ptr() == into[name].data_ptr()) == (name != "i")
