"""GPU check of the gdeflate default (issue #22): a GPU's ``codec="auto"`` file decodes on a CPU.

On one GPU: a training-like state (engine_probe.synthetic_state: fp32 weights and AdamW moments,
bf16 gradients) of ``--gib`` GiB is saved with ``codec="auto"`` (planes in gdeflate),
``codec="fast"`` (planes in ans, the former default) and ``codec="ans"`` (whole tensors), each to a file object that discards its input and to bytes in host memory
(first call, which for the codec measured first includes the process's compiling and nvCOMP
setup, then the median of ``--reps``); the gdeflate bytes are loaded in a process that sees
no GPU (``CUDA_VISIBLE_DEVICES=""``), timed, and compared with the state tensor by tensor
(xxh3 of the bytes). A small golden file (tests/golden_state.py's state saved from the GPU with
``codec="auto"``) is written to ``--out`` for tests/golden. Prints one JSON summary.

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl   # nvCOMP wheels
    python3 setup.py -q build_ext --inplace                                       # the GDeflate decoder
    PYTHONPATH=/tmp/site:src:tests python3 bench/gdeflate_check.py --gib 8 --out "$OUT"

``--gib 0.2``: a quick run. ``--dry-run``: no GPU; the state on the CPU, coded with
``codec="gdeflate"`` (the CPU encoder), to check everything but the GPU here.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import xxhash

import ckptzip
from ckptzip_bench.pipeline import DiscardSink, first_call, timed
from ckptzip.tree import flatten
from engine_probe import synthetic_state
from golden_state import golden_state
from ckptzip_bench.training_job import Memory

GIB = 1 << 30


def digests(state: Any) -> dict[str, str]:
    """xxh3-64 of every tensor's bytes, by its place in the state."""
    return {t.name: xxhash.xxh3_64_hexdigest(t.tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy())
            for t in flatten(state).tensors}


def measure(state: Any, codec: str, device: torch.device, reps: int, size: int, sink: Memory) -> dict[str, Any]:
    """Save speeds (discarding, into ``sink``) and the ratio; ``sink`` keeps the last save's bytes."""
    first, _ = first_call(lambda: ckptzip.save(state, DiscardSink(), codec=codec), device)
    discard = timed(lambda: ckptzip.save(state, DiscardSink(), codec=codec), reps, device)

    def to_memory() -> None:
        sink.n = 0
        ckptzip.save(state, sink, codec=codec)

    memory = timed(to_memory, reps, device)
    with ckptzip.open(io.BytesIO(sink.data())) as reader:
        codecs = sorted({c for e in reader.entries() for c in e.codecs})
    return {"codec": codec, "first_save_s": round(first, 3), "save_s": [round(s, 3) for s in discard],
            "save_gbs": round(size / 1e9 / statistics.median(discard), 2),
            "save_to_memory_gbs": round(size / 1e9 / statistics.median(memory), 2),
            "ratio": round(size / sink.n, 4), "stored_codecs": codecs}


def cpu_load(data: memoryview, expected: dict[str, str], size: int) -> dict[str, Any]:
    """Load ``data`` in a process that sees no GPU; bit-exact against ``expected``, and its time."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".ckz") as f:
        f.write(data)
        f.flush()
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        child = subprocess.run([sys.executable, __file__, "--cpu-load", f.name], env=env, capture_output=True,
                               text=True, check=False)
    if child.returncode != 0:
        return {"error": child.stderr[-2000:]}
    got = json.loads(child.stdout.splitlines()[-1])
    wrong = sorted(k for k in expected if got["digests"].get(k) != expected[k])
    return {"bit_exact": not wrong and got["digests"].keys() == expected.keys(), "mismatched": wrong[:10],
            "load_s": got["load_s"], "load_gbs": round(size / 1e9 / got["load_s"], 2), "threads": got["threads"]}


def child_load(path: str) -> None:
    """(In the GPU-less process) load ``path`` to the CPU and print its digests and time."""
    assert not torch.cuda.is_available(), "the CPU load must not see a GPU"
    start = time.perf_counter()
    state = ckptzip.load(path, map_location="cpu")
    seconds = time.perf_counter() - start
    print(json.dumps({"load_s": round(seconds, 3), "digests": digests(state), "threads": torch.get_num_threads()}))


def write_golden(out: Path, device: torch.device, codec: str) -> dict[str, Any]:
    """tests/golden_state.py's state, moved to ``device`` by a load, saved there with ``codec``."""
    portable = io.BytesIO()
    ckptzip.save(golden_state(), portable, codec="portable")
    state = ckptzip.load(io.BytesIO(portable.getvalue()), map_location=str(device))
    blob = io.BytesIO()
    ckptzip.save(state, blob, codec=codec)
    with ckptzip.open(io.BytesIO(blob.getvalue())) as reader:
        major, minor = reader._reader.index.version
        codecs = sorted({c for e in reader.entries() for c in e.codecs})
    path = out / f"{'gpu' if device.type == 'cuda' else 'dryrun'}_gdeflate_v{major}_{minor}.ckz"
    path.write_bytes(blob.getvalue())
    return {"path": str(path), "bytes": len(blob.getvalue()), "codecs": codecs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=8.0, help="size of the state")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT") or ".", help="where the golden file goes")
    p.add_argument("--dry-run", action="store_true", help="no GPU: code with gdeflate on the CPU")
    p.add_argument("--cpu-load", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.cpu_load:
        child_load(args.cpu_load)
        return
    device = torch.device("cpu" if args.dry_run else "cuda")
    # "fast" is the former default (planes in ans); "ans" codes whole tensors with it.
    codecs = ("gdeflate",) if args.dry_run else ("auto", "fast", "ans")
    start = time.perf_counter()
    # few layers: the widths synthetic_state rounds down to multiples of 64 lose little (8 GiB: 8.4 GB)
    state = synthetic_state(args.gib * GIB / 1e9, max(4, round(args.gib)), device=device.type)
    size = sum(t.tensor.numel() * t.tensor.element_size() for t in flatten(state).tensors)
    summary: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
                               "torch": torch.__version__, "state_gb": round(size / 1e9, 2),
                               "state_build_s": round(time.perf_counter() - start, 1)}
    expected = digests(state)
    sink = Memory(size + GIB)
    for codec in reversed(codecs):  # the CPU loads the first codec's bytes: the sink's last
        summary[codec] = measure(state, codec, device, args.reps, size, sink)
    summary["cpu_load"] = cpu_load(sink.data(), expected, size)
    summary["golden"] = write_golden(Path(args.out), device, codecs[0])
    summary["wall_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
