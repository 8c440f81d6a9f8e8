"""ckptzip and its peers inside a real training loop (issue 43), on one GPU.

A transformers Llama-style model sized to fill the GPU as training does (``--config``: the
activations that torch caches between steps are most of the GPU) trains with bf16 autocast and
fused AdamW on random tokens. Every N steps (``--every``: a short interval, where a write does not
end before the next save, and a long one, where it does) its state (the parameters, both AdamW
moments and the step counters, flat FQN keys) is checkpointed to ``--dir`` by each method in
turn, in one process, each after the same warm steps. Per method and interval:

- *lost* training time per checkpoint: each interval's wall time (its steps, the save, the waits
  it caused) less its steps at the median step time of training without checkpoints, measured
  in the same process before and after the methods; the first checkpoint apart, the median of
  the others, and the wait for the last write at the end; the method ``none`` (no checkpoint,
  the same loop) is the control: what it "loses" is the measure's own bias (the base steps end in
  a synchronisation each, the loop's steps do not), which the medians' table takes off the others;
- how long ``save`` blocked, and ``prepare()`` once before the loop (a manager's); GPU memory
  (torch's peak reserved and allocated) and the process's host RSS (with the children the method
  starts: torch_checkpointing and ckptzip's manager code or write in processes of their own),
  summed and with the shared memory they all map counted once (:class:`HostRss`);
- with ``--verify``, once per method: a checkpoint taken while training goes on, its bytes on disk,
  and its restore into a fresh process (time onto the GPU, every tensor compared by digest with
  the state when it was saved).

Every method's GPU work must leave training its memory: an out-of-memory error anywhere is a
result (``oom``), not a crash of the benchmark.

    ckptzip bench training-loop --config auto --every 10,30 --checkpoints 3 --runs 3 --dir /tmp/ckpt --verify
    python -m ckptzip_bench.training_loop ...   (the same, from bench/ of a checkout)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

GIB = 1 << 30
RESULTS: list[dict[str, Any]] = []
_json_path: Path | None = None  # --json: rewritten after every row, so a run cut short keeps the rows it made


def report(**row: Any) -> None:
    RESULTS.append(row)
    print(json.dumps(row), flush=True)
    if _json_path is not None:
        partial = _json_path.with_name(_json_path.name + ".partial")
        partial.write_text(json.dumps(RESULTS, indent=1))
        partial.replace(_json_path)


# --------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class Config:
    """A Llama-style model and batch: sized so that training fills the GPU named."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    vocab: int
    batch: int
    seq: int


CONFIGS = {
    "tiny": Config(hidden=64, layers=2, intermediate=128, heads=4, vocab=256, batch=2, seq=32),
    # 1.14 B parameters, 13.7 GB of state; training leaves about 16 GB of an H100's 80 GB free
    "h100": Config(hidden=2048, layers=20, intermediate=5504, heads=16, vocab=32000, batch=8, seq=2048),
    # 1.74 B parameters, 21 GB of state; its activations fill an H200's 141 GB as the h100 one does
    # an H100's, and two checkpoints of the largest peer (uncoded) still fit the machine's 64 GiB disk
    "h200": Config(hidden=2560, layers=20, intermediate=6912, heads=20, vocab=32000, batch=14, seq=2048),
}


def pick_config(name: str) -> Config:
    if name != "auto":
        return CONFIGS[name]
    if not torch.cuda.is_available():
        return CONFIGS["tiny"]
    total = torch.cuda.get_device_properties(0).total_memory
    return CONFIGS["h200"] if total > 100 * GIB else CONFIGS["h100"]


class Trainer:
    """The model, its fused AdamW, and one training step (bf16 autocast on a GPU)."""

    def __init__(self, config: Config, device: torch.device, seed: int = 0) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        self.device = device
        self.config = config
        llama = LlamaConfig(vocab_size=config.vocab, hidden_size=config.hidden, num_hidden_layers=config.layers,
                            intermediate_size=config.intermediate, num_attention_heads=config.heads,
                            num_key_value_heads=config.heads, max_position_embeddings=config.seq,
                            tie_word_embeddings=False)
        llama._attn_implementation = "sdpa"
        self.model: torch.nn.Module = LlamaForCausalLM(llama)
        torch.nn.Module.to(self.model, device)
        fused = device.type == "cuda"
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=fused)
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def step(self, before_update: Callable[[], object] = lambda: None) -> None:
        tokens = torch.randint(0, self.config.vocab, (self.config.batch, self.config.seq), device=self.device,
                               generator=self.generator)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            loss = self.model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        before_update()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state(self) -> dict[str, torch.Tensor]:
        """Parameters, AdamW moments and step counters, by flat FQN keys."""
        out = {f"model.{name}": p.detach() for name, p in self.model.named_parameters()}
        names = {id(p): name for name, p in self.model.named_parameters()}
        for p, st in self.optimizer.state.items():
            for key, value in st.items():
                out[f"optim.{names[id(p)]}.{key}"] = value
        return out

    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- measuring


class HostRss:
    """The peak resident memory of this process and of the children it starts from now on,
    sampled every 50 ms (the background processes an earlier method left running, DCP's
    checkpoint process or torch_checkpointing's writer, are not this method's): ``peak``, their
    RSS summed, and ``peak_once``, with shared memory counted once. A page of ``/dev/shm`` that
    the training's process and a child both map (a staging handed over without a copy) is in
    both processes' RSS, so the sum overstates what the host gives; their private pages
    (anonymous and file-backed) and the ``/dev/shm`` files they map, each file once, count it
    once."""

    def __init__(self) -> None:
        self.peak = self.peak_once = 0
        self._earlier = set(_children(os.getpid()))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def now(self) -> tuple[int, int]:
        """The processes' RSS summed, and with shared memory counted once, in bytes, now."""
        pids = [os.getpid(), *(c for c in _children(os.getpid()) if c not in self._earlier)]
        rss = private = 0
        for pid in pids:
            status = _status_kib(pid, ("VmRSS", "RssAnon", "RssFile"))
            rss += status.get("VmRSS", 0) << 10
            private += (status.get("RssAnon", 0) + status.get("RssFile", 0)) << 10
        return rss, private + _shared_mapped(pids)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self._sample()

    def _sample(self) -> None:
        rss, once = self.now()
        self.peak, self.peak_once = max(self.peak, rss), max(self.peak_once, once)

    def stop(self) -> tuple[int, int]:
        """The peaks (``peak``, ``peak_once``), in bytes, once sampling has ended."""
        self._stop.set()
        self._thread.join()
        self._sample()
        return self.peak, self.peak_once


def _status_kib(pid: int, fields: tuple[str, ...]) -> dict[str, int]:
    """Fields of ``/proc/<pid>/status`` given in kB (none of a process that has ended)."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in fields:
                out[name] = int(value.split()[0])
    return out


def _shared_mapped(pids: list[int]) -> int:
    """Bytes of the ``/dev/shm`` files (unlinked ones included) that ``pids`` map, each file once,
    by its device and inode, at the largest extent mapped: shared memory that other processes
    of the host make or free does not count."""
    extents: dict[tuple[str, str], int] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                lines = [line for line in f.read().split("\n") if " /dev/shm/" in line]
        except OSError:  # it has ended
            continue
        for line in lines:  # "start-end perms offset device inode path"
            span, _, offset, dev, inode = line.split(maxsplit=5)[:5]
            start, end = span.split("-")
            key = (dev, inode)
            extents[key] = max(extents.get(key, 0), int(offset, 16) + int(end, 16) - int(start, 16))
    return sum(extents.values())


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
                for child in f.read().split():
                    out.append(int(child))
                    out.extend(_children(int(child)))
    return out


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else (
        path.stat().st_size if path.exists() else 0)


def digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """An XXH3-64 digest of every tensor's bytes (copied to the host a tensor at a time)."""
    import xxhash

    out = {}
    for name, t in sorted(state.items()):
        host = t.detach().reshape(-1).view(torch.uint8).cpu() if t.numel() else torch.empty(0, dtype=torch.uint8)
        out[name] = xxhash.xxh3_64_hexdigest(host.numpy().tobytes()) + f":{t.dtype}:{tuple(t.shape)}"
    return out


# --------------------------------------------------------------------------- the methods


@dataclass
class Method:
    """How one checkpointer saves, waits and restores inside the loop."""

    name: str
    save: Callable[[int, dict[str, torch.Tensor], Path], object]  # returns once training may go on
    finish: Callable[[], object] = lambda: None  # until every write is durable
    before_update: Callable[[], object] = lambda: None  # what the loop calls before optimizer.step()
    close: Callable[[], object] = lambda: None
    kind: str = ""  # how a fresh process restores its files (restore())
    path_of: Callable[[Path, int], Path] = lambda d, step: d / f"step_{step}"
    notes: dict[str, Any] = field(default_factory=dict)
    prepare: Callable[[dict[str, torch.Tensor]], object] = lambda state: None  # once, before the loop


def _fsync_save(state: dict[str, torch.Tensor], path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def make_method(name: str, directory: Path) -> Method:
    """The method called ``name``, writing under ``directory``."""
    if name == "none":  # the control: the loop without a checkpoint
        return Method(name, lambda step, state, d: None, path_of=lambda d, step: d / "none")
    if name == "torch.save":
        return Method(name, lambda step, state, d: _fsync_save(state, d / f"step_{step}.pt"), kind="torch",
                      path_of=lambda d, step: d / f"step_{step}.pt")
    if name == "ckptzip.save":
        import ckptzip

        return Method(name, lambda step, state, d: ckptzip.save(state, d / f"step_{step}.ckz"), kind="ckz",
                      path_of=lambda d, step: d / f"step_{step}.ckz")
    if name.startswith("ckptzip-manager"):
        return _manager_method(name, directory)
    if name in ("dcp-async", "dcp-async-pinned", "ckptzip-dcp-async", "ckptzip-dcp-async-process",
                "ckptzip-dcp-async-pinned"):
        return _dcp_method(name)
    if name in ("torch_checkpointing", "ckptzip-torch_checkpointing"):
        return _torch_checkpointing_method(name)
    raise ValueError(f"unknown method {name!r}")


MANAGER_VARIANTS: dict[str, dict[str, Any]] = {
    "ckptzip-manager": {},
    "ckptzip-manager-host": {"snapshot": "host"},
    "ckptzip-manager-device": {"snapshot": "device"},
    "ckptzip-manager-blocking": {"overlap": False},
    "ckptzip-manager-thread": {"host_coding": "thread"},
}


def _manager_method(name: str, directory: Path) -> Method:
    import ckptzip

    manager = ckptzip.CheckpointManager(directory, keep_last=2, **MANAGER_VARIANTS[name])
    method = Method(name, lambda step, state, d: manager.save(step, state), finish=manager.wait, close=manager.close,
                    kind="ckz", path_of=lambda d, step: d / f"step_{step:08d}.ckz", prepare=manager.prepare)

    def save(step: int, state: dict[str, torch.Tensor], d: Path) -> None:
        future = manager.save(step, state)
        note: dict[str, Any] = {"mode": manager.last_snapshot, "overlapped": manager.last_snapshot_overlapped,
                                "reason": manager.last_snapshot_reason}
        returned = time.perf_counter()
        # the background write's time, from save's return to its commit (fsync included)
        future.add_done_callback(lambda _: note.__setitem__("write_s", round(time.perf_counter() - returned, 3)))
        method.notes.setdefault("snapshots", []).append(note)

    method.save = save
    return method


def _dcp_method(name: str) -> Method:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, async_save

    pending: list[Any] = []
    staging: list[Any] = []
    stagers: list[Any] = []
    process = name in ("dcp-async-pinned", "ckptzip-dcp-async-process", "ckptzip-dcp-async-pinned")
    if process:
        _single_rank_group()

    def save(step: int, state: dict[str, torch.Tensor], d: Path) -> None:
        for f in pending:
            f.result()
        pending.clear()
        for stager in stagers:  # its save is written: its pinned memory goes
            stager.close()
        stagers.clear()
        path = d / f"step_{step}"
        kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
        stager = _pinned_stager(stagers) if name.endswith("-pinned") else None
        if name.startswith("ckptzip-"):  # the writer stages (GPU tensors coded on the GPU) unless a stager is given
            from ckptzip.dcp import CompressedStorageWriter

            result = async_save(state, storage_writer=CompressedStorageWriter(path), async_checkpointer_type=kind,
                                async_stager=stager)
        else:
            result = async_save(state, checkpoint_id=str(path), async_checkpointer_type=kind, async_stager=stager)
        upload = getattr(result, "upload_completion", result)
        staged = getattr(result, "staging_completion", None)
        pending.append(upload)
        if staged is not None:
            staging.append(staged)

    def before_update() -> None:
        for f in staging:
            f.result()
        staging.clear()

    def finish() -> None:
        before_update()
        for f in pending:
            f.result()
        pending.clear()

    def close() -> None:
        finish()
        for stager in stagers:
            stager.close()

    return Method(name, save, finish, before_update, close, kind="ckptzip-dcp" if name.startswith("ckptzip") else "dcp")


def _pinned_stager(stagers: list[Any]) -> Any:
    """The stager of torchtitan's ``async_with_pinned_mem`` (pinned, shared memory, staged on a
    thread of its own), a new one a save: torch 2.11's ``async_save`` leaves the stager it is
    given unusable for the next save (``KeyError: <class 'type'>``), so each save pins its own
    staging memory, as DCP does with a stager of its own."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stagers.append(DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=True,
                                                use_async_staging=True, use_non_blocking_copy=True)))
    return stagers[-1]


def _single_rank_group() -> None:
    """A default process group of this process alone: DCP's process-based async_save needs one."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def _torch_checkpointing_method(name: str) -> Method:
    """torch_checkpointing's manager, or ckptzip's in its place (``ckptzip-torch_checkpointing``:
    the state coded by ckptzip in ``save``, on the GPU for GPU state)."""
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    # O_DIRECT fails on the GPU machine's disk with torch.save's unaligned writes
    config = CheckpointManager.Config(storage_config=LocalFileSystemStorageConfig(use_direct_io=False))
    if name.startswith("ckptzip-"):
        from ckptzip.integrations.torch_checkpointing import CompressedCheckpointManager

        manager: Any = CompressedCheckpointManager(config)
    else:
        manager = config.build()
    pending: list[Any] = []
    lock = manager.lock()

    def save(step: int, state: dict[str, torch.Tensor], d: Path) -> None:
        for f in pending:
            f.result()
        pending.clear()
        future = manager.save(str(d / f"step_{step}"), {"train": state})
        if future is not None:
            pending.append(future)

    def before_update() -> None:
        with lock:  # no capture starts before the update: captures start in save(), on this thread
            pass

    def finish() -> None:
        for f in pending:
            f.result()
        pending.clear()

    def close() -> None:
        finish()
        manager.close()

    return Method(name, save, finish, before_update, close, kind="torch_checkpointing")


METHODS = ("none", "torch.save", "dcp-async", "dcp-async-pinned", "torch_checkpointing", "ckptzip.save",
           "ckptzip-dcp-async", "ckptzip-dcp-async-process", "ckptzip-dcp-async-pinned", "ckptzip-torch_checkpointing",
           "ckptzip-manager", "ckptzip-manager-host", "ckptzip-manager-device", "ckptzip-manager-blocking",
           "ckptzip-manager-thread")


# --------------------------------------------------------------------------- the loop


@contextlib.contextmanager
def _fresh(directory: Path) -> Iterator[Path]:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def step_times(trainer: Trainer, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        sync(trainer.device)
        t = time.perf_counter()
        trainer.step()
        sync(trainer.device)
        out.append(time.perf_counter() - t)
    return out


def run_method(trainer: Trainer, name: str, every: int, checkpoints: int, base: float, root: Path) -> dict[str, Any]:
    """Train ``every * (checkpoints + 1)`` steps, checkpointing after every ``every``-th of the first
    ``every * checkpoints``; the intervals' lost time against ``base`` seconds a step."""
    device = trainer.device
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    trainer.step()  # the training's peak is known again before the first save
    row: dict[str, Any] = {"method": name, "every": every, "checkpoints": checkpoints}
    with _fresh(root / name.replace(".", "_")) as directory:
        method = make_method(name, directory)
        t = time.perf_counter()
        method.prepare(trainer.state())  # as a training script does once its model and optimizer exist
        row["prepare_s"] = round(time.perf_counter() - t, 3)  # a one-time block, apart from the intervals
        rss = HostRss()
        blocked: list[float] = []
        intervals: list[float] = []
        try:
            sync(device)
            started = mark = time.perf_counter()
            for step in range(1, every * (checkpoints + 1) + 1):
                trainer.step(method.before_update)
                if step % every == 0 and step <= every * checkpoints:
                    t = time.perf_counter()
                    method.save(step, trainer.state(), directory)
                    blocked.append(time.perf_counter() - t)
                    now = time.perf_counter()
                    intervals.append(now - mark)
                    mark = now
            sync(device)
            tail = time.perf_counter()
            method.finish()
            end_wait = time.perf_counter() - tail
            sync(device)
            wall = time.perf_counter() - started
        except torch.OutOfMemoryError as exc:
            row["oom"] = str(exc).splitlines()[0]
            return row
        finally:
            with contextlib.suppress(Exception):
                method.close()
            peak, once = rss.stop()
            row.update(host_rss_gb=round(peak / 1e9, 2), host_memory_gb=round(once / 1e9, 2))
        steps = every * (checkpoints + 1)
        lost = [t - every * base for t in intervals]
        row.update(
            blocked_first_s=round(blocked[0], 3), blocked_median_s=round(statistics.median(blocked[1:] or blocked), 3),
            lost_first_s=round(lost[0], 3), lost_median_s=round(statistics.median(lost[1:] or lost), 3),
            end_wait_s=round(end_wait, 3),
            lost_per_checkpoint_s=round((wall - steps * base) / checkpoints, 3),
            # from the first save's return on: what each checkpoint costs once the job's one-time
            # work (a manager's prepare(), first calls) is behind it, reported apart as first calls are
            lost_after_first_s=round((wall - intervals[0] - (steps - every) * base) / checkpoints, 3),
            bytes_last=du(method.path_of(directory, every * checkpoints)), notes=method.notes)
    if device.type == "cuda":
        row.update(gpu_peak_reserved_gb=round(torch.cuda.max_memory_reserved(device) / 1e9, 2),
                   gpu_peak_allocated_gb=round(torch.cuda.max_memory_allocated(device) / 1e9, 2))
    return row


@dataclass
class Taken:
    """A checkpoint taken while training went on, to restore in a fresh process later."""

    method: str
    kind: str
    path: Path
    spec: Path
    directory: Path


def take_verified(trainer: Trainer, name: str, root: Path) -> Taken:
    """One checkpoint of ``name`` taken while training goes on (two steps after it), with the
    digests of the state when it was saved."""
    directory = root / ("verify-" + name.replace(".", "_"))
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    method = make_method(name, directory)
    try:
        trainer.step(method.before_update)
        expected = digests(trainer.state())
        method.save(1, trainer.state(), directory)
        for _ in range(2):
            trainer.step(method.before_update)
        method.finish()
    finally:
        method.close()
    shapes = {k: [str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in trainer.state().items()}
    spec = directory / "expected.json"
    spec.write_text(json.dumps({"digests": expected, "shapes": shapes}))
    return Taken(name, method.kind, method.path_of(directory, 1), spec, directory)


def restore_verified(taken: Taken, config: str) -> dict[str, Any]:
    """``taken`` restored onto the GPU in a fresh process (the GPU free of the training), its
    tensors compared by digest with the state it saved."""
    row: dict[str, Any] = {"method": taken.method, "verify": True, "bytes": du(taken.path)}
    proc = subprocess.run([sys.executable, "-m", "ckptzip_bench.training_loop", "--restore", taken.kind,
                           "--path", str(taken.path), "--expected", str(taken.spec), "--config", config],
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    row.update(json.loads(lines[-1]) if lines else {"restore_error": (proc.stderr or proc.stdout)[-800:]})
    shutil.rmtree(taken.directory, ignore_errors=True)
    return row


def restore(kind: str, path: Path, spec: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A checkpoint of ``kind`` at ``path`` restored onto the GPU (``spec``: its tensors' shapes)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    template = {k: torch.empty(shape, dtype=getattr(torch, dtype), device=device) for k, (dtype, shape) in
                spec["shapes"].items()}
    if kind == "torch":
        return dict(torch.load(path, map_location=device, weights_only=True))
    if kind == "ckz":
        import ckptzip

        return dict(ckptzip.load(path, map_location=device))
    if kind in ("dcp", "ckptzip-dcp"):
        from torch.distributed.checkpoint.state_dict_loader import load

        if kind == "ckptzip-dcp":
            from ckptzip.dcp import CompressedStorageReader

            load(template, storage_reader=CompressedStorageReader(path))
        else:
            load(template, checkpoint_id=str(path))
        return template
    if kind == "torch_checkpointing":
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        manager = CheckpointManager.Config(storage_config=LocalFileSystemStorageConfig(use_direct_io=False)).build()
        try:
            loaded = manager.load(str(path), into={"train": template}, map_location=device)
        finally:
            manager.close()
        return dict(loaded["train"])
    raise ValueError(f"unknown kind {kind!r}")


def _restore_main(args: argparse.Namespace) -> int:
    spec = json.loads(Path(args.expected).read_text())
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")  # the context, not the restore
    t = time.perf_counter()
    state = restore(args.restore, Path(args.path), spec)
    sync(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    seconds = time.perf_counter() - t
    got = digests(state)
    wrong = sorted(k for k in spec["digests"] if got.get(k) != spec["digests"][k])
    print(json.dumps({"restore_s": round(seconds, 3), "bit_exact": not wrong and got.keys() == spec["digests"].keys(),
                      "wrong": wrong[:5]}), flush=True)
    return 0


# --------------------------------------------------------------------------- the run


def configure(p: argparse.ArgumentParser) -> None:
    """The training-loop benchmark's arguments (``ckptzip bench training-loop``, or this module run)."""
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--config", default="auto", choices=("auto", *CONFIGS), help="the model and batch")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--every", default="10,30", help="checkpoint intervals in steps, comma-separated")
    p.add_argument("--checkpoints", type=int, default=3, help="checkpoints per method and interval")
    p.add_argument("--runs", type=int, default=1,
                   help="runs of every method and interval, interleaved (run 1 of each, then run 2, ...)")
    p.add_argument("--warm-steps", type=int, default=3)
    p.add_argument("--base-steps", type=int, default=8, help="steps timed without checkpoints, before and after")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: the system temp dir)")
    p.add_argument("--verify", action="store_true", help="restore one checkpoint of each method in a fresh process")
    p.add_argument("--json", default=None, help="write every measurement here as a JSON list")
    p.add_argument("--restore", default=None, help=argparse.SUPPRESS)
    p.add_argument("--path", default=None, help=argparse.SUPPRESS)
    p.add_argument("--expected", default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    global _json_path
    if args.restore:
        return _restore_main(args)
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        print(f"ckptzip bench training-loop: error: unknown method(s) {', '.join(unknown)}", file=sys.stderr)
        return 2
    import tempfile

    root = Path(args.dir or tempfile.gettempdir()) / "ckptzip-training-loop"
    _json_path = Path(args.json) if args.json else None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = pick_config(args.config)
    trainer = Trainer(config, device)
    for _ in range(args.warm_steps):
        trainer.step()
    sync(device)
    state_bytes = sum(t.numel() * t.element_size() for t in trainer.state().values())
    info: dict[str, Any] = {"config": args.config if args.config != "auto" else next(k for k, v in CONFIGS.items()
                                                                                      if v == config),
                            "parameters": trainer.parameters(), "state_gb": round(state_bytes / 1e9, 2),
                            "torch": torch.__version__}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        info.update(gpu=torch.cuda.get_device_name(device), gpu_total_gb=round(total / 1e9, 1),
                    free_between_steps_gb=round(free / 1e9, 2),
                    free_at_peak_gb=round((total - torch.cuda.max_memory_reserved(device)
                                           - (total - free - torch.cuda.memory_reserved(device))) / 1e9, 2))
    before = step_times(trainer, args.base_steps)
    info["step_s"] = round(statistics.median(before), 4)
    report(**info)
    rows = []
    for run_number in range(1, args.runs + 1):
        for every in (int(x) for x in args.every.split(",") if x):
            for name in methods:
                try:
                    row = run_method(trainer, name, every, args.checkpoints, statistics.median(before), root)
                except Exception as exc:  # one method's failure is a result too
                    row = {"method": name, "every": every, "error": _failure(exc)}
                row["run"] = run_number
                report(**row)
                rows.append(row)
    after = step_times(trainer, args.base_steps)
    report(step_s_before=round(statistics.median(before), 4), step_s_after=round(statistics.median(after), 4))
    if args.verify:
        taken = []
        for name in (m for m in methods if m != "none"):  # the control has nothing to restore
            try:
                taken.append(take_verified(trainer, name, root))
            except Exception as exc:
                report(method=name, verify=True, error=_failure(exc))
        del trainer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        for t in taken:
            report(**restore_verified(t, args.config))
    print(table(rows))
    if args.runs > 1:
        print(medians(rows))
    return 0


def _failure(exc: BaseException) -> str:
    """An exception in a line, with where it was raised."""
    import traceback

    where = traceback.extract_tb(exc.__traceback__)[-3:]
    return f"{type(exc).__name__}: {str(exc)[:300]} at " + " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
                                                                  for f in reversed(where))


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| method | every | lost/ckpt s | after the 1st interval, /ckpt s | lost first s | lost median s | end wait s | "
            "blocked s | GPU peak reserved GB | host RSS GB | host memory, shared once, GB |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        if "error" in r or "oom" in r:
            lines.append(f"| {r['method']} | {r['every']} | {(r.get('oom') and 'OOM') or r.get('error')} |||||||||")
            continue
        lines.append(f"| {r['method']} | {r['every']} | {r['lost_per_checkpoint_s']} | {r['lost_after_first_s']} | "
                     f"{r['lost_first_s']} | "
                     f"{r['lost_median_s']} | {r['end_wait_s']} | {r['blocked_median_s']} | "
                     f"{r.get('gpu_peak_reserved_gb', '–')} | {r['host_rss_gb']} | {r['host_memory_gb']} |")
    return "\n".join(lines)


def medians(rows: list[dict[str, Any]]) -> str:
    """Per method and interval: the median over its runs of the lost time per checkpoint, that
    median less the control's (``none``, where it ran at that interval), each run's figure, and the
    runs that ran out of memory or failed."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["method"], r["every"]), []).append(r)

    def median_lost(runs: list[dict[str, Any]]) -> float | None:
        lost = [r["lost_per_checkpoint_s"] for r in runs if "lost_per_checkpoint_s" in r]
        return round(statistics.median(lost), 3) if lost else None

    lines = ["| method | every | lost/ckpt s, median | less the control's | each run | out of memory / failed |",
             "|" + "---|" * 6]
    for (method, every), runs in groups.items():
        median, control = median_lost(runs), median_lost(groups.get(("none", every), []))
        net = round(median - control, 3) if median is not None and control is not None and method != "none" else "–"
        each = ", ".join(str(r["lost_per_checkpoint_s"]) for r in runs if "lost_per_checkpoint_s" in r)
        bad = sum("lost_per_checkpoint_s" not in r for r in runs)
        lines.append(f"| {method} | {every} | {'–' if median is None else median} | {net} | {each} | "
                     f"{bad} of {len(runs)} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m ckptzip_bench.training_loop")
    configure(p)
    sys.exit(run(p.parse_args()))


if __name__ == "__main__":
    main()
