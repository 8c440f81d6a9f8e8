"""Triton's once-per-process cache key, remembered across processes.

Before a process's first kernel compile or cache lookup, Triton hashes its own compiler (about
100 files and libtriton, hundreds of MB), on the path of a fresh process's first save or restore
(results: "A filled GPU, a training job's conditions"). The key depends only on those files, so ckptzip keeps it in a small file named after the
files' sizes and modification times, and hands it to Triton the way Triton's own compile workers
receive it (``triton.runtime.cache.triton_key`` replaced by a function returning it). A changed
Triton install gets a new name and so a freshly computed key.

The file lives in ``CKPTZIP_CACHE_DIR``, else ``$XDG_CACHE_HOME/ckptzip``, else
``~/.cache/ckptzip``; ``CKPTZIP_CACHE_DIR=""`` (or a directory that cannot be written) turns
remembering off, and Triton then computes its key as usual.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

ENV = "CKPTZIP_CACHE_DIR"
_SUFFIXES = (".py", ".so")


def cache_dir() -> Path | None:
    """Where ckptzip keeps what it remembers across processes, or None when turned off."""
    chosen = os.environ.get(ENV)
    if chosen is not None:
        return Path(chosen) if chosen.strip() else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ckptzip"


def fingerprint(root: str, version: str) -> str:
    """A digest of the version and of every ``.py``/``.so`` file under ``root``: its path, size
    and modification time (a stat each, not a read: cheap against the hash it stands for)."""
    digest = hashlib.sha256(version.encode())
    for folder, folders, files in os.walk(root):
        folders.sort()
        for name in sorted(files):
            if name.endswith(_SUFFIXES):
                path = os.path.join(folder, name)
                stat = os.stat(path)
                digest.update(f"{os.path.relpath(path, root)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


def _read(path: Path, version: str) -> str | None:
    try:
        key = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return key if key.startswith(version) else None  # Triton's keys begin with its version


def _write(path: Path, key: str) -> bool:
    """``key`` into ``path`` atomically (a reader sees the whole key or none); False (and
    nothing written) where the directory cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".triton-key-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(key)
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError:
        return False
    return True


def install() -> Path | None:
    """Give this process's Triton its key: the remembered one where it exists, else computed
    now (Triton's own way) and remembered. Returns the file that holds it, or None where
    nothing was remembered (turned off, not writable, no Triton or a Triton without this key)."""
    try:
        import triton
        from triton.runtime import cache
    except ImportError:
        return None
    compute = getattr(cache, "triton_key", None)
    if compute is None:
        return None
    folder = cache_dir()
    if folder is None:
        compute()
        return None
    version = str(getattr(triton, "__version__", ""))
    try:
        path = folder / f"triton-key-{fingerprint(os.path.dirname(os.path.abspath(triton.__file__)), version)}"
    except OSError:  # a file that cannot be looked at: Triton hashes what it can itself
        compute()
        return None
    key = _read(path, version)
    kept = True
    if key is None:
        key = str(compute())
        kept = _write(path, key)
    cache.triton_key = lambda: key
    return path if kept else None
