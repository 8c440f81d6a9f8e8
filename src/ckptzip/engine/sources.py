"""Tensors not stored as themselves (docs/FORMAT.md, "Version 2.1"): copies and casts of other
entries (zero bytes), and XOR deltas against a base checkpoint.

Saving: :func:`rewrite_table` decides, before batching, which tensors the engine encodes and in
what form; :meth:`Table.complete` turns the encoded entries into the whole table. Loading:
:class:`LoadPlan` names the stored entries to decode, then rebuilds the others from them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ..checksum import format_wsum64, wsum64_tensor
from ..errors import CorruptCheckpointError, MissingBaseError
from ..format import DTYPE_NAMES, DTYPES, BaseRef, TensorEntry
from ..format.spec import VERSION, VERSION_SOURCES, VERSION_SPARSE
from ..kernels.segments import tensor_sums
from .delta import codes_sparse, deltas_that_pay, nonzero_count, xor_bytes
from .derive import cast, find_casts, find_duplicates
from .encode import tensor_bytes

K = TypeVar("K", bound=Hashable)


@dataclass
class DeltaBase:
    """The checkpoint a save may store XOR deltas against: its reference and its tensors by name."""

    ref: BaseRef
    tensors: Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class Layout:
    """What an index entry records of a tensor besides its bytes: its dtype, shape, size and device
    (kept apart from the tensor, so a table staged on a GPU can be written in another process)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    device: str

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Layout:
        return cls(tensor.dtype, tuple(tensor.shape), tensor.numel() * tensor.element_size(), str(tensor.device))


@dataclass
class Table:
    """The tensor table of a save: what the engine encodes (``names``/``tensors``, at table
    ``positions``) and how every other entry is derived."""

    count: int
    positions: list[int]
    names: list[str]
    tensors: list[torch.Tensor]
    all_names: list[str]
    layouts: list[Layout]  # of every position: what its entry records
    sources: dict[int, dict[str, Any]] = field(default_factory=dict)
    checksums: dict[int, int] = field(default_factory=dict)  # own checksum where the engine's is not
    bases: list[BaseRef] = field(default_factory=list)
    sparse: list[int | None] = field(default_factory=list)  # per encoded tensor: non-zero count where coded sparse

    @property
    def version(self) -> tuple[int, int]:
        if any(count is not None for count in self.sparse):
            return VERSION_SPARSE
        return VERSION_SOURCES if self.sources else VERSION

    @property
    def recorded(self) -> list[Layout]:
        """Per encoded tensor, what its entry records: the state's tensor's layout (``tensors``
        may hold an XOR residue, or a host copy of it, instead)."""
        return [self.layouts[p] for p in self.positions]

    def complete(self, stored: Sequence[TensorEntry]) -> list[TensorEntry]:
        """The whole table, in position order, from the entries of the encoded tensors."""
        entries: list[TensorEntry | None] = [None] * self.count
        for position, entry in zip(self.positions, stored):
            if position in self.sources:  # an XOR delta: the engine checksummed the residue
                xor = dict(self.sources[position]["xor"], checksum=entry.checksum)
                entry = dataclasses.replace(entry, checksum=self._checksum(position), source={"xor": xor})
            entries[position] = entry
        for kind in ("cast", "copy"):  # a copy may refer to a cast
            for position, source in self.sources.items():
                if kind not in source:
                    continue
                t = self.layouts[position]
                checksum = entries[source[kind]].checksum if kind == "copy" else self._checksum(position)
                entries[position] = TensorEntry(
                    self.all_names[position], DTYPE_NAMES[t.dtype], t.shape, t.nbytes, checksum, [], [], t.device,
                    source)
        complete = [entry for entry in entries if entry is not None]
        if len(complete) != self.count:
            raise AssertionError("a position of the table has neither an encoded entry nor a source")
        return complete

    def _checksum(self, position: int) -> str:
        return format_wsum64(self.checksums[position])


def rewrite_table(names: list[str], tensors: list[torch.Tensor], base: DeltaBase | None = None) -> Table:
    """Find duplicates and casts among ``tensors``, and XOR deltas against ``base`` that pay; the
    engine then encodes only what the returned table lists. Every save path rewrites its table
    here (:func:`~.writer.write_state`, :func:`~.staged.staged_table`)."""
    sources: dict[int, dict[str, Any]] = {}
    for i, j in find_duplicates(tensors).items():
        sources[i] = {"copy": j}
    for i, j in find_casts(tensors, skip=set(sources)).items():
        sources[i] = {"cast": j}
    summed = [i for i, s in sources.items() if "cast" in s]  # tensors whose entries record their checksum here
    positions = [i for i in range(len(tensors)) if i not in sources]
    encoded = {i: tensors[i] for i in positions}
    counts: dict[int, torch.Tensor] = {}  # non-zero elements of residues that may be coded sparse
    bases = []
    if base is not None:
        pairs = []
        for i in positions:
            b = base.tensors.get(names[i])
            if b is not None and b.dtype == tensors[i].dtype and b.shape == tensors[i].shape and tensors[i].numel():
                pairs.append((i, b))
        datas = [tensor_bytes(tensors[i]) for i, _ in pairs]
        base_datas = [tensor_bytes(b) for _, b in pairs]
        pays = deltas_that_pay(datas, base_datas, [tensors[i].element_size() for i, _ in pairs])
        for (i, _), data, base_data, ok in zip(pairs, datas, base_datas, pays):
            if ok:
                t = tensors[i]
                summed.append(i)
                sources[i] = {"xor": {"base": 0, "tensor": names[i]}}
                residue = xor_bytes(data, base_data.to(t.device))
                encoded[i] = residue.view(t.dtype).view(t.shape)
                count = nonzero_count(residue, t.element_size())
                if count is not None:
                    counts[i] = count
        bases = [base.ref] if any("xor" in s for s in sources.values()) else []
    checksums = _checksums(tensors, summed)
    # one host copy per device for the checksums and the counts
    host = _on_host({**{("checksum", i): v for i, v in checksums.items()},
                     **{("count", i): v for i, v in counts.items()}})
    nonzero = {i: host[("count", i)] for i in counts}
    sparse = [nonzero[i] if i in nonzero and codes_sparse(nonzero[i], tensors[i].numel()) else None for i in positions]
    return Table(len(tensors), positions, [names[i] for i in positions], [encoded[i] for i in positions],
                 names, [Layout.of(t) for t in tensors], sources, {i: host[("checksum", i)] for i in checksums}, bases,
                 sparse)


def _checksums(tensors: list[torch.Tensor], positions: list[int]) -> dict[int, torch.Tensor]:
    """wsum64 of ``tensors`` at ``positions`` (0-d int64 on their devices, no host sync): one
    batched pass per device (a delta save of a few hundred tensors made five launches each)."""
    by_device: dict[torch.device, list[int]] = {}
    out: dict[int, torch.Tensor] = {}
    for i in positions:
        if tensors[i].numel():
            by_device.setdefault(tensors[i].device, []).append(i)
        else:
            out[i] = torch.zeros((), dtype=torch.int64, device=tensors[i].device)
    for members in by_device.values():
        out.update(zip(members, tensor_sums([tensor_bytes(tensors[i]) for i in members]).unbind()))
    return out


def _on_host(values: dict[K, torch.Tensor]) -> dict[K, int]:
    """0-d tensors as ints, one copy per device: a table may be completed later, on another thread."""
    by_device: dict[torch.device, list[K]] = {}
    for k, v in values.items():
        by_device.setdefault(v.device, []).append(k)
    out: dict[K, int] = {}
    for keys in by_device.values():
        out.update(zip(keys, torch.stack([values[k] for k in keys]).cpu().tolist()))
    return out


# ----------------------------------------------------------------------------------------- load


class LoadPlan:
    """Which stored entries a read decodes (the wanted ones and what they are rebuilt from), and
    how the others are rebuilt from them once decoded."""

    def __init__(self, tensors: list[TensorEntry], bases: Sequence[BaseRef], indices: list[int],
                 devices: list[torch.device], base_tensors: Sequence[Mapping[str, torch.Tensor]] | None) -> None:
        self._tensors = tensors
        self._bases = bases
        self._base_tensors = base_tensors
        self._device: dict[int, torch.device] = {}
        for i, device in zip(indices, devices):
            self._need(i, device)
        self.stored = [i for i in self._device if not tensors[i].is_reference]
        for i in self.stored:
            if tensors[i].source_kind == "xor" and base_tensors is None:
                ref = bases[tensors[i].source_target["base"]]
                raise MissingBaseError(
                    f"tensor {tensors[i].name!r} is stored as an XOR delta against the base checkpoint "
                    f"{ref.describe()}, which was not given: restore it through the CheckpointManager of its "
                    "directory (restore(step) loads the base chain)"
                )

    def _need(self, i: int, device: torch.device) -> None:
        self._device.setdefault(i, device)
        source = self._tensors[i].source or {}
        for kind in ("copy", "cast"):
            if kind in source:
                self._need(source[kind], device)

    @property
    def entries(self) -> list[TensorEntry]:
        """The stored entries to decode; an XOR entry checks the residue's checksum."""
        out = []
        for i in self.stored:
            entry = self._tensors[i]
            if entry.source_kind == "xor":
                entry = dataclasses.replace(entry, checksum=entry.source_target["checksum"])
            out.append(entry)
        return out

    @property
    def devices(self) -> list[torch.device]:
        return [self._device[i] for i in self.stored]

    def finish(self, decoded: list[torch.Tensor], indices: list[int]) -> list[torch.Tensor]:
        """Rebuild XOR entries, then casts, then copies, verify them, and return ``indices``'s tensors."""
        done = dict(zip(self.stored, decoded))
        for i in self.stored:
            if self._tensors[i].source_kind == "xor":
                done[i] = self._verified(i, self._apply_xor(i, done[i]))
        for kind in ("cast", "copy"):
            for i in self._device:
                entry = self._tensors[i]
                if entry.source_kind != kind:
                    continue
                target = done[entry.source_target].to(self._device[i])
                if kind == "cast":
                    done[i] = self._verified(i, cast(target, DTYPES[entry.dtype]))
                else:
                    done[i] = target.reshape(-1).view(torch.uint8).clone().view(DTYPES[entry.dtype]).reshape(entry.shape)
        return [done[i] for i in indices]

    def _apply_xor(self, i: int, residue: torch.Tensor) -> torch.Tensor:
        entry = self._tensors[i]
        source = entry.source_target
        ref = self._bases[source["base"]]
        assert self._base_tensors is not None  # __init__ refused XOR entries without bases
        base = self._base_tensors[source["base"]].get(source["tensor"])
        if base is None or base.numel() * base.element_size() != entry.nbytes:
            raise CorruptCheckpointError(
                f"tensor {entry.name!r} is a delta against tensor {source['tensor']!r} of base {ref.describe()}, "
                "which that base does not hold with the same size"
            )
        data = xor_bytes(tensor_bytes(residue), tensor_bytes(base.to(residue.device)))
        return data.view(residue.dtype).view(residue.shape)

    def _verified(self, i: int, tensor: torch.Tensor) -> torch.Tensor:
        entry = self._tensors[i]
        got = format_wsum64(int(wsum64_tensor(tensor_bytes(tensor))))
        if got != entry.checksum:
            raise CorruptCheckpointError(
                f"tensor {entry.name!r} ({entry.source_kind} of another tensor) rebuilt with checksum {got}, "
                f"expected {entry.checksum}; the file or its base is damaged"
            )
        return tensor
