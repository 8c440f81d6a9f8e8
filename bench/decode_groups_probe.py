"""How many nvCOMP decode calls a GPU load makes, and how long it takes, with streams grouped by
their codecs' decoder configuration (what the reader does) against grouped by their whole
configuration (what it did before: gdeflate's two algorithm types then decoded apart).

A synthetic training-like state of ``--gb`` GB saved with ``codec="auto"`` and loaded from bytes
in host memory onto the GPU four times per grouping, twice over, alternately:

    python3 bench/decode_groups_probe.py --gb 4
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from typing import Any

import numpy as np
import torch

import ckptzip
from ckptzip.codecs import nvcomp
from ckptzip.engine import decode
from engine_probe import synthetic_state


def by_config(entries: Any, streams: Any, codecs: list[dict[str, Any]], coded: np.ndarray, backend: str) -> list:
    """The grouping before decoder configurations: one group per whole configuration."""
    out: list = []
    keys: dict[str, tuple[int, Any]] = {}
    for s, config in enumerate(codecs):
        if not coded[s]:
            out.append((-1, None))
            continue
        text = json.dumps(config, sort_keys=True)
        if text not in keys:
            keys[text] = (len(keys), decode.codec_for(config, backend))
        out.append(keys[text])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=4.0)
    args = p.parse_args()
    calls = [0]
    run_decode = nvcomp._NvcompCodec._run_decode

    def counted(self: Any, *a: Any, **k: Any) -> Any:
        calls[0] += 1
        return run_decode(self, *a, **k)

    nvcomp._NvcompCodec._run_decode = counted  # type: ignore[method-assign]
    state = synthetic_state(args.gb, 8)
    blob = io.BytesIO()
    ckptzip.save(state, blob)
    data = blob.getvalue()
    with ckptzip.open(data) as reader:
        print(sorted({json.dumps(s.codec) for e in reader.entries() for s in e.streams}))
    grouped = decode._decoders
    for name, fn in (("by decoder", grouped), ("by config", by_config)) * 2:
        decode._decoders = fn  # type: ignore[assignment]
        seconds = []
        for _ in range(4):
            calls[0] = 0
            torch.cuda.synchronize()
            start = time.perf_counter()
            ckptzip.load(data, map_location="cuda")
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        print(json.dumps({"grouping": name, "decode_calls": calls[0], "load_s": [round(x, 4) for x in seconds],
                          "median_after_first": round(statistics.median(seconds[1:]), 4)}))


if __name__ == "__main__":
    main()
