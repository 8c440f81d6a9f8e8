"""CkptzipTrainer with a real transformers.Trainer: a tiny GPT-2 built from a config, on the CPU."""

from __future__ import annotations

import os
import pathlib
from typing import Any

import pytest
import torch
from helpers import assert_same, state_copy

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import ckptzip  # noqa: E402
from ckptzip.integrations.hf import CkptzipTrainer, compress_model_weights  # noqa: E402

STEPS = 6
SAVE_EVERY = 3
ORIGINALS = {"model.safetensors", "optimizer.pt", "scheduler.pt"}
COMPRESSED = {"model.ckz", "optimizer.ckz", "scheduler.ckz"}


def tiny_gpt2(seed: int = 0) -> Any:
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def dataset(n: int = 32) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row} for row in ids]


class StopAt(transformers.TrainerCallback):
    """Simulates an interrupted run: training ends right after step ``step`` (and its checkpoint)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def make_trainer(trainer_class: type, output_dir: pathlib.Path, model_seed: int = 0, **kwargs: Any) -> Any:
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), use_cpu=True, report_to=[], seed=0, disable_tqdm=True,
        per_device_train_batch_size=4, max_steps=STEPS, save_steps=SAVE_EVERY, logging_steps=100,
        **kwargs,
    )  # fmt: skip
    return trainer_class(model=tiny_gpt2(model_seed), args=args, train_dataset=dataset(), eval_dataset=dataset(8))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, dict, dict]:
    """An uninterrupted plain-Trainer run: its output dir, final parameters, final optimizer state."""
    out = tmp_path_factory.mktemp("reference")
    trainer = make_trainer(transformers.Trainer, out)
    trainer.train()
    return out, state_copy(trainer.model), trainer.optimizer.state_dict()


def test_checkpoints_hold_ckz_files_with_the_same_state(
    tmp_path: pathlib.Path, reference: tuple[pathlib.Path, dict, dict]
) -> None:
    reference_dir, reference_params, _ = reference
    trainer = make_trainer(CkptzipTrainer, tmp_path)
    trainer.train()

    assert_same(state_copy(trainer.model), reference_params)  # checkpointing does not perturb training
    for step in (3, 6):
        name = f"checkpoint-{step}"
        files = set(os.listdir(tmp_path / name))
        assert files >= COMPRESSED | {"config.json", "trainer_state.json", "rng_state.pth"}
        assert not files & ORIGINALS
        plain = reference_dir / name
        assert_same(ckptzip.load(tmp_path / name / "model.ckz"), _safetensors(plain / "model.safetensors"))
        for stem in ("optimizer", "scheduler"):
            expected = torch.load(plain / f"{stem}.pt", weights_only=True)
            assert_same(ckptzip.load(tmp_path / name / f"{stem}.ckz"), expected)


def _safetensors(path: pathlib.Path) -> dict[str, torch.Tensor]:
    import safetensors.torch

    return safetensors.torch.load_file(path)


@pytest.mark.parametrize(
    ("writer", "resumer", "resume_from"),
    [
        (CkptzipTrainer, CkptzipTrainer, True),
        (CkptzipTrainer, CkptzipTrainer, "checkpoint-3"),
        (transformers.Trainer, transformers.Trainer, True),  # the baseline ckptzip must match
        (transformers.Trainer, CkptzipTrainer, True),  # uncompressed checkpoints still resume
    ],
)
def test_resume_matches_uninterrupted_training(
    tmp_path: pathlib.Path, reference: tuple[pathlib.Path, dict, dict], writer: type, resumer: type, resume_from: Any
) -> None:
    _, reference_params, reference_optimizer = reference
    interrupted = make_trainer(writer, tmp_path)
    interrupted.add_callback(StopAt(SAVE_EVERY))
    interrupted.train()
    assert os.listdir(tmp_path) == ["checkpoint-3"]

    resumed = make_trainer(resumer, tmp_path, model_seed=1)  # different init: all state must be loaded
    if isinstance(resume_from, str):
        resume_from = str(tmp_path / resume_from)
    resumed.train(resume_from_checkpoint=resume_from)

    assert resumed.state.global_step == STEPS
    assert_same(state_copy(resumed.model), reference_params)
    assert_same(resumed.optimizer.state_dict(), reference_optimizer)


def test_load_best_model_at_end_reads_model_ckz(tmp_path: pathlib.Path) -> None:
    trainer = make_trainer(
        CkptzipTrainer, tmp_path, eval_strategy="steps", eval_steps=SAVE_EVERY, load_best_model_at_end=True,
        metric_for_best_model="loss", save_total_limit=1,
    )  # fmt: skip
    trainer.train()
    best = pathlib.Path(trainer.state.best_model_checkpoint)
    assert (best / "model.ckz").is_file() and not (best / "model.safetensors").exists()
    stored = ckptzip.load(best / "model.ckz")
    # model.ckz keeps the key order of the safetensors file it replaced, not the module's
    assert_same({k: v for k, v in state_copy(trainer.model).items() if k in stored}, stored, key_order=False)


def test_save_model_still_exports_safetensors(tmp_path: pathlib.Path) -> None:
    trainer = make_trainer(CkptzipTrainer, tmp_path / "run")
    trainer.save_model(str(tmp_path / "export"))
    assert (tmp_path / "export" / "model.safetensors").is_file()
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "export")
    assert_same(state_copy(loaded), state_copy(trainer.model))


def test_compress_model_weights_merges_shards(tmp_path: pathlib.Path) -> None:
    model = tiny_gpt2()
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1
    expected: dict[str, torch.Tensor] = {}
    for name in shards:
        expected.update(_safetensors(tmp_path / name))

    assert compress_model_weights(tmp_path, codec="zstd")
    assert sorted(os.listdir(tmp_path)) == ["config.json", "generation_config.json", "model.ckz"]
    assert_same(ckptzip.load(tmp_path / "model.ckz"), expected)
    assert not compress_model_weights(tmp_path)  # nothing left to replace
