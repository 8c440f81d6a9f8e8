"""Megatron-Core on GPUs with ckptzip's ``dist_checkpointing`` backend: a GPTModel (bf16, local
layer spec, no Transformer Engine) under Megatron's DistributedDataParallel with the distributed
optimizer, trained, saved with ``dist_checkpointing.save`` through Megatron's ``torch_dist`` backend
and through ``ckptzip``, loaded into a differently initialised model and optimizer, and resumed.
Reports, per backend, whether the loaded model and optimizer state (bf16 weights, fp32 main
weights, Adam moments and steps) is bit-identical to what was saved and the resumed run to an
uninterrupted one (the paths that differ, if any), and passes when ckptzip restores exactly what
``torch_dist`` restores and resumes exactly as it does. Prints one JSON line: bytes, save and load
seconds per backend.

    python bench/megatron_gpu.py                   # 1 GPU
    python bench/megatron_gpu.py --nproc 2 --json $OUT/megatron.json

Each rank is a process started here (NCCL, rank r on GPU r, data parallel over all ranks, so the
distributed optimizer shards its state over them). Needs ``pip install 'ckptzip[megatron,gpu]'``.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from _resume import arguments, checked, differing, run, state_bytes, write_report
from ckptzip.demo.training import load_corpus

SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}  # Megatron-LM's default for this optimizer


def _build(args: argparse.Namespace, seed: int) -> tuple[Any, Any]:
    """A GPTModel wrapped as Megatron-LM trains it (bf16 module, DDP) and its distributed optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8, bf16=True,
        params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
    )
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=256,
                     max_sequence_length=args.seq_len).cuda()
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                 use_distributed_optimizer=True),
        module=Float16Module(config, model),
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, params_dtype=torch.bfloat16,
                        use_distributed_optimizer=True, clip_grad=1.0),
        [ddp], use_gloo_process_groups=False,
    )
    return ddp, optimizer


def _train(ddp: Any, optimizer: Any, corpus: torch.Tensor, first: int, args: argparse.Namespace) -> None:
    window = torch.arange(args.seq_len + 1, device=corpus.device)
    positions = torch.arange(args.seq_len, device=corpus.device).expand(args.batch_size, -1)
    for step in range(first, first + args.steps):
        generator = torch.Generator(device=corpus.device).manual_seed(1000 * step + dist.get_rank())
        offsets = torch.randint(0, corpus.numel() - args.seq_len - 1, (args.batch_size, 1), device=corpus.device,
                                generator=generator)
        chunk = corpus[offsets + window].long()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = ddp(chunk[:, :-1], positions, None, labels=chunk[:, 1:]).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        update_successful, _, _ = optimizer.step()
        assert update_successful, f"step {step} was skipped"


def _state(ddp: Any, optimizer: Any) -> dict[str, bytes]:
    """The module's weights, and for each inner optimizer its fp32 main weights (this rank's shard)
    and its state (Adam moments and steps), as bytes."""
    inner = [o.optimizer for o in _inner(optimizer)]
    main = [[p for group in o.param_groups for p in group["params"]] for o in inner]
    return state_bytes({"module": ddp.module.state_dict(), "main_params": main,
                        "optimizer": [o.state_dict()["state"] for o in inner]})


def _inner(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _allocate_state(optimizer: Any) -> None:
    """Without Apex or Transformer Engine, Megatron-Core's distributed optimizer runs on torch's
    Adam, and its ``state_dict`` (which ``sharded_state_dict(is_loading=True)`` calls) reads the
    step from the Adam state, which a new optimizer has not allocated: one step with zero
    gradients allocates it (Megatron's own helper; the load then overwrites all of it)."""
    for distributed in _inner(optimizer):
        if not distributed.optimizer.state:
            distributed._init_optimizer_states_with_dummy_values()


def _sharded(ddp: Any, optimizer: Any, is_loading: bool) -> dict[str, Any]:
    model = ddp.module.sharded_state_dict(metadata=SHARDING)
    return {"model": model, "optimizer": optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=SHARDING)}


def _worker(rank: int, world: int, args: argparse.Namespace, root: Path) -> None:
    warnings.simplefilter("ignore", UserWarning)  # Megatron warns that Transformer Engine and Apex are absent
    import ckptzip.integrations.megatron  # noqa: F401  (registers the "ckptzip" backend)
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    corpus = load_corpus().cuda()

    reference = _build(args, seed=0)
    _train(*reference, corpus, 0, args)
    _train(*reference, corpus, args.steps, args)
    expected = _state(*reference)
    del reference

    results: dict[str, Any] = {}
    restored: dict[str, dict[str, bytes]] = {}
    resumed_states: dict[str, dict[str, bytes]] = {}
    for backend in ("torch_dist", "ckptzip"):
        directory = root / backend
        if rank == 0:
            directory.mkdir()
        ddp, optimizer = _build(args, seed=0)
        _train(ddp, optimizer, corpus, 0, args)
        saved = _state(ddp, optimizer)
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        dist_checkpointing.save(_sharded(ddp, optimizer, is_loading=False), str(directory),
                                sharded_strategy=(backend, 1))
        dist.barrier()
        save_s = time.perf_counter() - start
        del ddp, optimizer

        ddp, optimizer = _build(args, seed=1)
        _allocate_state(optimizer)
        start = time.perf_counter()
        state = dist_checkpointing.load(_sharded(ddp, optimizer, is_loading=True), str(directory))
        ddp.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.cuda.synchronize()
        dist.barrier()
        load_s = time.perf_counter() - start
        restored[backend] = _state(ddp, optimizer)
        loaded = differing(restored[backend], saved)
        _train(ddp, optimizer, corpus, args.steps, args)
        resumed_states[backend] = _state(ddp, optimizer)
        resumed = differing(resumed_states[backend], expected)
        results[backend] = checked(directory, save_s, load_s, loaded, resumed, world)
        del ddp, optimizer
    # The gate: whatever Megatron's own backend restores (and how a run resumes from it), ckptzip
    # restores the same, bit for bit. With torch's Adam (no Apex or Transformer Engine), Megatron-Core
    # 0.16's load does not give back the per-parameter Adam steps it saved (measured on the H200, with
    # either backend), so a resumed run differs from an uninterrupted one whichever backend wrote it.
    same = [not differing(restored["ckptzip"], restored["torch_dist"]),
            not differing(resumed_states["ckptzip"], resumed_states["torch_dist"])]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, same)
    results["ckptzip"]["load_same_as_torch_dist"] = all(g[0] for g in gathered)
    results["ckptzip"]["resume_same_as_torch_dist"] = all(g[1] for g in gathered)
    if rank == 0:
        import megatron.core

        write_report(root, {"bench": "megatron", "nproc": world, "layers": args.layers, "hidden": args.hidden,
                            "steps": args.steps, "megatron_core": megatron.core.__version__}, results,
                     ok=results["ckptzip"]["load_same_as_torch_dist"] and results["ckptzip"]["resume_same_as_torch_dist"])


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=256)
    run(_worker, parser.parse_args())


if __name__ == "__main__":
    main()
