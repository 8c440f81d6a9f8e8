"""Training state for the demo and the benchmark: corpus, models, AdamW state, tensor classes."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from ckptzip_bench.measure import assert_state_equal, iter_tensors
from ckptzip.demo.training import (
    PRESETS,
    TENSOR_CLASSES,
    ModelConfig,
    TrainResult,
    Transformer,
    count_parameters,
    get_preset,
    load_corpus,
    state_nbytes,
    tensor_class,
    train,
)


@pytest.fixture(scope="module")
def tiny() -> TrainResult:
    return train("tiny", 20, seed=0)


def test_corpus_is_capped_deterministic_python_source() -> None:
    small, large = load_corpus(4096), load_corpus(16384)
    assert small.dtype == torch.uint8 and small.shape == (4096,)
    assert large.shape == (16384,)
    assert torch.equal(small, large[:4096])
    assert b"import" in bytes(large.tolist())


def test_tiny_model_learns(tiny: TrainResult) -> None:
    assert len(tiny.losses) == 20 and tiny.step == 20
    # Uniform over 256 bytes is ln 256 = 5.55; 20 AdamW steps get well below it.
    assert tiny.losses[0] > 5.0
    assert sum(tiny.losses[-5:]) / 5 < tiny.losses[0] - 1.0


def test_state_layout_and_classes(tiny: TrainResult) -> None:
    state = tiny.state()
    assert list(state) == ["model", "optimizer", "grads", "step", "rng", "lr_scheduler"]
    n_params = len(list(tiny.model.parameters()))
    classes = Counter(tensor_class(path, t) for path, t in iter_tensors(state))
    assert set(classes) == set(TENSOR_CLASSES)
    assert classes["weights"] == len(state["model"])
    assert classes["exp_avg"] == classes["exp_avg_sq"] == classes["gradients"] == n_params
    assert state["step"] == 20
    assert state["rng"]["torch"].dtype == torch.uint8
    assert state["lr_scheduler"]["last_epoch"] == 20
    assert "grads" not in tiny.state(include_grads=False)
    dtypes = {t.dtype for path, t in iter_tensors(state) if tensor_class(path, t) != "other"}
    assert dtypes == {torch.float32}


def test_bf16_weights_layout_has_bf16_and_fp32_weights() -> None:
    result = train("tiny", 2, bf16_weights=True)
    state = result.state()
    assert list(state)[:4] == ["model", "master_weights", "optimizer", "grads"]
    by_class: dict[str, set[torch.dtype]] = {}
    for path, t in iter_tensors(state):
        by_class.setdefault(tensor_class(path, t), set()).add(t.dtype)
    assert by_class["weights"] == {torch.bfloat16, torch.float32}
    assert by_class["exp_avg"] == by_class["exp_avg_sq"] == {torch.float32}
    assert by_class["gradients"] == {torch.bfloat16}
    for name, p in result.model.named_parameters():
        assert torch.equal(p, state["master_weights"][name].to(torch.bfloat16))


def test_same_seed_gives_bit_identical_state() -> None:
    a = train("tiny", 3, seed=7).state()
    b = train("tiny", 3, seed=7).state()
    assert_state_equal(a, b)
    c = train("tiny", 3, seed=8).state()
    with pytest.raises(AssertionError, match="tensor bytes differ"):
        assert_state_equal(a, c)


def test_moe_routes_over_experts_and_learns() -> None:
    config = get_preset("tiny-moe")
    result = train(config, 8)
    assert result.losses[-1] < result.losses[0] - 0.5
    experts = result.model.blocks[0].mlp
    assert experts.w_in.shape == (config.n_experts, config.d_model, config.mlp_ratio * config.d_model)
    # Every expert slice received gradient: top-2 routing spread tokens over all experts.
    assert experts.w_in.grad is not None
    assert all(experts.w_in.grad[e].abs().sum() > 0 for e in range(config.n_experts))


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_count_parameters_matches_the_built_model(name: str) -> None:
    config = PRESETS[name]
    assert count_parameters(config) == sum(p.numel() for p in Transformer(config).parameters())


def test_preset_sizes() -> None:
    assert 1_000_000 <= count_parameters(PRESETS["tiny"]) <= 3_000_000
    assert 40e6 <= count_parameters(PRESETS["small"]) <= 60e6
    assert 180e6 <= count_parameters(PRESETS["medium"]) <= 230e6
    assert count_parameters(PRESETS["large"]) >= 1e9
    # The GPU benchmark needs >= 2 GB of fp32 weights + AdamW moments, without grads.
    assert state_nbytes(PRESETS["medium"], include_grads=False) >= 2e9
    assert state_nbytes(PRESETS["medium-moe"], include_grads=False) >= 2e9
    assert state_nbytes(PRESETS["tiny"]) == 16 * count_parameters(PRESETS["tiny"])


@pytest.mark.parametrize(
    ("path", "tensor", "expected"),
    [
        ("model.blocks.0.attn.qkv.weight", torch.zeros(4, 4), "weights"),
        ("model.embed.weight", torch.zeros(4, 4, dtype=torch.bfloat16), "weights"),
        ("master_weights.head.weight", torch.zeros(4, 4), "weights"),
        ("blocks.0.ln1.bias", torch.zeros(4), "weights"),
        ("optimizer.state.3.exp_avg", torch.zeros(4), "exp_avg"),
        ("optimizer.state.3.exp_avg_sq", torch.zeros(4), "exp_avg_sq"),
        ("optimizer_states.0.state.1.exp_avg", torch.zeros(4), "exp_avg"),
        ("optimizer.state.3.step", torch.zeros(()), "other"),
        ("optimizer.state.3.momentum_buffer", torch.zeros(4), "other"),
        ("grads.blocks.0.mlp.fc.weight", torch.zeros(4, 4), "gradients"),
        ("layer.weight.grad", torch.zeros(4), "gradients"),
        ("rng.torch", torch.zeros(16, dtype=torch.uint8), "other"),
        ("model.position_ids", torch.zeros(4, dtype=torch.int64), "other"),
    ],
)
def test_tensor_class_rules(path: str, tensor: torch.Tensor, expected: str) -> None:
    assert tensor_class(path, tensor) == expected


def test_invalid_configs_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"d_model \(100\) must be divisible by n_heads \(3\)"):
        ModelConfig(d_model=100, n_layers=1, n_heads=3, seq_len=8)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, n_experts=2\], got 3"):
        ModelConfig(d_model=8, n_layers=1, n_heads=2, seq_len=8, n_experts=2, top_k=3)
    with pytest.raises(ValueError, match="unknown model preset 'huge'; expected one of tiny, tiny-moe"):
        get_preset("huge")
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        train("tiny", 0)
    with pytest.raises(ValueError, match=r"corpus_bytes=100 gives 100 bytes, fewer than seq_len \+ 2 = 130"):
        train("tiny", 1, corpus_bytes=100)
