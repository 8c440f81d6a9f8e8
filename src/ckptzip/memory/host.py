"""What the host can still give this process: its available memory within every limit that applies
(the memory cgroups it is in, v2 or v1, and their ancestors; ``ulimit -v``; the commit limit where
the kernel never overcommits). A load's default budget for the CPU and a manager's snapshots are
sized from it: past it, the kernel's out-of-memory killer ends a process, not an allocation."""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Iterator
from pathlib import Path

_PROC_CGROUP = "/proc/self/cgroup"
_CGROUP_ROOT = "/sys/fs/cgroup"
# cgroup v1 writes this (or larger) for "no limit"; v2 writes "max"
_NO_LIMIT = 1 << 62
# per version: the limit, what is charged, and the memory.stat field of the charged page cache the
# kernel reclaims before it kills (data read by the training fills a job's cgroup with it)
_V2_FILES = ("memory.max", "memory.current", b"inactive_file")
_V1_FILES = ("memory.limit_in_bytes", "memory.usage_in_bytes", b"total_inactive_file")


def _kib_fields(path: str, names: tuple[bytes, ...]) -> dict[bytes, int]:
    """The ``name: N kB`` fields ``names`` of a /proc file, in bytes (those it has)."""
    found = {}
    with contextlib.suppress(OSError, ValueError, IndexError), open(path, "rb") as f:
        for line in f:
            name, _, rest = line.partition(b":")
            if name in names:
                found[name] = int(rest.split()[0]) * 1024
    return found


def host_available() -> int | None:
    """Bytes the host can still give this process: ``MemAvailable`` (else the free physical
    pages), within its memory cgroups' limits (:func:`cgroup_room`), the process's address-space
    limit (``ulimit -v``) and, where the kernel never overcommits, its commit limit; None where
    none can be read."""
    meminfo = _kib_fields("/proc/meminfo", (b"MemAvailable", b"CommitLimit", b"Committed_AS"))
    available = meminfo.get(b"MemAvailable")
    if available is None:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    rooms = []
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    mapped = _kib_fields("/proc/self/status", (b"VmSize",)).get(b"VmSize")
    if soft != resource.RLIM_INFINITY and mapped is not None:
        rooms.append(soft - mapped)
    with contextlib.suppress(OSError, ValueError), open("/proc/sys/vm/overcommit_memory", "rb") as f:
        if f.read().strip() == b"2" and {b"CommitLimit", b"Committed_AS"} <= meminfo.keys():
            rooms.append(meminfo[b"CommitLimit"] - meminfo[b"Committed_AS"])
    room = cgroup_room()
    if room is not None:
        rooms.append(room)
    for room in rooms:
        available = max(0, room) if available is None else min(available, max(0, room))
    return available


def cgroup_room() -> int | None:
    """Bytes this process's memory cgroups can still take: over its cgroup and each ancestor, with
    cgroup v2 or v1's memory controller, the least of a limit less what is charged there that the
    kernel cannot reclaim (all but inactive page cache); None where no limit applies or none can
    be read."""
    rooms = []
    for directory, (limit_file, usage_file, inactive_field) in _memory_cgroups():
        limit, usage = _number(directory / limit_file), _number(directory / usage_file)
        if limit is None or usage is None or limit >= _NO_LIMIT:
            continue
        rooms.append(limit - (usage - _stat_field(directory / "memory.stat", inactive_field)))
    return min(rooms) if rooms else None


def _memory_cgroups() -> Iterator[tuple[Path, tuple[str, str, bytes]]]:
    """The directories of this process's memory cgroups and their ancestors that are mounted here,
    with the version's files. A container without its own cgroup namespace lists the host's path,
    which its mount does not hold: its root, the container's own cgroup, is found walking up."""
    with contextlib.suppress(OSError), open(_PROC_CGROUP) as f:
        for line in f:
            number, _, rest = line.rstrip("\n").partition(":")
            controllers, _, path = rest.partition(":")
            if number == "0" and controllers == "":
                base, files = Path(_CGROUP_ROOT), _V2_FILES
            elif "memory" in controllers.split(","):
                base, files = Path(_CGROUP_ROOT) / "memory", _V1_FILES
            else:
                continue
            parts = [p for p in path.split("/") if p]
            for depth in range(len(parts), -1, -1):
                directory = base.joinpath(*parts[:depth])
                if (directory / files[0]).exists():
                    yield directory, files


def _number(path: Path) -> int | None:
    """A cgroup file's number (v2's ``max``: no limit), or None where it cannot be read."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _NO_LIMIT
    return int(text) if text.isdigit() else None


def _stat_field(path: Path, name: bytes) -> int:
    """A field of a cgroup's ``memory.stat`` in bytes (0 where it cannot be read)."""
    with contextlib.suppress(OSError, ValueError, IndexError), open(path, "rb") as f:
        for line in f:
            key, _, value = line.partition(b" ")
            if key == name:
                return int(value)
    return 0
