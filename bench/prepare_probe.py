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

    python bench/prepare_probe.py --config h100 --steps 25 --rounds 3 --json prepare.json
    python bench/prepare_probe.py --config h100 --steps 25 --rounds 2 \\
        --variants 64m-paced,64m-paced-serial,64m-paced-nochild --json causes.json
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import logging
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import ckptzip
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


def first_interval(trainer: Trainer, variant: str, steps: int, base: float, root: Path) -> dict[str, Any]:
    how = VARIANTS[variant]
    device = trainer.device
    directory = Path(tempfile.mkdtemp(prefix=f"prepare-{variant}-", dir=root))
    log = Reservations()
    logger = logging.getLogger("ckptzip")
    logger.addHandler(log)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        with reserving(how):
            manager = ckptzip.CheckpointManager(directory, keep_last=1)
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
            sync(device)
            began = time.perf_counter()
            if how.prepares:  # before the interval, as a training script calls it before its loop
                manager.prepare(trainer.state())
            prepared = time.perf_counter() - began
            started = time.perf_counter()
            ends[0].record()
            for i in range(steps):
                trainer.step()
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
            gaps = [ends[i].elapsed_time(ends[i + 1]) / 1e3 for i in range(steps)]
    finally:
        logger.removeHandler(log)
        logger.setLevel(level)
        shutil.rmtree(directory, ignore_errors=True)
    del manager
    gc.collect()
    return {"variant": variant, "prepare_s": round(prepared, 3), "lost_s": round(interval - steps * base, 3),
            "save_blocked_s": round(blocked, 3),
            "worst_step_s": round(max(gaps), 3), "steps_over_base_s": round(sum(g - base for g in gaps), 3),
            "reserved_gib": log.seen[0][0] if log.seen else None,
            "reservation_s": log.seen[0][1] if log.seen else None, "write_after_s": round(write, 2)}


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
    print("\n| variant | " + " | ".join(keys) + " | (medians of the rounds after the first; round 1 apart) |")
    print("|---|" + "---|" * (len(keys) + 1))
    for variant in variants:
        mine = [r for r in rows[1:] if r["variant"] == variant]
        later = mine[1:] or mine
        cells = []
        for key in keys:
            values = [r[key] for r in later if r[key] is not None]
            cells.append(f"{statistics.median(values):.3f}" if values else "–")
        print(f"| {variant} | " + " | ".join(cells) + f" | round 1: lost {mine[0]['lost_s']} |")


if __name__ == "__main__":
    main()
