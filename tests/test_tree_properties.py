"""Property tests (issue 24): the tree section (aliases, sizes, devices) decodes to values or
raises CorruptCheckpointError, never another error; the manager lists exactly the canonical step
files of a directory, whatever else (names, links, special files) lies there."""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from helpers import load_bytes, rewrite_index, save_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptzip.errors import CkptzipError, CorruptCheckpointError
from ckptzip.manager import CheckpointManager, IgnoredFileWarning
from ckptzip.tree import unflatten

INTS = st.one_of(st.integers(-3, 40), st.integers(2**62, 2**65), st.integers(-(2**64), -1))
DEVICES = st.one_of(st.sampled_from(["cpu", "meta", "cuda", "cuda:7", "cpu:0", "mps", "", "toaster", "cpu:-1",
                                     "cuda:99999999999999999999"]), st.text(max_size=12))
LEAVES = st.one_of(
    st.none(), st.booleans(), INTS, st.text(max_size=4),
    st.builds(lambda k: {"alias": k}, st.one_of(INTS, st.text(max_size=2), st.none())),
    st.builds(lambda s: {"size": s}, st.one_of(st.lists(INTS, max_size=4), INTS, st.text(max_size=2))),
    st.builds(lambda d: {"device": d}, st.one_of(DEVICES, INTS)),
    st.builds(lambda i: {"tensor": i}, INTS),
)
TREES = st.recursive(
    LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.builds(lambda xs: {"tuple": xs}, st.lists(inner, max_size=4)),
        st.builds(lambda kv: {"dict": kv}, st.lists(st.lists(inner, min_size=2, max_size=2), max_size=3)),
        st.builds(lambda kv, meta: {"odict": kv, "meta": meta},
                  st.lists(st.lists(inner, min_size=2, max_size=2), max_size=3), inner),
    ),
    max_leaves=20,
)


@settings(max_examples=400, deadline=None)
@given(TREES)
def test_any_tree_decodes_or_is_corrupt(tree: Any) -> None:
    tensors = [torch.arange(3), torch.ones(2)]
    try:
        value = unflatten(tree, tensors.__getitem__, len(tensors))
    except CorruptCheckpointError:
        return
    str(value)  # every value decoded is a value: a torch.Size of 2**64 could not even be printed


@settings(max_examples=60, deadline=None)
@given(DEVICES, st.sampled_from([None, "cpu"]))
def test_any_index_device_loads_or_raises_a_ckptzip_error(device: str, map_location: str | None) -> None:
    def edit(index: dict[str, Any]) -> None:
        index["tensors"][0]["device"] = device

    blob = rewrite_index(save_bytes({"w": torch.arange(4.0)}), edit)
    try:
        out = load_bytes(blob, map_location=map_location)
    except CkptzipError:
        return
    assert device != "meta" and torch.equal(out["w"], torch.arange(4.0)) and out["w"].device.type != "meta"


DIGITS = st.one_of(st.text("0123456789", min_size=1, max_size=11),
                   st.text("0123456789\u0660\u0669\uff10\uff19\u0966\u00b2 +-_", min_size=1, max_size=10))
NAMES = st.one_of(
    st.builds(lambda d, tail: f"step_{d}{tail}", DIGITS, st.sampled_from([".ckz", ".ckz", ".CKZ", ".ckz.tmp", "",
                                                                          ".ckz.commit", "ckz"])),
    st.text(st.characters(blacklist_characters="/\0", codec="utf-8"), min_size=1, max_size=12),
)
KINDS = st.sampled_from(["file", "link", "dangling", "fifo", "directory"])


def _canonical(name: str) -> bool:
    digits = name[5:-4]
    return (name.startswith("step_") and name.endswith(".ckz") and digits.isascii() and digits.isdigit()
            and (len(digits) == 8 or (len(digits) > 8 and digits[0] != "0")))


def _make(root: Path, name: str, kind: str) -> None:
    path = root / name
    if kind == "file":
        path.write_bytes(b"x")
    elif kind == "link":
        (root.parent / "target").write_bytes(b"x")
        path.symlink_to(root.parent / "target")
    elif kind == "dangling":
        path.symlink_to(root.parent / "nowhere")
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(NAMES, KINDS, max_size=8))
def test_the_manager_lists_exactly_the_canonical_step_files(entries: dict[str, str]) -> None:
    with tempfile.TemporaryDirectory() as top:
        root = Path(top) / "run"
        root.mkdir()
        made = {}
        for name, kind in entries.items():
            if name in (".", "..") or len(name.encode()) > 255:
                continue
            _make(root, name, kind)
            made[name] = kind
        expected = sorted(int(n[5:-4]) for n, kind in made.items() if kind in ("file", "link") and _canonical(n))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", IgnoredFileWarning)
            manager = CheckpointManager(root)
            assert manager.all_steps() == expected
            assert manager.latest_step() == (expected[-1] if expected else None)
            newest = expected[-1] if expected else -1
            assert manager.should_save(newest + 1, every=1)  # checkpointing goes on after the newest real step
            if expected:
                assert not manager.should_save(newest, every=1)
