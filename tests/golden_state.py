"""The deterministic state stored in the committed golden files (tests/golden/*.ckz).

Built from integer arithmetic only, so every machine makes the same bits.
"""

from __future__ import annotations

import collections

import numpy as np
import torch


def _lcg(n: int, seed: int) -> np.ndarray:
    """n pseudo-random uint32 from a fixed linear congruential generator (exact on any machine)."""
    out = np.empty(n, dtype=np.uint64)
    state = np.uint64(seed)
    a, c, m = np.uint64(6364136223846793005), np.uint64(1442695040888963407), np.uint64(1 << 32)
    block = np.arange(n, dtype=np.uint64)
    out = (block * a + c + state) * a + c  # wraps mod 2**64
    return ((out >> np.uint64(29)) % m).astype(np.uint32)


def _weights(n: int, seed: int, exponent_spread: int) -> torch.Tensor:
    """float32 bit patterns with realistic structure: few exponents, random mantissas, both signs."""
    r = _lcg(n, seed)
    mantissa = r & np.uint32(0x7FFFFF)
    exponent = np.uint32(120) + (r >> np.uint32(23)) % np.uint32(exponent_spread)
    sign = (r >> np.uint32(31)) << np.uint32(31)
    bits = sign | (exponent << np.uint32(23)) | mantissa
    return torch.from_numpy(bits.view(np.float32).copy())


def golden_state() -> dict:
    """A small training-like state exercising every stored form: planes, raw, small, ints, values."""
    w = _weights(1 << 16, 1, 6).reshape(256, 256)
    m = _weights(1 << 16, 2, 10)
    v = _weights(1 << 16, 3, 4).abs()
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1.0, -2.5], dtype=torch.float32)
    special = torch.cat([special, torch.tensor([0x7FC00001, 0xFFC12345], dtype=torch.int64).to(torch.int32).view(torch.float32)])
    model = collections.OrderedDict(
        [
            ("embed.weight", w),
            ("embed.weight_bf16", w.to(torch.bfloat16)),
            ("norm.weight", torch.ones(256)),
            ("head.weight", w[:128].t().contiguous().half()),
        ]
    )
    return {
        "model": model,
        "optimizer": {
            "state": {0: {"step": torch.tensor(100.0), "exp_avg": m, "exp_avg_sq": v}},
            "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "params": [0]}],
        },
        "special": special,
        "tokens": torch.from_numpy(_lcg(5000, 4).astype(np.int64) % 50257),
        "mask": torch.from_numpy(_lcg(3000, 5) % 2 == 0),
        "fp8": torch.from_numpy((_lcg(8192, 6) % 256).astype(np.uint8)).view(torch.float8_e4m3fn),
        "step": 100,
        "note": "golden",
    }


def golden_state_2_1() -> dict:
    """The state of the format-2.1 golden files: the golden state (its bf16 embedding is the cast of
    the fp32 one) plus an fp32 master of the fp16 head, and a duplicate of a moment."""
    state = golden_state()
    state["head_master"] = state["model"]["head.weight"].float()  # fp16 -> fp32 is exact: head.weight is its cast
    state["exp_avg_copy"] = state["optimizer"]["state"][0]["exp_avg"].clone()
    return state


def golden_delta_state() -> dict:
    """``golden_state_2_1`` some steps later: the low mantissa byte of the weights changed; the
    golden delta file stores it as XOR deltas against cpu_zstd_v2_1_base.ckz."""
    state = golden_state_2_1()
    w = state["model"]["embed.weight"]
    bits = w.reshape(-1).view(torch.int32).numpy() ^ (_lcg(w.numel(), 7) & np.uint32(0xFF)).view(np.int32)
    later = torch.from_numpy(bits.copy()).view(torch.float32).reshape(w.shape)
    state["model"]["embed.weight"] = later
    state["model"]["embed.weight_bf16"] = later.to(torch.bfloat16)
    state["optimizer"]["state"][0]["step"] = torch.tensor(150.0)
    return state


def _flip_low_bits(t: torch.Tensor, seed: int, every: int) -> torch.Tensor:
    """``t`` with the lowest bit flipped in about one element of ``every`` (LCG-chosen)."""
    ints = {2: np.int16, 4: np.int32}[t.element_size()]
    bits = t.reshape(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()]).numpy()
    flip = (_lcg(t.numel(), seed) % np.uint32(every) == 0).astype(ints)
    return torch.from_numpy(bits ^ flip).view(t.dtype).reshape(t.shape)


def golden_sparse_delta_state() -> dict:
    """``golden_state_2_1`` a step of RL fine-tuning later: one element in 64 of the fp32 embedding
    and (apart) of its bf16 copy moved by one bit, the rest unchanged; the golden sparse delta file
    stores it as XOR deltas coded sparse (format 2.2) against cpu_zstd_v2_1_refs.ckz."""
    state = golden_state_2_1()
    model = state["model"]
    model["embed.weight"] = _flip_low_bits(model["embed.weight"], 8, 64)
    model["embed.weight_bf16"] = _flip_low_bits(model["embed.weight_bf16"], 9, 64)
    state["optimizer"]["state"][0]["step"] = torch.tensor(101.0)
    return state
