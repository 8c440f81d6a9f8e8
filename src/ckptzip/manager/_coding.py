"""A process of its own that codes a host snapshot's host tensors and hands the file's bytes back.

Coding on the host in the training's process takes the interpreter lock (GIL) between codec
calls, thousands of times a checkpoint, and the training loop's thread waits for it before each
operator it launches: the training slows for as long as the coding runs. So where a host snapshot
leaves tensors to code on the host, the write runs in a child interpreter (:class:`CodingProcess`,
a fresh interpreter that imports this module, never re-running the caller's script) at a lower
scheduling priority: it receives the staged state in shared memory (no copy:
:meth:`~ckptzip.staging.HostStaged.portable`), codes and assembles the container there, and passes
its bytes back through a ring of shared buffers; the parent writes them to the checkpoint's file
(its storage, atomic commit and early writeback stay where they were). The child never touches a
GPU.

A write the child cannot do (it did not start, failed, exited or went silent for
:data:`SILENCE_SECONDS`) is done in this process instead; the child is replaced at the next write.
"""

from __future__ import annotations

import contextlib
import io
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import subprocess
import sys
import threading
import traceback
from typing import Any, BinaryIO

import torch
import torch.multiprocessing  # registers the reductions that hand shared tensors over

from .. import settings
from ..codecs import cpu_threads
from ..errors import CheckpointWriteError
from ..format import TensorEntry
from ..memory.shared import shared_empty
from ..storage.writeback import Writeback
from ..staging import HostStaged

# Buffers of the ring the child's bytes come back through: a few, so the child codes on while the
# parent writes one out.
RING_SLOTS = 4
RING_SLOT_BYTES = 16 << 20
# A child that sends nothing for this long (no bytes, no result) is taken for stuck and killed.
SILENCE_SECONDS = 600.0
# Failures of the child in a row after which a manager codes in its own process for good.
MAX_FAILURES = 3
# Scheduling priority of the child (os.nice increment): it yields the cores to the training's
# threads and data loaders whenever they want them.
NICENESS = 10
_LOG = logging.getLogger("ckptzip")


class _ChildFailed(Exception):
    """The child could not write a snapshot: it did not start, died, fell silent or failed."""


class CodingProcess:
    """The child that writes host snapshots for one manager; started on first use (or
    :meth:`start`), replaced after a failure, stopped by :meth:`close`. One write at a time.

    A write the child cannot do is done in this process instead (:meth:`write` returns None),
    so a child that cannot run (an interpreter that cannot import ckptzip, a killed process)
    costs no checkpoint; after :data:`MAX_FAILURES` failures in a row it is not used again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None
        self._conn: multiprocessing.connection.Connection | None = None
        self._ring: torch.Tensor | None = None
        self._slot_bytes = RING_SLOT_BYTES
        self.failures = 0  # in a row

    @property
    def usable(self) -> bool:
        return self.failures < MAX_FAILURES

    def start(self) -> None:
        """Start the child now (it imports torch and ckptzip: seconds), if it is not running."""
        with self._lock:
            try:
                self._ensure()
            except _ChildFailed as exc:
                self._stop()
                _LOG.warning("ckptzip: the coding process did not start: %s", exc)

    def _ensure(self) -> multiprocessing.connection.Connection:
        if self._conn is not None and self._child is not None and self._child.poll() is None:
            return self._conn
        self._stop()
        try:
            ours, theirs = socket.socketpair()
            try:
                # a new session: a Ctrl-C meant for the training (which may save once more) does not reach it
                self._child = subprocess.Popen([sys.executable, "-c", f"from {__name__} import _child; "
                                                f"_child({theirs.fileno()})"],
                                               pass_fds=[theirs.fileno()], env=_child_environment(),
                                               stdin=subprocess.PIPE, start_new_session=True)
            finally:
                theirs.close()
            assert self._child.stdin is not None
            # the key torch's shared tensors are fetched with (multiprocessing's resource sharer)
            self._child.stdin.write(bytes(multiprocessing.current_process().authkey).hex().encode() + b"\n")
            self._child.stdin.close()
            self._conn = multiprocessing.connection.Connection(ours.detach())
            self._slot_bytes = RING_SLOT_BYTES
            self._ring = shared_empty(RING_SLOTS * self._slot_bytes)
            self._conn.send(("ring", self._ring, self._slot_bytes))
        except OSError as exc:  # CheckpointWriteError (no shared memory) included
            raise _ChildFailed(f"it could not be started: {exc}") from exc
        return self._conn

    def write(self, f: BinaryIO, staged: HostStaged, tree: Any) -> list[TensorEntry] | None:
        """Write ``staged`` (its buffers kept until this returns) to ``f`` as its own
        :meth:`~ckptzip.staging.HostStaged.write` does, the coding in the child; None where the
        child could not, and ``f`` holds nothing of it (the caller writes it in this process).
        :class:`~ckptzip.errors.CheckpointWriteError` where the child failed after some of its
        bytes reached a file that cannot be rewound; the file's own errors as they are."""
        with self._lock:
            start = f.tell() if f.seekable() else None
            written = [0]
            try:
                entries = self._write(f, staged, tree, written)
            except _ChildFailed as exc:
                self._stop()
                self.failures += 1
                if written[0] and start is None:
                    raise CheckpointWriteError(f"ckptzip's coding process failed while writing this checkpoint "
                                               f"({exc}); it was not written, the previous ones are intact") from exc
                if written[0] and start is not None:
                    f.seek(start)
                    f.truncate()
                _LOG.warning("ckptzip: the coding process failed (%s); this checkpoint is coded in this process%s",
                             exc, "" if self.usable else ", and so are the next ones")
                return None
            except BaseException:
                self._stop()  # mid-write: its bytes and acknowledgements out of step with ours
                raise
            self.failures = 0
            return entries

    def _write(self, f: BinaryIO, staged: HostStaged, tree: Any, written: list[int]) -> list[TensorEntry]:
        conn = self._ensure()
        assert self._ring is not None
        ring = self._ring.numpy().data
        storages, payload = _dumps((staged.portable(), tree))
        writeback = Writeback(f)  # the disk works while the child codes, as in-process writes do
        try:
            conn.send(("write", storages, payload))
            while True:
                if not conn.poll(SILENCE_SECONDS):
                    raise _ChildFailed(f"it sent nothing for {SILENCE_SECONDS:.0f} s")
                message = conn.recv()
                if message[0] == "done":
                    entries: list[TensorEntry] = message[1]
                    return entries
                if message[0] != "data":
                    raise _ChildFailed(message[1])
                _, slot, n = message
                f.write(ring[slot * self._slot_bytes : slot * self._slot_bytes + n])
                written[0] += n
                writeback.wrote()
                conn.send(("free", slot))
        except (EOFError, OSError) as exc:  # the connection, not the file: f.write's errors are the file's own
            if isinstance(exc, OSError) and not isinstance(exc, ConnectionError):
                raise
            code = self._child.poll() if self._child is not None else None
            raise _ChildFailed(f"it exited with status {code}") from exc

    def _stop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.send(("exit",))
            self._conn.close()
            self._conn = None
        if self._child is not None:
            try:
                self._child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._child.kill()
                self._child.wait()
            self._child = None
        self._ring = None

    def close(self) -> None:
        """Stop the child (after the write in progress, if any)."""
        with self._lock:
            self._stop()


def _child_environment() -> dict[str, str]:
    """The child's environment: this process's, where it imported ckptzip from, no GPU, and (one
    training process of several on this host, as torchrun starts them, unless ``CKPTZIP_THREADS``
    says otherwise) its share of the cores, so the ranks' children do not oversubscribe them."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env["CUDA_VISIBLE_DEVICES"] = ""
    ranks = local_ranks()
    if settings.threads() is None and ranks > 1:
        env[settings.THREADS] = str(max(1, cpu_threads() // ranks))
    return env


def local_ranks() -> int:
    """The training processes of this host, as their launcher counts them (torchrun's
    ``LOCAL_WORLD_SIZE``, else Open MPI's, MPICH's, or Slurm's tasks per node), else 1. They share
    its cores and its memory, and take their checkpoints at the same steps."""
    for value in (os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE"),
                  os.environ.get("MPI_LOCALNRANKS"), os.environ.get("SLURM_NTASKS_PER_NODE")):
        if value and value.isdigit() and int(value) > 0:
            return int(value)
    return 1


class _Relay(io.RawIOBase):
    """The child's file: bytes go into the ring's free slots, each full one handed to the parent."""

    def __init__(self, conn: multiprocessing.connection.Connection, ring: torch.Tensor, slot_bytes: int) -> None:
        self._conn = conn
        self._ring = ring.numpy()
        self._slot_bytes = slot_bytes
        self._slots = ring.numel() // slot_bytes
        self._busy: set[int] = set()
        self._slot = 0
        self._fill = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < view.nbytes:
            n = min(view.nbytes - done, self._slot_bytes - self._fill)
            start = self._slot * self._slot_bytes + self._fill
            self._ring[start : start + n] = view[done : done + n]
            self._fill += n
            done += n
            if self._fill == self._slot_bytes:
                self._hand_over()
        return done

    def _hand_over(self) -> None:
        if not self._fill:
            return
        self._conn.send(("data", self._slot, self._fill))
        self._busy.add(self._slot)
        self._fill = 0
        while len(self._busy) == self._slots:  # every slot with the parent: wait for one back
            self._take_back()
        self._slot = next(s for s in range(self._slots) if s not in self._busy)

    def _take_back(self) -> None:
        kind, slot = self._conn.recv()
        assert kind == "free"
        self._busy.discard(slot)

    def finish(self) -> None:
        """Hand the partly filled slot over, and wait until the parent has written every slot."""
        self._hand_over()
        while self._busy:
            self._take_back()


def _dumps(obj: Any) -> tuple[list[torch.UntypedStorage], bytes]:
    """``obj`` pickled with its tensors in shared memory left out, and the storages they lie in,
    each once (a tensor handed over by itself would hand over its storage's descriptor again)."""
    storages: dict[int, tuple[int, torch.UntypedStorage]] = {}

    class _Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            if not isinstance(o, torch.Tensor) or o.device.type != "cpu" or not o.is_shared():
                return None
            storage = o.untyped_storage()
            index = storages.setdefault(storage.data_ptr(), (len(storages), storage))[0]
            return (index, o.storage_offset(), tuple(o.shape), o.stride(), o.dtype)

    out = io.BytesIO()
    _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return [storage for _, storage in sorted(storages.values(), key=lambda x: x[0])], out.getvalue()


def _loads(storages: list[torch.UntypedStorage], payload: bytes) -> Any:
    """What :func:`_dumps` took apart."""

    class _Unpickler(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> torch.Tensor:
            index, offset, shape, stride, dtype = pid
            return torch.empty(0, dtype=dtype).set_(storages[index], offset, shape, stride)

    return _Unpickler(io.BytesIO(payload)).load()


def _child(fd: int) -> None:
    os.nice(NICENESS)
    multiprocessing.current_process().authkey = bytes.fromhex(sys.stdin.readline().strip())
    conn = multiprocessing.connection.Connection(fd)
    ring: torch.Tensor | None = None
    slot_bytes = 0
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message[0] == "exit":
            return
        if message[0] == "ring":
            _, ring, slot_bytes = message
            continue
        assert ring is not None
        try:
            staged, tree = _loads(message[1], message[2])
            relay = _Relay(conn, ring, slot_bytes)
            entries = staged.write(relay, tree)
            relay.finish()
            reply: tuple[Any, ...] = ("done", entries)
        except Exception as exc:  # reported to the parent, which then writes this snapshot itself
            reply = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}")
        staged = message = None  # its shared memory unmapped before the parent reuses it
        try:
            conn.send(reply)
        except OSError:  # the parent is gone (killed, or exited mid-write): nothing is waiting for it
            return

