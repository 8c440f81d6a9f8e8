"""A/B of one engine setting on one GPU, in one process: the variants alternate, round by round,
so the machine (which differs more between the machines lent than most changes do) is the same
for all of them.

``--set DOTTED.NAME=V1,V2,...`` names a module attribute (a constant, or a class attribute) and
the values to try, as Python literals (a dict or tuple among them too); several ``--set`` change
their attributes together, variant by variant. ``--what save`` times ``ckptzip.save`` of a
7B-like state to a file object that discards its input (with the GPU filled to leave ``--free``
GiB, if given; ``--check``: each variant's first save also restored and compared); ``--what host`` times what ``CheckpointManager.save`` blocks with host snapshots
(``prepare`` first; each variant its own manager); ``--what load`` and ``--what cpu-load`` time
``ckptzip.load`` of the state saved on the GPU (``codec="auto"``), from bytes in host memory, to
the GPU and to the CPU (``--cpu-decode``: on the CPU's cores, as a machine without a GPU would,
instead of on the GPU for the host). Prints a JSON row per variant: the median and every time,
the stored bytes, the batches that ran out of GPU memory.

    python3 bench/ab_probe.py --what save --gib 16 --free 2 --set ckptzip.engine.plan.OPEN_BATCHES=1,8
    python3 bench/ab_probe.py --what host --gib 40 --free 3 \\
        --set ckptzip.engine.plan.SMALL_BATCH_BYTES=0,536870912
    python3 bench/ab_probe.py --what cpu-load --cpu-decode --gib 8 --set ckptzip.engine.reader.CPU_SLICE_BYTES=16777216,67108864 \\
        --set 'ckptzip.engine.plan.LOAD_BATCH_BYTES={"cuda": 536870912, "cpu": 16777216},{"cuda": 536870912, "cpu": 67108864}'
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import io
import json
import logging
import statistics
from typing import Any

import torch

import ckptzip
from ckptzip.engine import plan as engine_plan
from ckptzip_bench.discard import written
from ckptzip_bench.pipeline import discard_sink
from ckptzip_bench.training_job import GIB, OutOfMemoryCount, fill_gpu, llama_like_state, nbytes, timed


def setting(dotted: str) -> tuple[Any, str]:
    """The object that holds ``dotted``'s last name (a module, or a class in one) and that name."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:-1]:
            owner = getattr(owner, name)
        if not hasattr(owner, parts[-1]):
            raise SystemExit(f"{dotted}: {owner!r} has no attribute {parts[-1]!r}")
        return owner, parts[-1]
    raise SystemExit(f"{dotted}: no module to import")


def check_save(state: dict[str, torch.Tensor]) -> None:
    """Save ``state`` into memory, load it to the CPU, and compare every tensor's bytes."""
    buffer = io.BytesIO()
    ckptzip.save(state, buffer)
    loaded = ckptzip.load(buffer.getvalue(), map_location="cpu")
    assert all(torch.equal(loaded[n].view(torch.uint8), t.cpu().view(torch.uint8)) for n, t in state.items()), \
        "not bit-exact"
    print("bit-exact", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", required=True, action="append",
                   help="DOTTED.NAME=V1,V2,... (Python literals); repeated: changed together")
    p.add_argument("--what", choices=("save", "host", "load", "cpu-load"), default="save")
    p.add_argument("--gib", type=float, default=16, help="size of the 7B-like state")
    p.add_argument("--free", type=float, help="GiB of GPU memory left free beside the state")
    p.add_argument("--cpu-decode", action="store_true",
                   help="cpu-load: decode on the CPU's cores, as a machine without a GPU would")
    p.add_argument("--check", action="store_true",
                   help="save: each variant's first save also into memory, loaded to the CPU and compared bit-exactly")
    p.add_argument("--log", action="store_true", help="print ckptzip's log records (batches out of memory among them)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reps", type=int, default=3, help="timed calls per variant and round")
    args = p.parse_args()
    settings = []
    for assignment in args.set:
        dotted, _, values = assignment.partition("=")
        settings.append((dotted, *setting(dotted), ast.literal_eval(f"[{values}]")))
    if len({len(values) for *_, values in settings}) != 1:
        raise SystemExit("every --set needs as many values")
    variants = list(zip(*(values for *_, values in settings)))
    label = " ".join(dotted for dotted, *_ in settings)
    originals = [getattr(owner, name) for _, owner, name, _ in settings]
    failures = OutOfMemoryCount()
    logging.getLogger("ckptzip").addHandler(failures)
    logging.getLogger("ckptzip").setLevel(logging.INFO)
    if args.log:
        logging.basicConfig(format="  log: %(message)s")
    state = llama_like_state(args.gib)
    data = b""
    target = "cpu" if args.what == "cpu-load" else None  # where loads go (None: where it was saved)
    if args.cpu_decode:  # no codec counts as best decoded on a GPU: gdeflate planes decode on the CPU
        engine_plan.gpu_first_ids = frozenset
    if args.what in ("load", "cpu-load"):
        buffer = io.BytesIO()
        ckptzip.save(state, buffer)
        data = buffer.getvalue()
        del buffer
    filler = fill_gpu(int(args.free * GIB)) if args.free is not None else None
    times: dict[int, list[float]] = {k: [] for k in range(len(variants))}
    stored: dict[int, int] = {}
    out_of_memory = dict.fromkeys(range(len(variants)), 0)
    try:
        for r in range(args.rounds):
            for k, values in enumerate(variants):
                for (_, owner, name, _), value in zip(settings, values):
                    setattr(owner, name, value)
                failures.count = 0
                if args.what in ("load", "cpu-load"):
                    loaded = ckptzip.load(data, map_location=target)  # untimed: the variant's first call
                    stored[k] = len(data)
                    assert all(torch.equal(loaded[n].view(torch.uint8), t.to(loaded[n].device).view(torch.uint8))
                               for n, t in state.items()), "not bit-exact"
                    del loaded
                    times[k] += [timed(lambda: ckptzip.load(data, map_location=target))[0] for _ in range(args.reps)]
                elif args.what == "save":
                    sink = discard_sink()
                    ckptzip.save(state, sink)  # untimed: the variant's first call
                    stored[k] = sink.nbytes
                    if args.check and r == 0:
                        check_save(state)
                    times[k] += [timed(lambda: ckptzip.save(state, discard_sink()))[0] for _ in range(args.reps)]
                else:
                    run = f"ab-{r}-{k}"
                    manager = ckptzip.CheckpointManager(f"discard://{run}", keep_last=1, snapshot="host")
                    manager.prepare(state)
                    for step in range(args.reps):
                        times[k].append(timed(functools.partial(manager.save, step, state))[0])
                        manager.wait()
                    stored[k] = written(run)
                    manager.close()
                out_of_memory[k] += failures.count
                print(f"round {r} {label}={values!r}: {[round(t, 3) for t in times[k][-args.reps:]]}", flush=True)
    finally:
        for (_, owner, name, _), original in zip(settings, originals):
            setattr(owner, name, original)
        del filler
    size = nbytes(state)
    for k, values in enumerate(variants):
        median = statistics.median(times[k])
        print(json.dumps({"setting": label, "value": values if len(values) > 1 else values[0],
                          "what": args.what, "free_gib": args.free,
                          "state_gb": round(size / 1e9, 2), "median_s": round(median, 4),
                          "gbs": round(size / 1e9 / median, 1), "times_s": [round(t, 4) for t in times[k]],
                          "ratio": round(size / max(1, stored[k]), 5), "batches_out_of_memory": out_of_memory[k]}))


if __name__ == "__main__":
    main()
