"""Real training state without downloads: byte-level text, small transformers, AdamW.

The corpus is the Python standard library's own ``.py`` sources on this machine, read as bytes
(vocabulary 256) in sorted path order. Two decoder-only models share one code path: a dense one
(pre-LN, causal attention, GELU MLP) and a mixture-of-experts one (top-k router over ``n_experts``
expert MLPs). :func:`train` runs AdamW with a cosine schedule and returns everything a user would
checkpoint; :func:`training_state` assembles that state dict.

Determinism: on CPU, the same config, seed and thread count give bit-identical state. :func:`train`
seeds torch's global RNG (as a training script does), so the ``rng`` entry of the state is
reproducible too.
"""

from __future__ import annotations

import functools
import os
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CkptzipError
from ..report import TENSOR_CLASSES, tensor_class

__all__ = [
    "PRESETS",
    "TENSOR_CLASSES",
    "ModelConfig",
    "TrainResult",
    "Transformer",
    "count_parameters",
    "get_preset",
    "load_corpus",
    "state_nbytes",
    "tensor_class",
    "train",
    "training_state",
]

DEFAULT_CORPUS_BYTES = 16 << 20


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a byte-level decoder-only transformer; ``n_experts > 0`` makes it a mixture of experts."""

    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    n_experts: int = 0
    top_k: int = 2
    mlp_ratio: int = 4
    vocab_size: int = 256

    def __post_init__(self) -> None:
        for field in ("d_model", "n_layers", "n_heads", "seq_len", "mlp_ratio", "vocab_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"ModelConfig.{field} must be >= 1, got {getattr(self, field)}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"ModelConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(
                f"ModelConfig.top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}"
            )

    @property
    def moe(self) -> bool:
        return self.n_experts > 0


PRESETS: dict[str, ModelConfig] = {
    # CPU: CI and the demo; trains a step in well under a second on 2 cores.
    "tiny": ModelConfig(d_model=128, n_layers=6, n_heads=4, seq_len=128),
    "tiny-moe": ModelConfig(d_model=128, n_layers=4, n_heads=4, seq_len=128, n_experts=4),
    # GPU benchmark sizes; "medium" matches the ~206M-parameter dense model of the GPU notes.
    "small": ModelConfig(d_model=512, n_layers=16, n_heads=8, seq_len=512),
    "small-moe": ModelConfig(d_model=512, n_layers=6, n_heads=8, seq_len=512, n_experts=8, mlp_ratio=2),
    "medium": ModelConfig(d_model=1024, n_layers=16, n_heads=16, seq_len=1024),
    "medium-moe": ModelConfig(d_model=768, n_layers=8, n_heads=12, seq_len=1024, n_experts=8, mlp_ratio=2),
    "large": ModelConfig(d_model=2048, n_layers=24, n_heads=16, seq_len=1024),
}


def get_preset(name: str) -> ModelConfig:
    """Return the named preset; raises ``ValueError`` listing the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; expected one of {', '.join(PRESETS)}") from None


# --------------------------------------------------------------------------------------- corpus


def _stdlib_sources(root: Path) -> Iterator[Path]:
    """``.py`` files under ``root`` in sorted order, skipping installed third-party packages."""
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "dist-packages"))
        for name in sorted(files):
            if name.endswith(".py"):
                yield Path(directory, name)


@functools.lru_cache(maxsize=2)
def _corpus_bytes(max_bytes: int) -> bytes:
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[bytes] = []
    total = 0
    for path in _stdlib_sources(root):
        if total >= max_bytes:
            break
        data = path.read_bytes()[: max_bytes - total]
        parts.append(data)
        total += len(data)
    return b"".join(parts)


def load_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES) -> torch.Tensor:
    """The standard library's Python sources as a 1-D ``uint8`` tensor of at most ``max_bytes``."""
    data = _corpus_bytes(max_bytes)
    if len(data) < 2:
        root = sysconfig.get_paths()["stdlib"]
        raise CkptzipError(
            f"found no Python sources under the standard library path {root!r} to train on; "
            "expected .py files there (a full CPython install has them)"
        )
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())


# --------------------------------------------------------------------------------------- models


class _Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (
            t.view(batch, length, self.n_heads, width // self.n_heads).transpose(1, 2)
            for t in self.qkv(x).split(width, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(batch, length, width))
        return out


class _MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.mlp_ratio * config.d_model, bias=False)
        self.proj = nn.Linear(config.mlp_ratio * config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.proj(F.gelu(self.fc(x))), x.new_zeros(())


class _MoE(nn.Module):
    """Top-k routed experts, stored as two stacked parameters so every expert always has a gradient."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.top_k = config.top_k
        self.router = nn.Linear(config.d_model, config.n_experts, bias=False)
        self.w_in = nn.Parameter(torch.empty(config.n_experts, config.d_model, hidden))
        self.w_out = nn.Parameter(torch.empty(config.n_experts, hidden, config.d_model))
        nn.init.normal_(self.w_in, std=config.d_model**-0.5)
        nn.init.normal_(self.w_out, std=hidden**-0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1, x.shape[-1])
        probs = self.router(flat).float().softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        n_experts = self.w_in.shape[0]
        for e in range(n_experts):
            token, slot = (experts == e).nonzero(as_tuple=True)
            h = F.gelu(flat[token] @ self.w_in[e]) @ self.w_out[e]
            out.index_add_(0, token, (h * weights[token, slot, None]).to(out.dtype))
        # Switch-style balance loss: fraction of routed slots times mean router probability.
        load = F.one_hot(experts, n_experts).float().mean(dim=(0, 1))
        aux = n_experts * (load * probs.mean(dim=0)).sum()
        return out.view_as(x), aux


class _Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = _Attention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = _MoE(config) if config.moe else _MLP(config)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.ln1(x))
        y, aux = self.mlp(self.ln2(x))
        return x + y, aux


class Transformer(nn.Module):
    """Byte-level decoder-only transformer; ``forward`` returns ``(logits, router_balance_loss)``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        aux = x.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            x, block_aux = block(x)
            aux = aux + block_aux
        return self.head(self.norm(x)), aux


def count_parameters(config: ModelConfig) -> int:
    """Parameter count of ``Transformer(config)``, built on the meta device (allocates nothing)."""
    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(config).parameters())


def state_nbytes(config: ModelConfig, *, include_grads: bool = True, bf16_weights: bool = False) -> int:
    """Bytes of weights + AdamW moments (+ grads) that :func:`train` produces for ``config``.

    fp32 layout: 4 (weights) + 8 (exp_avg, exp_avg_sq) + 4 (grads) bytes per parameter.
    bf16 layout: 2 (bf16 weights) + 4 (fp32 master) + 8 (moments) + 2 (bf16 grads).
    Scalars (step counters, RNG, scheduler) are left out: they are a few KB.
    """
    per_param = (2 + 4 + 8 + 2 * include_grads) if bf16_weights else (4 + 8 + 4 * include_grads)
    return count_parameters(config) * per_param


# ------------------------------------------------------------------------------------- training


@dataclass
class TrainResult:
    """What :func:`train` leaves behind; :meth:`state` is the dict a user would checkpoint."""

    config: ModelConfig
    model: Transformer
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LRScheduler
    step: int
    losses: list[float]
    seconds: float
    master_weights: dict[str, torch.Tensor] | None = None

    def state(self, *, include_grads: bool = True) -> dict[str, Any]:
        return training_state(
            self.model,
            self.optimizer,
            self.step,
            scheduler=self.scheduler,
            master_weights=self.master_weights,
            include_grads=include_grads,
        )


def training_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    *,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    master_weights: dict[str, torch.Tensor] | None = None,
    include_grads: bool = True,
) -> dict[str, Any]:
    """The full training state: model, fp32 master weights (if any), optimizer, grads, step, RNG, scheduler.

    Tensors are shared with the live model and optimizer, exactly as ``state_dict()`` shares them.
    """
    state: dict[str, Any] = {"model": model.state_dict()}
    if master_weights is not None:
        state["master_weights"] = master_weights
    state["optimizer"] = optimizer.state_dict()
    if include_grads:
        state["grads"] = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    state["step"] = step
    rng: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    state["rng"] = rng
    if scheduler is not None:
        state["lr_scheduler"] = scheduler.state_dict()
    return state


def _make_optimizer(
    named: list[tuple[str, torch.Tensor]], lr: float, device: torch.device
) -> torch.optim.AdamW:
    """AdamW with the usual two groups: weight decay on matrices only; fused on CUDA."""
    decay = [p for _, p in named if p.dim() >= 2]
    no_decay = [p for _, p in named if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), **fast)


def train(
    config: ModelConfig | str,
    steps: int,
    *,
    device: str | torch.device = "cpu",
    seed: int = 0,
    amp_bf16: bool | None = None,
    bf16_weights: bool = False,
    batch_size: int = 8,
    lr: float = 1e-3,
    corpus_bytes: int = DEFAULT_CORPUS_BYTES,
    on_step: Callable[[int], None] | None = None,
) -> TrainResult:
    """Train a fresh model for ``steps`` AdamW steps on the standard-library corpus.

    ``config`` is a :class:`ModelConfig` or a preset name (see :data:`PRESETS`). ``amp_bf16``
    runs forward/backward under bf16 autocast with fp32 weights; ``None`` means "on CUDA".
    ``bf16_weights`` keeps the model in bf16 and fp32 master weights beside the optimizer (the
    layout of large-model training), so the state holds bf16 weights, fp32 weights, fp32 moments
    and bf16 grads. Gradients of the last step are kept (not zeroed) so the state can include them.
    ``on_step(k)`` is called after step k (1-based), for progress.
    """
    if isinstance(config, str):
        config = get_preset(config)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    device = torch.device(device)
    corpus = load_corpus(corpus_bytes)
    if corpus.numel() <= config.seq_len + 1:
        raise ValueError(
            f"corpus_bytes={corpus_bytes} gives {corpus.numel()} bytes, fewer than seq_len + 2 "
            f"= {config.seq_len + 2}; raise corpus_bytes"
        )
    corpus = corpus.to(device)
    if amp_bf16 is None:
        amp_bf16 = device.type == "cuda" and not bf16_weights
    torch.manual_seed(seed)
    batches = torch.Generator().manual_seed(seed)

    model = Transformer(config).to(device)
    master: dict[str, torch.Tensor] | None = None
    named: list[tuple[str, torch.Tensor]] = list(model.named_parameters())
    if bf16_weights:
        master = {name: p.detach().clone() for name, p in named}
        model.to(torch.bfloat16)
        named = list(master.items())
    optimizer = _make_optimizer(named, lr, device)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps, eta_min=lr / 10)

    window = torch.arange(config.seq_len + 1, device=device)
    losses: list[torch.Tensor] = []
    start = time.perf_counter()
    for _ in range(steps):
        offsets = torch.randint(0, corpus.numel() - config.seq_len - 1, (batch_size, 1), generator=batches)
        chunk = corpus[offsets.to(device) + window].long()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp_bf16):
            logits, aux = model(chunk[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten())
        model.zero_grad(set_to_none=True)
        (loss + 0.01 * aux).backward()
        if master is not None:
            for p, m in zip(model.parameters(), master.values(), strict=True):
                m.grad = None if p.grad is None else p.grad.float()
        torch.nn.utils.clip_grad_norm_([p for _, p in named], 1.0, foreach=True)
        optimizer.step()
        scheduler.step()
        if master is not None:
            with torch.no_grad():
                for p, m in zip(model.parameters(), master.values(), strict=True):
                    p.copy_(m)
        losses.append(loss.detach())
        if on_step is not None:
            on_step(len(losses))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    if master is not None:
        for m in master.values():
            m.grad = None  # the state's grads are the model's (bf16) ones
    return TrainResult(
        config=config,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        step=steps,
        losses=torch.stack(losses).tolist(),
        seconds=seconds,
        master_weights=master,
    )
