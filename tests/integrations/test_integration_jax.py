"""ckptzip.integrations.jax with real JAX on the CPU: pytrees of jax.Array, bit-exact, their
structure kept, restored into targets, through DLPack without copies where possible."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import pathlib
from typing import Any

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

# two CPU devices for the sharding tests; only possible before JAX starts its backend
with contextlib.suppress(RuntimeError):
    jax.config.update("jax_num_cpu_devices", 2)

import ckptzip  # noqa: E402
from ckptzip.errors import TargetMismatchError, UnsupportedObjectError  # noqa: E402
from ckptzip.integrations import jax as ckz  # noqa: E402

AdamState = collections.namedtuple("AdamState", "count mu nu")  # the shape of optax's ScaleByAdamState


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    params: Any
    step: Any


def bits(a: Any) -> np.ndarray:
    return np.asarray(a).reshape(-1).view(np.uint8)


def assert_same_tree(got: Any, want: Any) -> None:
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert type(g) is type(w) or (isinstance(g, jax.Array) and isinstance(w, jax.Array))
        if isinstance(w, (jax.Array, np.ndarray)):
            assert (g.dtype, g.shape) == (w.dtype, w.shape)
            np.testing.assert_array_equal(bits(g), bits(w))
        else:
            assert g == w


def bf16_from_bits(values: list[int]) -> jax.Array:
    return jax.lax.bitcast_convert_type(jnp.array(values, dtype=jnp.uint16), jnp.bfloat16)


def params() -> dict[str, Any]:
    key = jax.random.PRNGKey(0)
    return {
        "embed": jax.random.normal(key, (5, 3), dtype=jnp.bfloat16),
        "special": bf16_from_bits([0x7FC1, 0xFF81, 0x8000, 0x0001, 0x7F80]),  # NaN payloads, -0.0, subnormal, inf
        "dense": {"w": jax.random.normal(key, (3, 4)), "b": jnp.array([-0.0, jnp.nan, 1.0, 2.0])},
    }


def state() -> dict[str, Any]:
    p = params()
    return {
        "params": p,
        "opt": (AdamState(jnp.int32(3), jax.tree.map(jnp.zeros_like, p), jax.tree.map(jnp.ones_like, p)), None),
        "misc": [jnp.array([True, False]), jnp.arange(4, dtype=jnp.uint8), jnp.int8(-7), jnp.float16(0.5)],
        "step": 7,
        "lr": 1e-3,
        "host": np.arange(3, dtype=np.int16),
    }


def test_pytree_round_trips_bit_exact_with_its_containers() -> None:
    tree = state()
    buf = io.BytesIO()
    ckz.save(tree, buf)
    loaded = ckz.load(buf.getvalue())
    # Without a target: dicts, lists and tuples as saved; the namedtuple as a dict of its fields.
    assert isinstance(loaded["opt"], tuple) and loaded["opt"][1] is None and isinstance(loaded["misc"], list)
    assert list(loaded["opt"][0]) == ["count", "mu", "nu"]
    as_saved = {**tree, "opt": (tree["opt"][0]._asdict(), None)}
    assert_same_tree(loaded, as_saved)
    assert isinstance(loaded["host"], np.ndarray) and loaded["step"] == 7 and loaded["lr"] == 1e-3


def test_target_restores_pytree_types_and_placement() -> None:
    tree = state()
    buf = io.BytesIO()
    ckz.save(tree, buf)
    assert_same_tree(ckz.load(buf.getvalue(), target=tree), tree)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x, tree)
    restored = ckz.load(buf.getvalue(), target=abstract)
    assert_same_tree(restored, tree)
    assert isinstance(restored["opt"][0], AdamState)


def test_registered_dataclass_node_is_stored_by_field() -> None:
    ts = TrainState(params=params(), step=jnp.int32(10))
    buf = io.BytesIO()
    ckz.save(ts, buf)
    plain = ckz.load(buf.getvalue())
    assert list(plain) == ["params", "step"]
    assert_same_tree(ckz.load(buf.getvalue(), target=ts), ts)


def test_to_torch_shares_buffers_and_from_torch_too() -> None:
    a = jnp.arange(64, dtype=jnp.float32)
    t = ckz.to_torch({"a": a})["a"]
    assert t.data_ptr() == a.unsafe_buffer_pointer()
    back = ckz.from_torch(t)
    assert back.unsafe_buffer_pointer() == t.data_ptr()


def test_target_mismatches_are_named() -> None:
    buf = io.BytesIO()
    ckz.save({"w": jnp.zeros((2, 3))}, buf)
    with pytest.raises(TargetMismatchError, match=r"the checkpoint's array at 'w' is float32\[2, 3\], the target's "
                       r"float32\[3, 2\]"):
        ckz.load(buf.getvalue(), target={"w": jnp.zeros((3, 2))})
    with pytest.raises(TargetMismatchError, match=r"the target has a leaf at 'v\.0' that the checkpoint does not hold"):
        ckz.load(buf.getvalue(), target={"w": jnp.zeros((2, 3)), "v": [jnp.zeros(1)]})


def test_64_bit_tensors_need_x64() -> None:
    assert not jax.config.read("jax_enable_x64")
    buf = io.BytesIO()
    ckptzip.save({"ids": torch.tensor([2**40, -1])}, buf)
    with pytest.raises(UnsupportedObjectError, match=r"the torch.int64 tensor at 'ids' needs 64-bit types, which "
                       r"JAX has switched off; JAX would truncate it"):
        ckz.load(buf.getvalue())
    jax.config.update("jax_enable_x64", True)
    try:
        ids = ckz.load(buf.getvalue())["ids"]
        assert ids.dtype == jnp.int64 and ids.tolist() == [2**40, -1]
    finally:
        jax.config.update("jax_enable_x64", False)


def test_a_dtype_without_dlpack_is_refused_by_path() -> None:
    with pytest.raises(UnsupportedObjectError, match=r"the jax.Array at 'q.0' \(int4\) cannot be handed to ckptzip"):
        ckz.to_torch({"q": [jnp.array([1, 2], dtype=jnp.int4)]})


def test_load_places_arrays_on_the_device_asked_for() -> None:
    buf = io.BytesIO()
    ckz.save({"w": jnp.ones(4)}, buf)
    device = jax.devices()[-1]
    assert ckz.load(buf.getvalue(), device=device)["w"].devices() == {device}


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs two JAX devices")
def test_sharded_arrays_are_gathered_and_restored_to_the_target_sharding() -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    tree = {"s": jax.device_put(jnp.arange(8.0), sharded), "r": jax.device_put(jnp.arange(3.0), replicated)}
    buf = io.BytesIO()
    ckz.save(tree, buf)
    restored = ckz.load(buf.getvalue(), target=tree)
    assert restored["s"].sharding == sharded and restored["r"].sharding == replicated
    assert_same_tree(restored, tree)


def test_with_checkpoint_manager(tmp_path: pathlib.Path) -> None:
    tree = state()
    with ckptzip.CheckpointManager(tmp_path / "run", keep_last=1) as manager:
        manager.save(1, ckz.to_torch(tree))
        manager.wait()
        assert_same_tree(ckz.from_torch(manager.restore(), target=tree), tree)


@pytest.mark.gpu
def test_gpu_arrays_leave_and_return_without_a_copy(tmp_path: pathlib.Path) -> None:
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        pytest.skip("needs JAX with CUDA (pip install 'jax[cuda12]')")
    a = jax.device_put(jax.random.normal(jax.random.PRNGKey(0), (256, 256), dtype=jnp.bfloat16), gpus[0])
    t = ckz.to_torch(a)
    assert t.is_cuda and t.data_ptr() == a.unsafe_buffer_pointer()
    ckz.save({"a": a}, tmp_path / "g.ckz")
    loaded = ckz.load(tmp_path / "g.ckz", device=gpus[0])["a"]
    assert loaded.devices() == {gpus[0]}
    np.testing.assert_array_equal(bits(loaded), bits(a))
