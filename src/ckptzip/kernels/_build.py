"""Compile the engine's Triton kernels ahead of time into ``cubins/`` (``make kernels``): every
variant the engine launches, for every architecture in ARCHS, with the manifest that
:mod:`._aot` reads. Needs Triton (its compiler and the ``ptxas`` it ships), not a GPU:

    python -m ckptzip.kernels._build [--archs 80,90,...]

Run it after changing ``_planes_triton.py``, ``_segments_triton.py`` or ``_ckzhuff_triton.py``: until then the manifest's
digest no longer matches and every GPU compiles with Triton as before (a test says so).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from typing import Any

import zstandard

from . import _aot, ckzhuff, planes, segments

# sm_80 A100 (and 8.6/8.9 with it), sm_90 Hopper, sm_100 B200/GB200, sm_103 B300, sm_120 RTX 50 and
# RTX PRO, sm_121 DGX Spark.
ARCHS = (80, 90, 100, 103, 120, 121)
_PARAM = re.compile(r"\.param\s+\.(\w+)")


Variant = tuple[str, str, dict[str, str], dict[str, object], "int | None"]


def variants() -> Iterator[Variant]:
    """Each variant the engine launches: its module, kernel, argument types, constants and warps
    (None: Triton's default)."""
    table = {"table": "*i64", "partial": "*i64"}
    for k in (2, 4, 8):
        yield ("_planes_triton", "split_kernel", {**table, "hist": "*i32"},
               {"K": k, "E": planes.ELEMENTS_PER_BLOCK, "ITERS": planes.BLOCKS_PER_PROGRAM,
                "SAMPLE_EVERY": planes.SAMPLE_EVERY}, None)
        yield ("_planes_triton", "merge_kernel", table,
               {"K": k, "E": planes.ELEMENTS_PER_BLOCK, "ITERS": planes.BLOCKS_PER_PROGRAM}, None)
    for kernel in ("segments_kernel", "segments_words_kernel"):
        for gather in (False, True):
            yield ("_segments_triton", kernel, table, {"BLOCK": segments.BLOCK, "ITERS": segments.ITERS,
                                                        "GATHER": gather}, None)
    yield ("_segments_triton", "gather_bytes_kernel", {"addresses": "*i64", "out": "*u8", "n": "i64"},
           {"BLOCK": segments.GATHER_BLOCK}, None)
    yield from ckzhuff.variants()


def params(ptx: str, entry: str) -> list[str]:
    """The types of an entry's parameters, in order, from its PTX."""
    head = ptx[ptx.index(f".entry {entry}(") :]
    return _PARAM.findall(head[: head.index(")")])


def compile_one(module: str, kernel: str, types: dict[str, str], constants: dict[str, object], arch: int,
                warps: int | None = None) -> tuple[bytes, dict[str, Any]]:
    """One variant's machine code for ``arch`` and its manifest entry (less the file name)."""
    import triton
    from triton.backends.compiler import GPUTarget

    fn = getattr(importlib.import_module(f"{__package__}.{module}"), kernel)
    signature = {**types, **dict.fromkeys(constants, "constexpr")}
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constants)
    target = GPUTarget("cuda", arch, 32)
    wanted: dict[str, object] = {"enable_fp_fusion": False}  # integer kernels
    if warps is not None:
        wanted["num_warps"] = warps
    options = triton.compiler.make_backend(target).parse_options(wanted)
    compiled = triton.compile(source, target=target, options=options.__dict__)
    meta = compiled.metadata
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        raise RuntimeError(f"{kernel} needs Triton's scratch memory, which launches outside Triton do not give it")
    return compiled.asm["cubin"], {"entry": meta.name, "params": params(compiled.asm["ptx"], meta.name),
                                   "warps": meta.num_warps, "shared": meta.shared}


def build(archs: tuple[int, ...] = ARCHS) -> dict[str, Any]:
    """Compile every variant for ``archs`` into a fresh ``cubins/``; the manifest written. Without
    line information: it would carry the absolute path of the checkout that built them."""
    os.environ["TRITON_DISABLE_LINE_INFO"] = "1"
    import triton

    folder = _aot.FOLDER
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    packer = zstandard.ZstdCompressor(level=19)
    kernels: dict[str, dict[str, Any]] = {}
    for module, kernel, types, constants, warps in variants():
        key = _aot.variant_key(kernel, constants)
        for arch in archs:
            image, entry = compile_one(module, kernel, types, constants, arch, warps)
            entry["file"] = f"{key.replace('[', '-').replace(']', '').replace(',', '-').replace('=', '')}-sm{arch}.zst"
            (folder / entry["file"]).write_bytes(packer.compress(image))
            kernels.setdefault(key, {})[f"sm{arch}"] = entry
    manifest = {"sources": _aot.sources_digest(), "triton": triton.__version__,
                "archs": [f"sm{a}" for a in archs], "kernels": kernels}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", default=",".join(map(str, ARCHS)), help="compute capabilities, e.g. 80,90")
    manifest = build(tuple(int(a) for a in parser.parse_args().archs.split(",")))
    count = sum(len(v) for v in manifest["kernels"].values())
    print(f"{count} kernels for {', '.join(manifest['archs'])} with Triton {manifest['triton']} in {_aot.FOLDER.name}/")


if __name__ == "__main__":
    main()
