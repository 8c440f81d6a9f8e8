"""DeepSpeed integration: the checkpoint engine on its own, and real ``deepspeed.initialize`` runs
on CPU ranks (gloo) that save, load and resume bit-exactly through it."""

from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import Any

import pytest
import torch

# DeepSpeed picks its accelerator once; these tests run on the CPU one, on any machine.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed", reason="needs DeepSpeed: pip install 'ckptzip[deepspeed]'")

from helpers import assert_same, random_tensor  # noqa: E402

import ckptzip  # noqa: E402
from ckptzip_bench.launch import launch  # noqa: E402
from ckptzip.errors import CorruptCheckpointError, UnsupportedObjectError  # noqa: E402
from ckptzip.format.spec import MAGIC  # noqa: E402
from ckptzip.integrations.deepspeed import OBJECT_TYPES, CkptzipCheckpointEngine  # noqa: E402
from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo, TorchCheckpointEngine  # noqa: E402
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler  # noqa: E402
from deepspeed.runtime.zero.config import ZeroStageEnum  # noqa: E402
from deepspeed.utils.tensor_fragment import fragment_address  # noqa: E402


def _zero_like_state() -> dict[str, Any]:
    """What a ZeRO optimizer file holds: tensors, plain values and the DeepSpeed objects."""
    scaler = DynamicLossScaler(2.0**16, 1000, 1.0, 2, True, dtype=torch.bfloat16)
    scaler.cur_iter = 7
    weight = random_tensor(torch.float32, (8, 4), seed=1)
    return {
        "optimizer_state_dict": {
            "loss_scaler": scaler,
            "static_scaler": LossScaler(scale=128),
            "zero_stage": ZeroStageEnum.gradients,
            "param_slice_mappings": [collections.OrderedDict(w=fragment_address(numel=32, start=0))],
            "single_partition_of_fp32_groups": [weight.flatten()],
            "base_optimizer_state": {"state": {0: {"exp_avg": random_tensor(torch.float32, (32,), seed=2),
                                                   "step": torch.tensor(3.0)}}},
            "clip_grad": 1.0,
        },
        "module": collections.OrderedDict(w=weight, b=random_tensor(torch.bfloat16, (4,), seed=3)),
        "ds_version": "0.19.8",
        "shared": (weight, weight[1:3]),
    }


def _same_objects(loaded: Any, saved: Any) -> None:
    assert type(loaded) is type(saved)
    assert vars(loaded).keys() == vars(saved).keys()
    for key, value in vars(saved).items():
        assert type(vars(loaded)[key]) is type(value) and vars(loaded)[key] == value, key


def test_save_load_bit_exact_with_deepspeed_objects(tmp_path: Path) -> None:
    engine = CkptzipCheckpointEngine()
    state = _zero_like_state()
    path = str(tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    engine.save(state, path)
    assert Path(path).read_bytes()[: len(MAGIC)] == MAGIC
    loaded = engine.load(path, map_location=torch.device("cpu"))
    saved_opt, loaded_opt = state.pop("optimizer_state_dict"), loaded.pop("optimizer_state_dict")
    assert_same(loaded, state, "deepspeed file")
    for key in ("loss_scaler", "static_scaler"):
        _same_objects(loaded_opt.pop(key), saved_opt.pop(key))
    assert loaded_opt.pop("zero_stage") is ZeroStageEnum.gradients
    mapping = loaded_opt.pop("param_slice_mappings")[0]["w"]
    assert type(mapping) is fragment_address and (mapping.numel, mapping.start) == (32, 0)
    saved_opt.pop("zero_stage"), saved_opt.pop("param_slice_mappings")
    assert_same(loaded_opt, saved_opt, "optimizer_state_dict")
    # a tuple of a tensor and its view comes back as two tensors; the view as a copy of its bytes
    assert loaded["shared"][1].data_ptr() != loaded["shared"][0].data_ptr()


def test_callable_map_location_as_deepspeed_passes_it(tmp_path: Path) -> None:
    engine = CkptzipCheckpointEngine()
    path = str(tmp_path / "mp_rank_00_model_states.pt")
    engine.save({"module": {"w": torch.arange(6.0)}}, path)
    loaded = engine.load(path, map_location=lambda storage, loc: storage)
    assert loaded["module"]["w"].device.type == "cpu"
    assert torch.equal(loaded["module"]["w"], torch.arange(6.0))


def test_commit_create_and_no_clone_before_save() -> None:
    engine = CkptzipCheckpointEngine(codec="fast")
    info = CheckpointCommitInfo(tag="global_step3", save_dir="ckpt", save_latest=True)
    assert engine.create(info) is None
    assert engine.commit(info) is True
    assert engine.preserves_storage_sharing() is False
    assert engine.is_data_parallel_writer(0) and not engine.is_data_parallel_writer(1)
    assert not engine.is_decoupled()


def test_failed_save_keeps_the_previous_file(tmp_path: Path) -> None:
    engine = CkptzipCheckpointEngine()
    path = tmp_path / "mp_rank_00_model_states.pt"
    engine.save({"module": {"w": torch.ones(3)}}, str(path))
    before = path.read_bytes()
    with pytest.raises(UnsupportedObjectError, match=r"client_state.*pathlib.*PosixPath|PosixPath.*client_state"):
        engine.save({"module": {"w": torch.zeros(3)}, "client": Path("x")}, str(path))
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["mp_rank_00_model_states.pt"]


def test_files_of_deepspeeds_own_engine_still_load(tmp_path: Path) -> None:
    path = str(tmp_path / "mp_rank_00_model_states.pt")
    TorchCheckpointEngine().save({"module": {"w": torch.arange(4)}, "loss_scaler": LossScaler(4)}, path)
    loaded = CkptzipCheckpointEngine().load(path, map_location="cpu")
    assert torch.equal(loaded["module"]["w"], torch.arange(4)) and loaded["loss_scaler"].cur_scale == 4
    with pytest.raises(CorruptCheckpointError, match="not a ckptzip container and torch_fallback=False"):
        CkptzipCheckpointEngine(torch_fallback=False).load(path)


@pytest.mark.parametrize(
    "forged",
    [
        {"__ckptzip_deepspeed_object__": "os.system", "fields": {}},
        {"__ckptzip_deepspeed_object__": "deepspeed.runtime.zero.config.ZeroStageEnum", "value": 9},
        {"__ckptzip_deepspeed_object__": "deepspeed.utils.tensor_fragment.fragment_address", "fields": {"x": 1}},
        {"__ckptzip_deepspeed_object__": "deepspeed.runtime.fp16.loss_scaler.LossScaler", "fields": [1]},
    ],
    ids=["unknown-class", "bad-enum", "bad-dataclass-fields", "fields-not-a-dict"],
)
def test_forged_objects_are_refused(tmp_path: Path, forged: dict[str, Any]) -> None:
    path = str(tmp_path / "f.pt")
    ckptzip.save({"x": forged}, path)  # a file crafted without the engine
    with pytest.raises(CorruptCheckpointError, match=r"f\.pt"):
        CkptzipCheckpointEngine().load(path)


def test_object_types_name_their_classes() -> None:
    assert set(OBJECT_TYPES.values()) == {LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address}


# --- real deepspeed.initialize on CPU ranks -----------------------------------------------------

STEPS = 3


def _engine(stage: int, seed: int) -> Any:
    import deepspeed
    import deepspeed.ops

    # DeepSpeed's CPU backend JIT-compiles a shared-memory allreduce (minutes of C++); it is an
    # optimisation only, and gloo does the same work without it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": stage > 0},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _train(engine: Any, first: int, steps: int) -> None:
    dtype = next(engine.parameters()).dtype
    for step in range(first, first + steps):
        generator = torch.Generator().manual_seed(1000 * step + engine.global_rank)
        x = torch.randn(4, 16, generator=generator).to(dtype)
        loss = engine(x).float().square().mean()
        engine.backward(loss)
        engine.step()


def _snapshot(engine: Any) -> dict[str, Any]:
    """Everything a resumed run must reproduce: weights, optimizer (fp32 master and moments), steps."""
    optimizer = engine.optimizer.state_dict()
    return {
        "module": {k: v.clone() for k, v in engine.module.state_dict().items()},
        "optimizer": _tensors(optimizer),
        "lr": engine.get_lr(),
        "global_steps": engine.global_steps,
    }


def _tensors(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _tensors(v) for k, v in obj.items() if k != "loss_scaler"}
    if isinstance(obj, (list, tuple)):
        return [_tensors(v) for v in obj]
    return obj if isinstance(obj, (int, float, str, bool, type(None))) else repr(obj)


def _resume_worker(rank: int, world: int, root: Path, stage: int) -> None:
    os.environ["LOCAL_RANK"] = str(rank)  # what DeepSpeed's launcher sets; this process is rank's own
    reference = _engine(stage, seed=0)
    _train(reference, 0, 2 * STEPS)
    expected = _snapshot(reference)

    interrupted = _engine(stage, seed=0)
    interrupted.checkpoint_engine = CkptzipCheckpointEngine()
    _train(interrupted, 0, STEPS)
    interrupted.save_checkpoint(str(root), client_state={"epoch": 1, "note": "mid-run"})

    resumed = _engine(stage, seed=1)  # different initial weights: everything must come from the file
    resumed.checkpoint_engine = CkptzipCheckpointEngine()
    _, client_state = resumed.load_checkpoint(str(root))
    assert client_state["epoch"] == 1 and client_state["note"] == "mid-run"
    assert resumed.global_steps == STEPS
    _train(resumed, STEPS, STEPS)
    assert_same(_snapshot(resumed), expected, f"rank {rank} resumed")


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "world"), [(0, 1), (2, 2)], ids=["no-zero-1-rank", "zero2-bf16-2-ranks"])
def test_initialize_train_save_load_resume_bit_exact(tmp_path: Path, stage: int, world: int) -> None:
    launch(_resume_worker, world, tmp_path, stage)
    tag = tmp_path / f"global_step{STEPS}"
    assert (tmp_path / "latest").read_text() == tag.name
    files = sorted(p.name for p in tag.iterdir())
    assert files, tag
    for name in files:
        assert (tag / name).read_bytes()[: len(MAGIC)] == MAGIC, name
    if stage:
        assert sum("optim_states" in name for name in files) == world, files
