"""Where a GPU out-of-memory came from: torch's allocator history, summarised.

``recording()`` turns on torch's memory history (with Python stacks) for a block of code;
``summary()`` reads it back after a failure: each out-of-memory event with its size, the free
memory the driver reported and the Python frames that asked, the largest allocations live at that
moment, and the reserved/allocated bytes of each stream's segments (blocks cached on a stream
other than the caller's are what a budget that counts ``memory_reserved()`` may overrate).
"""

from __future__ import annotations

import bisect
import contextlib
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch

_MIB = 1 << 20


@contextlib.contextmanager
def recording(enabled: bool = True, entries: int = 200_000) -> Iterator[None]:
    """Record allocations (with stacks) inside the block when ``enabled``."""
    if not enabled:
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=entries, stacks="python")
    try:
        yield
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def _frames(entry: dict[str, Any], keep: int = 8) -> list[str]:
    frames = [f for f in entry.get("frames", []) if "ckptzip" in f.get("filename", "")
              or "bench" in f.get("filename", "")]
    return [f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']} {f['name']}" for f in frames[:keep]]


def _occupancy(segments: dict[int, int], live: dict[int, dict[str, Any]], limit: int = 12) -> list[list[float]]:
    """Segments allocated while recording, largest first: [size, live bytes in it] in MiB, to
    tell fragmentation (cached segments with a few live blocks) from memory really in use."""
    starts = sorted(segments)
    used = dict.fromkeys(starts, 0)
    for entry in live.values():
        i = bisect.bisect_right(starts, entry["addr"]) - 1
        if i >= 0 and entry["addr"] < starts[i] + segments[starts[i]]:
            used[starts[i]] += entry["size"]
    rows = sorted(((segments[a], used[a]) for a in starts), reverse=True)[:limit]
    return [[round(size / _MIB, 1), round(busy / _MIB, 1)] for size, busy in rows]


def summary(limit: int = 12) -> dict[str, Any]:
    """The recorded history's out-of-memory events and what was live and cached then."""
    snap = torch.cuda.memory._snapshot()
    traces = snap["device_traces"][torch.cuda.current_device()] if snap["device_traces"] else []
    live: dict[int, dict[str, Any]] = {}
    segments: dict[int, int] = {}  # segments the history saw allocated: address -> size
    ooms = []
    for entry in traces:
        action = entry["action"]
        if action == "alloc":
            live[entry["addr"]] = entry
        elif action in ("free_requested", "free_completed"):
            live.pop(entry["addr"], None)
        elif action == "segment_alloc":
            segments[entry["addr"]] = entry["size"]
        elif action in ("segment_free", "segment_unmap"):
            segments.pop(entry["addr"], None)
        elif action == "oom":
            largest = sorted(live.values(), key=lambda e: -e["size"])[:limit]
            ooms.append({"size_mib": round(entry["size"] / _MIB, 1),
                         "device_free_mib": round(entry.get("device_free", 0) / _MIB, 1),
                         "asked_by": _frames(entry),
                         "live_largest": [(round(e["size"] / _MIB, 1), _frames(e, 3)) for e in largest],
                         "recorded_segments": _occupancy(segments, live)})
    streams: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for seg in snap["segments"]:
        streams[seg["stream"]][0] += seg["total_size"]
        streams[seg["stream"]][1] += seg["allocated_size"]
    return {"ooms": ooms[-3:], "oom_events": len(ooms),
            "segments_by_stream_mib": {str(s): [round(r / _MIB, 1), round(a / _MIB, 1)]
                                       for s, (r, a) in streams.items()}}
