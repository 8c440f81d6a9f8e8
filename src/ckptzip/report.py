"""Per-tensor and per-class ratio tables (``ckptzip inspect``, the demo)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .codecs import gpu_first_ids, gpu_only_ids
from .format import DTYPES, BaseRef, TensorEntry
from .transforms import Sparse


TENSOR_CLASSES = ("weights", "exp_avg", "exp_avg_sq", "gradients", "other")
_GRAD_ROOTS = frozenset({"grads", "gradients"})


def tensor_class(name: str, tensor: torch.Tensor) -> str:
    """Classify one entry of a flattened state by its dotted path and dtype.

    Rules, first match wins (``parts`` = ``name.split(".")``):

    1. not floating point, or 0-d  -> ``"other"`` (step counters, RNG bytes, integer buffers)
    2. last part ``exp_avg`` / ``exp_avg_sq`` -> that name (the two Adam moments)
    3. first part ``grads``/``gradients``, or last part ``grad`` -> ``"gradients"``
    4. any part starting with ``optim`` or ``lr_scheduler`` -> ``"other"``
    5. otherwise -> ``"weights"`` (model parameters, buffers, fp32 master weights)
    """
    parts = name.split(".")
    if not tensor.is_floating_point() or tensor.dim() == 0:
        return "other"
    if parts[-1] in ("exp_avg", "exp_avg_sq"):
        return parts[-1]
    if parts[0] in _GRAD_ROOTS or parts[-1] == "grad":
        return "gradients"
    if any(p.startswith("optim") or p == "lr_scheduler" for p in parts):
        return "other"
    return "weights"


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def pipeline_label(entry: TensorEntry, table: list[TensorEntry] | None = None) -> str:
    """Short description of how a tensor is stored, e.g. 'planes[raw×3,ans]', 'zstd',
    'cast of master.w', 'copy of w', or 'xor+planes[…]' for an XOR delta, 'xor+sparse(1.5%)[…]'
    for one coded sparse (its share of non-zero elements; ``table``: the whole tensor table, to
    name the entries references point at)."""
    kind = entry.source_kind
    if kind in ("copy", "cast"):
        target = entry.source_target
        return f"{kind} of {table[target].name if table else f'#{target}'}"
    ids = entry.codecs
    prefix = "xor+" if kind == "xor" else ""
    if entry.transform is None:
        return prefix + (ids[0] if ids else "raw")
    runs: list[tuple[str, int]] = []
    for codec_id in ids:
        if runs and runs[-1][0] == codec_id:
            runs[-1] = (codec_id, runs[-1][1] + 1)
        else:
            runs.append((codec_id, 1))
    return prefix + _transform_label(entry) + "[" + ",".join(c if n == 1 else f"{c}×{n}" for c, n in runs) + "]"


def _transform_label(entry: TensorEntry) -> str:
    """'planes', or 'sparse(share of non-zero elements)'."""
    sparse = entry.transform
    if not isinstance(sparse, Sparse):
        return "planes"
    elements = entry.nbytes // sparse.itemsize
    return f"sparse({100 * sparse.count / max(elements, 1):.2g}%)"


def classify(entry: TensorEntry) -> str:
    """Tensor class of a table entry (weights, exp_avg, exp_avg_sq, gradients, other)."""
    return tensor_class(entry.name, torch.empty(entry.shape, dtype=DTYPES[entry.dtype], device="meta"))


@dataclass
class ClassTotal:
    tensors: int = 0
    nbytes: int = 0
    compressed: int = 0

    @property
    def ratio(self) -> float:
        return self.nbytes / self.compressed if self.compressed else 1.0


def class_totals(entries: Iterable[TensorEntry]) -> dict[str, ClassTotal]:
    """Totals per tensor class, in the order of ``TENSOR_CLASSES``, plus 'total'."""
    totals = {name: ClassTotal() for name in (*TENSOR_CLASSES, "total")}
    for e in entries:
        for key in (classify(e), "total"):
            totals[key].tensors += 1
            totals[key].nbytes += e.nbytes
            totals[key].compressed += e.compressed_nbytes
    return {k: v for k, v in totals.items() if v.tensors}


def _table(rows: list[list[str]], right: set[int]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def entry_ratio(entry: TensorEntry) -> float | None:
    """Decoded over stored bytes of one tensor; None for a copy or cast, which stores none."""
    if entry.is_reference and entry.nbytes:
        return None
    return entry.nbytes / entry.compressed_nbytes if entry.compressed_nbytes else 1.0


def tensor_table(entries: list[TensorEntry], limit: int | None = None) -> str:
    """One row per tensor: name, dtype, shape, bytes, compressed, ratio, codec, class."""
    rows = [["tensor", "dtype", "shape", "bytes", "compressed", "ratio", "codec", "class"]]
    shown = entries if limit is None else sorted(entries, key=lambda e: -e.nbytes)[:limit]
    for e in shown:
        ratio = entry_ratio(e)
        rows.append([
            e.name, e.dtype, "×".join(map(str, e.shape)) or "()", human_bytes(e.nbytes),
            human_bytes(e.compressed_nbytes), "-" if ratio is None else f"{ratio:.3f}", pipeline_label(e, entries),
            classify(e),
        ])
    return _table(rows, right={3, 4, 5})


def class_table(entries: list[TensorEntry]) -> str:
    """Totals by tensor class with ratios."""
    rows = [["class", "tensors", "bytes", "compressed", "ratio"]]
    for name, t in class_totals(entries).items():
        rows.append([name, str(t.tensors), human_bytes(t.nbytes), human_bytes(t.compressed), f"{t.ratio:.3f}"])
    return _table(rows, right={1, 2, 3, 4})


SOURCE_KINDS = {"cast": "stored as casts of fp32 tensors", "copy": "duplicates stored once",
                "xor": "stored as XOR deltas"}


@dataclass
class SourceTotal:
    """The tensors stored by reference of one kind (``SOURCE_KINDS``)."""

    tensors: int = 0
    nbytes: int = 0
    not_stored: int = 0  # bytes the references spare
    sparse: int = 0  # XOR deltas coded sparse


def source_totals(entries: Iterable[TensorEntry]) -> dict[str, SourceTotal]:
    """Per kind of reference the file holds (casts, duplicates, XOR deltas), its totals."""
    totals: dict[str, SourceTotal] = {}
    for e in entries:
        if e.source_kind is not None:
            total = totals.setdefault(e.source_kind, SourceTotal())
            total.tensors += 1
            total.nbytes += e.nbytes
            total.not_stored += e.nbytes - e.compressed_nbytes
            total.sparse += isinstance(e.transform, Sparse)
    return {kind: totals[kind] for kind in SOURCE_KINDS if kind in totals}


def sources_note(entries: list[TensorEntry], bases: list[BaseRef]) -> str:
    """What the file stores by reference: casts, duplicates, XOR deltas and the bases they need."""
    lines = []
    for kind, t in source_totals(entries).items():
        lines.append(f"{SOURCE_KINDS[kind]}: {t.tensors} tensors, {human_bytes(t.nbytes)} "
                     f"({human_bytes(t.not_stored)} not stored{f'; {t.sparse} coded sparse' if t.sparse else ''})")
    for ref in bases:
        lines.append(f"needs base checkpoint {ref.describe()} (restore through its CheckpointManager)")
    return "\n".join(lines) or "every tensor is stored as itself (no references, duplicates or deltas)"


@dataclass(frozen=True)
class Portability:
    """Where a file loads: ``gpu_only`` codecs need a GPU; ``compiled`` ones a GPU or ckptzip's C decoder."""

    gpu_only: list[str]
    compiled: list[str]

    @property
    def note(self) -> str:
        """Whether the file loads without a GPU, and how to make it do so if not."""
        if self.gpu_only:
            return (
                f"GPU-only codecs: {', '.join(self.gpu_only)}; loading needs an NVIDIA GPU with nvCOMP "
                "(ckptzip[gpu]). For CPU use: ckptzip convert SRC DST --codec portable"
            )
        if self.compiled:
            return (
                f"loads on a GPU or, for {', '.join(self.compiled)}, on a CPU where ckptzip was built with its C "
                "decoder (any install from source with a C compiler); elsewhere: ckptzip convert SRC DST --codec portable"
            )
        return "portable: every codec has a CPU decoder; loads on any machine"


def portability(entries: list[TensorEntry]) -> Portability:
    codecs = {c for e in entries for c in e.codecs}
    return Portability(sorted(codecs & gpu_only_ids()), sorted(codecs & gpu_first_ids()))


def portability_note(entries: list[TensorEntry]) -> str:
    """Whether the file loads without a GPU, and how to make it do so if not."""
    return portability(entries).note
