"""Check ckptzip's nvCOMP codecs (the C API through ctypes) against nvCOMP's own Python module.

For every GPU codec configuration and a few kinds of checkpoint bytes (an fp32 exponent plane, a
mantissa plane, bf16 weights, a mostly-zero residue), chunks are coded by ckptzip and by
``nvidia.nvcomp`` (raw bitstream, the same chunk capacity): the probe reports whether the coded
bytes are identical and whether each side decodes the other's chunks bit-exactly. Needs a CUDA
GPU and ``nvidia-nvcomp-cu12/13``. Exit status 1 on any chunk that does not cross-decode.
Usage: python bench/nvcomp_interop_probe.py [--mib 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np
import torch

from ckptzip.codecs import get_codec
from ckptzip.codecs import nvcomp as gpu

PYTHON_NAMES = {"zstd": "Zstd", "deflate": "Deflate", "lz4": "LZ4", "ans": "ANS", "bitcomp": "Bitcomp",
                "gdeflate": "GDeflate", "cascaded": "Cascaded"}
CONFIGS: list[dict[str, Any]] = [
    {"id": "zstd"}, {"id": "lz4"},
    *({"id": "deflate", "algorithm_type": t} for t in (0, 1, 5)),
    *({"id": "gdeflate", "algorithm_type": t} for t in (0, 1, 2, 5)),
    *({"id": "ans", "data_type": t} for t in ("|u1", "<f2", "<f4")),
    *({"id": "bitcomp", "algorithm_type": a, "data_type": t} for a in (0, 1) for t in ("|u1", "<u2", "<f4")),
    *({"id": "cascaded", "data_type": t} for t in ("|u1", "<u2", "<u4")),
]


def datasets(mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    n = (mib << 20) // 4
    weights = torch.randn(n, generator=g, device="cuda") * 0.02
    planes = weights.view(torch.uint8).view(-1, 4)
    residue = torch.zeros(n, dtype=torch.float32, device="cuda")
    residue[torch.randint(0, n, (n // 100,), generator=g, device="cuda")] = 1e-4
    return {"fp32 exponent plane": planes[:, 3].contiguous(), "fp32 mantissa plane": planes[:, 0].contiguous(),
            "bf16 weights": weights[: n // 2].to(torch.bfloat16).view(torch.uint8).contiguous(),
            "sparse residue": residue.view(torch.uint8)}


def chunking(codec: Any, data: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    size = min(getattr(codec, "chunk_bytes", 1 << 16), 1 << 20)
    lengths = np.full(data.numel() // size, size, dtype=np.int64)
    tail = data.numel() - int(lengths.sum())
    if tail:
        lengths = np.r_[lengths, tail - tail % 16]
    return (np.cumsum(lengths) - lengths).astype(np.int64), lengths[lengths > 0]


def theirs(nv: Any, config: dict[str, Any], capacity: int) -> Any:
    options = {k: v for k, v in config.items() if k != "id"}
    return nv.Codec(algorithm=PYTHON_NAMES[config["id"]], device_id=torch.cuda.current_device(),
                    cuda_stream=torch.cuda.current_stream().cuda_stream, uncomp_chunk_size=capacity,
                    bitstream_kind=nv.BitstreamKind.RAW, **options)


def their_encode(nv: Any, codec: Any, data: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray) -> list[bytes]:
    stream = torch.cuda.current_stream().cuda_stream
    source = nv.as_arrays(data, offsets.tolist(), lengths.tolist(), cuda_stream=stream)
    probe = torch.empty(int(lengths.max()), dtype=torch.uint8, device="cuda")
    bound = int(codec.get_max_comp_buffer_size(nv.as_array(probe, cuda_stream=stream)))
    slot = -(-bound // 256) * 256
    out = torch.zeros(slot * lengths.size, dtype=torch.uint8, device="cuda")
    target = nv.as_arrays(out, [i * slot for i in range(lengths.size)], [bound] * lengths.size, cuda_stream=stream)
    sizes = [int(n) for n in codec.encode(source, out=target).buffer_sizes]
    host = out.cpu().numpy()
    return [host[i * slot : i * slot + n].tobytes() for i, n in enumerate(sizes)]


def their_decode(nv: Any, codec: Any, chunks: list[bytes], raw: np.ndarray) -> bytes:
    stream = torch.cuda.current_stream().cuda_stream
    src, src_offsets = _aligned(chunks)
    out = torch.empty(int(raw.sum()) + 256 * raw.size, dtype=torch.uint8, device="cuda")
    dst_offsets = np.cumsum(-(-raw // 256) * 256) - (-(-raw // 256) * 256)
    source = nv.as_arrays(src, src_offsets.tolist(), [len(c) for c in chunks], cuda_stream=stream)
    target = nv.as_arrays(out, dst_offsets.tolist(), raw.tolist(), cuda_stream=stream)
    try:  # the raw formats' decoders take the sizes from a configuration
        config = codec.decompression_config(codec.compression_config(raw.tolist()))
        codec.decode(source, out=target, decompression_config=config)
    except Exception:  # formats whose streams declare their sizes (zstd)
        codec.decode(source, out=target)
    host = out.cpu().numpy()
    return b"".join(host[o : o + n].tobytes() for o, n in zip(dst_offsets.tolist(), raw.tolist()))


def _aligned(chunks: list[bytes]) -> tuple[torch.Tensor, np.ndarray]:
    lengths = np.array([len(c) for c in chunks], dtype=np.int64)
    slots = -(-lengths // 256) * 256
    offsets = np.cumsum(slots) - slots
    host = np.zeros(int(slots.sum()), dtype=np.uint8)
    for o, c in zip(offsets.tolist(), chunks):
        host[o : o + len(c)] = np.frombuffer(c, dtype=np.uint8)
    return torch.from_numpy(host).cuda(), offsets


def check(nv: Any, config: dict[str, Any], name: str, data: torch.Tensor) -> dict[str, Any]:
    codec: Any = get_codec(config, "cuda")
    offsets, lengths = chunking(codec, data)
    out, out_offsets, sizes = codec.encode_segments(data, offsets, lengths)
    host = out.cpu().numpy()
    ours = [host[o : o + n].tobytes() for o, n in zip(out_offsets.tolist(), sizes.tolist())]
    raw = data.cpu().numpy()[: int(lengths.sum())].tobytes()
    row: dict[str, Any] = {"codec": config, "data": name, "chunks": int(lengths.size),
                           "ratio": round(len(raw) / max(1, sum(map(len, ours))), 4)}
    other = theirs(nv, config, codec._capacity(int(lengths.max())))
    their_chunks = their_encode(nv, other, data, offsets, lengths)
    row["identical"] = their_chunks == ours
    src, src_offsets = _aligned(their_chunks)
    dst = torch.empty(int(lengths.sum()), dtype=torch.uint8, device="cuda")
    codec.decode_segments(src, src_offsets, np.array([len(c) for c in their_chunks], dtype=np.int64),
                          dst, offsets, lengths)
    row["ours_decode_theirs"] = dst.cpu().numpy().tobytes() == raw
    row["theirs_decode_ours"] = their_decode(nv, other, ours, lengths) == raw
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()
    if gpu.UNAVAILABLE_REASON is not None:
        print(f"GPU codecs unavailable: {gpu.UNAVAILABLE_REASON}", file=sys.stderr)
        return 2
    from nvidia import nvcomp as nv

    rows = []
    for config in CONFIGS:
        for name, data in datasets(args.mib).items():
            try:
                row = check(nv, config, name, data)
            except Exception as exc:  # a probe: report every case
                row = {"codec": config, "data": name, "error": f"{type(exc).__name__}: {exc}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
    bad = [r for r in rows if "error" in r or not (r["ours_decode_theirs"] and r["theirs_decode_ours"])]
    print(f"{len(rows)} cases; identical bytes in {sum(bool(r.get('identical')) for r in rows)}; "
          f"{len(bad)} that do not cross-decode")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
