"""``ckptzip demo``: train a small model, checkpoint it with ckptzip and torch.save, restore it
bit-exactly, and print sizes, ratios, times and the per-class ratio table. No downloads.

:mod:`.training` holds the models (also the benchmark's, bench/ckptzip_bench), :mod:`.compare` the
bit-for-bit check of a restored state.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from .. import api
from ..errors import DeviceUnavailableError, UsageError
from ..report import class_table, human_bytes, tensor_table
from .compare import assert_state_equal
from .training import PRESETS, train

T = TypeVar("T")
TOP = 12  # tensors in the demo's table


def _timed(fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T, float]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def _torch_save(state: object, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _device(name: str | None) -> str:
    """The demo's ``--device``: cuda when available by default; a bad name is a CkptzipError."""
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name!r} is not a device; pass cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailableError(f"--device {name}: CUDA is not available here; pass --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {name!r}: the demo runs on cpu or cuda")
    return name


def _progress(steps: int) -> Callable[[int], None]:
    """Print the step about ten times while training."""
    every = max(1, steps // 10)

    def report(step: int) -> None:
        if step % every == 0 or step == steps:
            print(f"  step {step}/{steps}", flush=True)

    return report


def run_demo(*, preset: str = "tiny", steps: int = 30, device: str | None = None) -> int:
    """Run the demo; returns 0 when the restored state is bit-identical."""
    if preset not in PRESETS:
        raise UsageError(f"--preset {preset!r} is not a model preset; pass one of {', '.join(PRESETS)}")
    if steps < 1:
        raise UsageError(f"--steps {steps}: pass a number of training steps >= 1")
    device = _device(device)
    print(f"training the {preset!r} model for {steps} steps on {device} ...")
    result = train(preset, steps, device=device, seed=0, on_step=_progress(steps))
    print(f"  loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f} in {result.seconds:.1f} s")
    state = result.state()
    with tempfile.TemporaryDirectory(prefix="ckptzip-demo-") as tmp:
        pt, ckz = Path(tmp) / "state.pt", Path(tmp) / "state.ckz"
        _, t_pt_save = _timed(_torch_save, state, pt)
        _, t_ckz_save = _timed(api.save, state, ckz)
        _, t_pt_load = _timed(torch.load, pt, map_location=device, weights_only=True)
        restored, t_ckz_load = _timed(api.load, ckz, map_location=device)
        assert_state_equal(state, restored)
        with api.open(ckz) as reader:
            entries = reader.entries()
        print()
        print(f"the {min(TOP, len(entries))} largest of {len(entries)} tensors:")
        print(tensor_table(entries, limit=TOP))
        print()
        print(class_table(entries))
        size_pt, size_ckz = pt.stat().st_size, ckz.stat().st_size
        print()
        print(f"{'':12}{'size':>12}{'save s':>9}{'load s':>9}")
        print(f"{'torch.save':12}{human_bytes(size_pt):>12}{t_pt_save:>9.3f}{t_pt_load:>9.3f}")
        print(f"{'ckptzip':12}{human_bytes(size_ckz):>12}{t_ckz_save:>9.3f}{t_ckz_load:>9.3f}")
        print(f"\nckptzip file is {size_pt / size_ckz:.3f}x smaller than torch.save; "
              "restored state is bit-identical (every tensor checked on its uint8 bytes).")
    return 0
