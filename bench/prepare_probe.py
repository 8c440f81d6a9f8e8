"""What a manager's ``prepare()`` costs the training around it, by how its pinned memory is
registered (issue 43: the first interval of the training-loop bench).

The training-loop bench's model (``--config``; :mod:`ckptzip_bench.training_loop`) trains; after
warm steps, the median of ``--base-steps`` synced steps is the base. Then each variant in turn
(``--rounds`` rounds, variants interleaved) runs one interval as a training script's first: a
fresh ``CheckpointManager()`` with its defaults, ``prepare(state)`` (how long it took to return:
*prepare*, before the interval as in the training-loop bench), ``--steps`` steps beside its
reservation, one ``save`` (which waits for a reservation still running), and after the interval
the wait for the write and ``close()``. *Lost*: the interval's wall time less ``--steps`` base
steps. CUDA events after each step give the GPU's time from one step's end to the next, so a
stall shows where it fell (*worst step*: the longest, against the base). The reservation's own
time comes from ckptzip's debug log. Variants set how slabs are registered
(``ckptzip.memory.pinned.REGISTER_BYTES`` and ``PACE``), how their pages are faulted in, and
whether ``prepare()`` starts the coding child:

    none               no prepare(): the first save reserves while it blocks
    whole              one registration a slab, no rest (ckptzip before pieces)
    64m                64 MiB pieces, no rest
    64m-paced          64 MiB pieces, resting as long as each took (the default)
    64m-paced-serial   as 64m-paced, but each piece is faulted in (memset on the registering thread)
                       just before its registration, not every slab's pages at once on torch's
                       thread pool: the rest covers both
    64m-paced-nochild  as 64m-paced, but prepare() starts no coding child (the save's write does)
    16m-paced          16 MiB pieces, resting as long as each took

Each row also places the stall in time, in seconds from the interval's start (negative: before
it, in ``prepare()``): ``spans``, the reservation's parts ([label, start, end], end null while
one still ran: *fault-in*, a slab's pages faulted in on torch's pool, in 64m-paced-serial its
mapping alone; *slab*, a slab made, its fault-in and registration; *child-start*, the coding
child started; *warm-up*, the kernels compiled, only in the process's first manager);
``late_wakes``, the 8 longest delays over 20 ms of a thread that sleeps 2 ms at a time (when it
was due, how late: the GIL held by another thread, or no CPU free); ``gpu_step_ends``, each
step's end on the GPU; ``worst_step``, the longest step's GPU window, when its ``trainer.step()``
returned on the CPU, and the spans that overlapped the window.

    python bench/prepare_probe.py --config h100 --steps 25 --rounds 3 --json prepare.json
    python bench/prepare_probe.py --config h100 --steps 25 --rounds 2 \\
        --variants 64m-paced,64m-paced-serial,64m-paced-nochild --json causes.json
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import json
import logging
import re
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import ckptzip
import ckptzip.engine.warmup as engine_warmup
from ckptzip.manager._coding import CodingProcess
from ckptzip.memory import pinned
from ckptzip_bench.training_loop import Trainer, pick_config, step_times, sync

MIB = 1 << 20


@dataclass(frozen=True)
class Variant:
    """How ``prepare()`` reserves: slabs registered ``piece`` bytes at a time, resting ``pace``
    per second of each registration; ``prepares``: whether ``prepare()`` is called at all;
    ``serial_fault_in``: each piece faulted in on the registering thread just before its
    registration (:class:`FaultingCudart`); ``starts_child``: whether ``prepare()`` starts the
    coding child."""

    piece: int
    pace: float
    prepares: bool = True
    serial_fault_in: bool = False
    starts_child: bool = True


VARIANTS: dict[str, Variant] = {
    "none": Variant(64 * MIB, 1.0, prepares=False),
    "whole": Variant(1 << 62, 0.0),
    "64m": Variant(64 * MIB, 0.0),
    "64m-paced": Variant(64 * MIB, 1.0),
    "64m-paced-serial": Variant(64 * MIB, 1.0, serial_fault_in=True),
    "64m-paced-nochild": Variant(64 * MIB, 1.0, starts_child=False),
    "16m-paced": Variant(16 * MIB, 1.0),
}
# the calls a timeline times: label, what the caller looks the callable up on at each call, its name there
TIMED: tuple[tuple[str, object, str], ...] = (
    ("fault-in", pinned, "_fresh_memory"),  # a module global of Slab.__init__
    ("slab", pinned.Slab, "__init__"),
    ("child-start", CodingProcess, "start"),
    ("warm-up", engine_warmup, "compile_kernels"),  # a module global of warm_up's thread
)
# the late-wake thread's sleep, and the delay past it that it notes
WAKE_SLEEP_S = 0.002
WAKE_LATE_S = 0.02
_RESERVED = re.compile(r"reserved ([\d.]+) GiB of pinned host memory in ([\d.]+) s")


class Reservations(logging.Handler):
    """ckptzip's debug lines that say what ``prepare()`` reserved and how long it took."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[tuple[float, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        found = _RESERVED.search(record.getMessage())
        if found:
            self.seen.append((float(found.group(1)), float(found.group(2))))


@contextlib.contextmanager
def patched(owner: object, name: str, value: object) -> Iterator[None]:
    """``owner.name`` set to ``value`` until exit (then what it was)."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


class FaultingCudart:
    """CUDA's runtime as torch binds it, but ``cudaHostRegister`` first faults its range in on the
    calling thread (``ctypes.memset``, which releases the GIL): a slab's pages come in a piece at a
    time, each just before its registration, so a paced slab rests after both."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> Any:
        ctypes.memset(address, 0, nbytes)
        return self._real.cudaHostRegister(address, nbytes, flags)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _no_child(self: CodingProcess) -> None:
    """``CodingProcess.start`` in 64m-paced-nochild: nothing (the save's write starts the child)."""


@contextlib.contextmanager
def reserving(variant: Variant) -> Iterator[None]:
    """ckptzip's reservations made as ``variant`` says, until exit."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(pinned, "REGISTER_BYTES", variant.piece))
        stack.enter_context(patched(pinned, "PACE", variant.pace))
        if variant.serial_fault_in:
            cudart = pinned._cudart
            stack.enter_context(patched(pinned, "_fresh_memory", pinned._mapped))
            stack.enter_context(patched(pinned, "_cudart", lambda: FaultingCudart(cudart())))
        if not variant.starts_child:
            stack.enter_context(patched(CodingProcess, "start", _no_child))
        yield


@dataclass
class Span:
    label: str
    start: float  # perf_counter's seconds
    end: float | None = None  # None while the call runs


class Timeline:
    """The calls of :data:`TIMED` made while :meth:`timing` (any thread), as spans."""

    def __init__(self) -> None:
        self.spans: list[Span] = []

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        """Time the calls of :data:`TIMED` (wrapping what they are now: a variant's stand-ins too) until exit."""
        with contextlib.ExitStack() as stack:
            for label, owner, name in TIMED:
                stack.enter_context(patched(owner, name, self._timed(label, getattr(owner, name))))
            yield

    def _timed(self, label: str, call: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(call)
        def timed(*args: Any, **kwargs: Any) -> Any:
            span = Span(label, time.perf_counter())
            self.spans.append(span)
            try:
                return call(*args, **kwargs)
            finally:
                span.end = time.perf_counter()

        return timed

    def since(self, origin: float) -> list[list[Any]]:
        """``[label, start, end]`` of each span, in seconds from ``origin`` (end None: still running)."""
        return [[s.label, round(s.start - origin, 3), None if s.end is None else round(s.end - origin, 3)]
                for s in self.spans]


class LateWakes:
    """A thread that sleeps :data:`WAKE_SLEEP_S` at a time while :meth:`running` and notes each
    wake more than :data:`WAKE_LATE_S` late (when it was due, in perf_counter's seconds, and how
    late): a thread that cannot run so long had no GIL or no CPU."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, float]] = []
        self._stop = threading.Event()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        thread = threading.Thread(target=self._watch, name="probe-late-wakes", daemon=True)
        thread.start()
        try:
            yield
        finally:
            self._stop.set()
            thread.join()

    def _watch(self) -> None:
        while not self._stop.is_set():
            due = time.perf_counter() + WAKE_SLEEP_S
            time.sleep(WAKE_SLEEP_S)
            late = time.perf_counter() - due
            if late > WAKE_LATE_S:
                self.seen.append((due, late))

    def worst(self, origin: float, n: int = 8) -> list[list[float]]:
        """The ``n`` longest delays as ``[due, lateness]`` (due in seconds from ``origin``), in time order."""
        worst = sorted(self.seen, key=lambda seen: seen[1], reverse=True)[:n]
        return [[round(due - origin, 3), round(late, 3)] for due, late in sorted(worst)]


def worst_step(gpu_ends: list[float], returned: list[float], spans: list[list[Any]]) -> dict[str, Any]:
    """The longest step: its GPU window (from the previous step's end), when its ``trainer.step()``
    returned on the CPU, and the labels of the spans that overlapped the window (all on one clock)."""
    starts = [0.0, *gpu_ends[:-1]]
    i = max(range(len(gpu_ends)), key=lambda j: gpu_ends[j] - starts[j])
    during = [label for label, start, end in spans if start < gpu_ends[i] and (end is None or end > starts[i])]
    return {"index": i, "gpu_from": round(starts[i], 3), "gpu_to": round(gpu_ends[i], 3),
            "cpu_returned": round(returned[i], 3), "spans": "+".join(dict.fromkeys(during)) or "none"}


def first_interval(trainer: Trainer, variant: str, steps: int, base: float, root: Path) -> dict[str, Any]:
    how = VARIANTS[variant]
    device = trainer.device
    directory = Path(tempfile.mkdtemp(prefix=f"prepare-{variant}-", dir=root))
    log = Reservations()
    logger = logging.getLogger("ckptzip")
    logger.addHandler(log)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    timeline, wakes = Timeline(), LateWakes()
    try:
        # the timeline wraps the variant's stand-ins, and both are in place before the manager starts its warm-up
        with reserving(how), timeline.timing():
            manager = ckptzip.CheckpointManager(directory, keep_last=1)
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
            returned: list[float] = []
            sync(device)
            with wakes.running():
                began = time.perf_counter()
                if how.prepares:  # before the interval, as a training script calls it before its loop
                    manager.prepare(trainer.state())
                prepared = time.perf_counter() - began
                # the GPU is idle here (synced above, and prepare() queues no GPU work; only the process's first
                # manager's warm-up may), so ends[0] runs at once: steps' ends from it are on the interval's clock
                started = time.perf_counter()
                ends[0].record()
                for i in range(steps):
                    trainer.step()
                    returned.append(time.perf_counter() - started)
                    ends[i + 1].record()
                saving = time.perf_counter()
                future = manager.save(steps, trainer.state())
                blocked = time.perf_counter() - saving
                sync(device)
                interval = time.perf_counter() - started
            waited = time.perf_counter()
            future.result()
            write = time.perf_counter() - waited
            manager.close()
            gpu_ends = [ends[0].elapsed_time(end) / 1e3 for end in ends[1:]]
    finally:
        logger.removeHandler(log)
        logger.setLevel(level)
        shutil.rmtree(directory, ignore_errors=True)
    del manager
    gc.collect()
    gaps = [b - a for a, b in zip([0.0, *gpu_ends[:-1]], gpu_ends)]
    spans = timeline.since(started)
    return {"variant": variant, "prepare_s": round(prepared, 3), "lost_s": round(interval - steps * base, 3),
            "save_blocked_s": round(blocked, 3),
            "worst_step_s": round(max(gaps), 3), "steps_over_base_s": round(sum(g - base for g in gaps), 3),
            "reserved_gib": log.seen[0][0] if log.seen else None,
            "reservation_s": log.seen[0][1] if log.seen else None, "write_after_s": round(write, 2),
            "worst_step": worst_step(gpu_ends, returned, spans), "gpu_step_ends": [round(t, 3) for t in gpu_ends],
            "spans": spans, "late_wakes": wakes.worst(started)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="auto")
    p.add_argument("--steps", type=int, default=25, help="steps of the interval (the bench's long interval: 25)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--warm-steps", type=int, default=5)
    p.add_argument("--base-steps", type=int, default=10)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints are written")
    p.add_argument("--json", help="write every row here")
    args = p.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    if not torch.cuda.is_available():
        raise SystemExit("prepare_probe.py needs a CUDA device")
    device = torch.device("cuda")
    trainer = Trainer(pick_config(args.config), device)
    for _ in range(args.warm_steps):
        trainer.step()
    base_steps = step_times(trainer, args.base_steps)
    base = statistics.median(base_steps)
    rows: list[dict[str, Any]] = [{"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
                                   "parameters": trainer.parameters(), "step_s": round(base, 4)}]
    print(json.dumps(rows[0]), flush=True)
    for round_number in range(1, args.rounds + 1):
        for variant in variants:
            row = first_interval(trainer, variant, args.steps, base, Path(args.dir))
            row["round"] = round_number
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    keys = ("prepare_s", "lost_s", "save_blocked_s", "worst_step_s", "steps_over_base_s", "reservation_s")
    print("\n| variant | " + " | ".join(keys) + " | (medians of the rounds after the first; round 1 apart) "
          "| worst step of the last round: GPU window (s), spans over it |")
    print("|---|" + "---|" * (len(keys) + 2))
    for variant in variants:
        mine = [r for r in rows[1:] if r["variant"] == variant]
        later = mine[1:] or mine
        cells = []
        for key in keys:
            values = [r[key] for r in later if r[key] is not None]
            cells.append(f"{statistics.median(values):.3f}" if values else "–")
        last = mine[-1]["worst_step"]
        print(f"| {variant} | " + " | ".join(cells) + f" | round 1: lost {mine[0]['lost_s']} "
              f"| #{last['index']} {last['gpu_from']}–{last['gpu_to']}: {last['spans']} |")


if __name__ == "__main__":
    main()
