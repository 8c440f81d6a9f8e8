"""How many nvCOMP decode calls a GPU load makes, and how long it takes, with streams grouped by
their codecs' decoder configuration (what the reader does) against grouped by their whole configuration (what it did
before: gdeflate's two algorithm types then decoded apart; reproduced by giving gdeflate the
default decoder configuration, the whole one).

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

import torch

import ckptzip
from ckptzip.codecs import Codec, nvcomp
from engine_probe import synthetic_state


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=4.0)
    args = p.parse_args()
    calls = [0]
    run_decode = nvcomp._NvcompCodec._decompress

    def counted(self: Any, *a: Any, **k: Any) -> Any:
        calls[0] += 1
        return run_decode(self, *a, **k)

    nvcomp._NvcompCodec._decompress = counted  # type: ignore[method-assign]
    state = synthetic_state(args.gb, 8)
    blob = io.BytesIO()
    ckptzip.save(state, blob)
    data = blob.getvalue()
    with ckptzip.open(data) as reader:
        print(sorted({json.dumps(s.codec) for e in reader.entries() for s in e.streams}))
    decoder_config = nvcomp.NvcompGdeflateCodec.decoder_config
    for name, fn in (("by decoder", decoder_config), ("by config", Codec.decoder_config)) * 2:
        # "by config" is the grouping before decoder configurations: a gdeflate stream's whole one
        nvcomp.NvcompGdeflateCodec.decoder_config = fn  # type: ignore[method-assign]
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
