"""Megatron-Core integration: ``dist_checkpointing`` sharded state dicts saved on 2 gloo ranks with
the ckptzip backend and loaded back bit-exactly on 2 ranks and, resharded, on 1: a hand-made one
(tensor shards, a replicated tensor, optimizer moments, bf16, sharded objects, common state) and a
tensor-parallel GPTModel's with its Adam moments (Megatron builds one on the CPU; its forward pass,
DDP and distributed optimizer need CUDA: bench/megatron_gpu.py)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

with warnings.catch_warnings():  # Megatron warns at import that Transformer Engine and Apex are absent
    warnings.simplefilter("ignore", UserWarning)
    pytest.importorskip("megatron.core", reason="needs Megatron-Core: pip install 'ckptzip[megatron]'")
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from helpers import assert_same, random_tensor  # noqa: E402

from ckptzip.dcp import CompressedStorageReader  # noqa: E402
from ckptzip_bench.launch import launch  # noqa: E402
from ckptzip.format.spec import MAGIC  # noqa: E402
from ckptzip.integrations.megatron import BACKEND, CkptzipLoadShardedStrategy  # noqa: E402

pytestmark = pytest.mark.slow

ROWS = 6  # split 3/3 over two ranks


def _full() -> dict[str, torch.Tensor]:
    """The unsharded tensors, the same on every rank (arbitrary bits, NaN payloads included)."""
    return {
        "decoder.weight": random_tensor(torch.bfloat16, (ROWS, 8), seed=1),
        "decoder.bias": random_tensor(torch.float32, (8,), seed=2),
        "optimizer.exp_avg.decoder.weight": random_tensor(torch.float32, (ROWS, 8), seed=3),
        "optimizer.exp_avg_sq.decoder.weight": random_tensor(torch.float32, (ROWS, 8), seed=4),
    }


def _sharded(rank: int, world: int, fill: bool) -> dict[str, Any]:
    """A Megatron sharded state dict of this rank: rows split over the ranks, the bias replicated."""
    full = _full()
    rows = ROWS // world

    def shard(key: str) -> ShardedTensor:
        local = full[key][rank * rows:(rank + 1) * rows].clone()
        return ShardedTensor.from_rank_offsets(key, local if fill else torch.zeros_like(local), (0, rank, world))

    bias = full["decoder.bias"].clone() if fill else torch.zeros(8)
    return {
        "model": {"decoder": {"weight": shard("decoder.weight"),
                              "bias": ShardedTensor.from_rank_offsets("decoder.bias", bias, replica_id=rank)}},
        "optimizer": {"exp_avg": shard("optimizer.exp_avg.decoder.weight"),
                      "exp_avg_sq": shard("optimizer.exp_avg_sq.decoder.weight"),
                      "rng": ShardedObject("rng_state", {"seed": 100 + rank} if fill else None, (world,), (rank,))},
        "iteration": 7 if fill else 0,
    }


def _expected(rank: int, world: int) -> dict[str, Any]:
    state = _sharded(rank, world, fill=True)
    return {
        "model": {"decoder": {k: v.data for k, v in state["model"]["decoder"].items()}},
        "optimizer": {"exp_avg": state["optimizer"]["exp_avg"].data,
                      "exp_avg_sq": state["optimizer"]["exp_avg_sq"].data,
                      "rng": {"seed": 100 + rank}},
        "iteration": 7,
    }


def _save_and_load_worker(rank: int, world: int, root: Path) -> None:
    dist_checkpointing.save(_sharded(rank, world, fill=True), str(root), sharded_strategy=(BACKEND, 1))
    # the strategy comes from metadata.json; the reader verifies every chunk
    loaded = dist_checkpointing.load(_sharded(rank, world, fill=False), str(root))
    assert_same(loaded, _expected(rank, world), f"rank {rank} of {world}", key_order=False)  # common state first


def _load_on_one_rank_worker(rank: int, world: int, root: Path) -> None:
    template = _sharded(0, 1, fill=False)
    # both saving ranks' objects (Megatron checks that every shard of an object is loaded somewhere)
    template["optimizer"]["rng"] = [ShardedObject("rng_state", None, (2,), (r,)) for r in range(2)]
    loaded = dist_checkpointing.load(template, str(root), sharded_strategy=CkptzipLoadShardedStrategy())
    expected = _expected(0, 1)
    expected["optimizer"]["rng"] = [{"seed": 100}, {"seed": 101}]
    assert_same(loaded, expected, "one rank", key_order=False)


def test_save_on_2_ranks_load_on_2_and_on_1(tmp_path: Path) -> None:
    launch(_save_and_load_worker, 2, tmp_path)
    assert json.loads((tmp_path / "metadata.json").read_text())["sharded_backend"] == BACKEND
    for name in ("__0.ckzd", "__1.ckzd", ".metadata.ckz"):
        assert (tmp_path / name).read_bytes()[: len(MAGIC)] == MAGIC, name
    assert not list(tmp_path.glob("*.distcp"))
    metadata = CompressedStorageReader(tmp_path).read_metadata()
    assert list(metadata.state_dict_metadata["decoder.weight"].size) == [ROWS, 8]
    launch(_load_on_one_rank_worker, 1, tmp_path)


def _gpt(tensor_parallel: int, seed: int) -> Any:
    """A 2-layer GPTModel split over ``tensor_parallel`` ranks; the same seed gives the same full weights
    at every tensor-parallel size (Megatron initialises the full weight on the CPU, then splits it)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_parallel, 1)
    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               tensor_model_parallel_size=tensor_parallel)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                    max_sequence_length=16)


def _adam(model: Any) -> torch.optim.Optimizer:
    """Adam after two steps on gradients that are an elementwise function of the weights: its
    moments are then the same at every tensor-parallel size, as the weights are (Megatron's forward
    pass, which would give real gradients, needs CUDA)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.sin(3 * p.detach())
        optimizer.step()
    return optimizer


def _with_optimizer(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's sharded state dict and the optimizer's, its moments sharded like their weights
    (what Megatron's own non-distributed optimizers save; the step counters go with the common state)."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    model_state = model.sharded_state_dict()
    optimizer_state = optimizer.state_dict()
    by_id = get_param_id_to_sharded_param_map(model_state, model.parameters())
    optim_state_to_sharding_state(optimizer_state, by_id, exclude_keys=("step",))
    return {"model": model_state, "optimizer": optimizer_state}


def _moments(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, torch.Tensor]]:
    return {i: {k: v for k, v in s.items() if k != "step"} for i, s in optimizer.state_dict()["state"].items()}


def _gpt_worker(rank: int, world: int, root: Path, save: bool) -> None:
    warnings.simplefilter("ignore", UserWarning)
    if save:
        model = _gpt(world, seed=0)
        dist_checkpointing.save(_with_optimizer(model, _adam(model)), str(root), sharded_strategy=(BACKEND, 1))
    model = _gpt(world, seed=1)
    loaded = dist_checkpointing.load(_with_optimizer(model, _adam(model)), str(root))
    model.load_state_dict(loaded["model"])
    expected = _gpt(world, seed=0)
    expected_optimizer = _adam(expected)  # as saved: the weights after the steps, and the moments
    where = f"GPTModel, tensor-parallel rank {rank} of {world}"
    assert_same(model.state_dict(), expected.state_dict(), where)
    assert_same(loaded["optimizer"]["state"], _moments(expected_optimizer), f"{where}, Adam moments")


def test_gpt_model_and_adam_tensor_parallel_2_then_1(tmp_path: Path) -> None:
    launch(_gpt_worker, 2, tmp_path, True)
    assert sorted(p.name for p in tmp_path.glob("__*.ckzd")) == ["__0.ckzd", "__1.ckzd"]
    launch(_gpt_worker, 1, tmp_path, False)
