"""A .ckz written from PyTorch, JAX or TensorFlow loads in each of the others, bit-exact: the
format is framework-neutral. Inputs are built from NumPy in each framework, not through ckptzip."""

from __future__ import annotations

import itertools
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

ml_dtypes = pytest.importorskip("ml_dtypes")
jnp = pytest.importorskip("jax.numpy")
tf = pytest.importorskip("tensorflow")

import ckptzip  # noqa: E402
from ckptzip.integrations import jax as ckz_jax  # noqa: E402
from ckptzip.integrations import tf as ckz_tf  # noqa: E402

def array(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random bytes as ``name`` (floats then hold NaN payloads, infinities, -0.0, subnormals)."""
    if name == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    dtype = np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)
    return rng.integers(0, 256, size=(*shape, dtype.itemsize), dtype=np.uint8).view(dtype).reshape(shape)


def reference() -> dict[str, Any]:
    """Arrays of dtypes all three frameworks have (JAX needs jax_enable_x64 for 64-bit ones) in nested
    dicts and lists, a 0-d array and a plain value."""
    rng = np.random.default_rng(0)
    return {
        "params": {name: array(rng, name, (3, 5)) for name in ("float32", "bfloat16", "float16")},
        "buffers": [array(rng, name, (7,)) for name in ("int32", "int16", "int8", "uint8", "bool")],
        "scalar": array(rng, "float32", ()),
        "step": 12,
    }


def to_torch_native(a: np.ndarray) -> torch.Tensor:
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def build(framework: str, tree: Any) -> Any:
    make: Callable[[np.ndarray], Any] = {"torch": to_torch_native, "jax": jnp.asarray, "tf": tf.constant}[framework]
    return _map(tree, make)


def _map(tree: Any, fn: Callable[[np.ndarray], Any]) -> Any:
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map(v, fn) for v in tree]
    return fn(tree) if isinstance(tree, np.ndarray) else tree


def as_numpy(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bfloat16:
            return x.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
        return x.numpy()
    if tf.is_tensor(x):
        return x.numpy()
    return np.asarray(x)


def save(framework: str, tree: Any, path: pathlib.Path) -> None:
    {"torch": ckptzip.save, "jax": ckz_jax.save, "tf": ckz_tf.save}[framework](tree, path)


def load(framework: str, path: pathlib.Path) -> Any:
    return {"torch": ckptzip.load, "jax": ckz_jax.load, "tf": ckz_tf.load}[framework](path)


def assert_same(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}.{i}")
    elif isinstance(want, np.ndarray):
        g = np.asarray(as_numpy(got))
        assert (g.dtype, g.shape) == (want.dtype, want.shape), where
        np.testing.assert_array_equal(g.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8), err_msg=where)
    else:
        assert got == want, where


FRAMEWORKS = ["torch", "jax", "tf"]


@pytest.mark.parametrize(("writer", "reader"), list(itertools.permutations(FRAMEWORKS, 2)))
def test_checkpoint_written_by_one_framework_loads_in_another(writer: str, reader: str, tmp_path: pathlib.Path) -> None:
    want = reference()
    save(writer, build(writer, want), tmp_path / "x.ckz")
    assert_same(load(reader, tmp_path / "x.ckz"), want)


def test_jax_target_and_keras_model_read_a_torch_checkpoint(tmp_path: pathlib.Path) -> None:
    """Weights trained in PyTorch go into a JAX pytree and a Keras layer of the same shapes."""
    import keras

    linear = torch.nn.Linear(3, 2)
    ckptzip.save({"model": {"dense/kernel": linear.weight.detach().T.contiguous(), "dense/bias": linear.bias.detach()}},
                 tmp_path / "w.ckz")
    target = {"model": {"dense/kernel": jnp.zeros((3, 2)), "dense/bias": jnp.zeros(2)}}
    params = ckz_jax.load(tmp_path / "w.ckz", target=target)
    np.testing.assert_array_equal(np.asarray(params["model"]["dense/kernel"]), linear.weight.detach().T.numpy())
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    ckz_tf.restore({"model": layer}, tmp_path / "w.ckz")
    np.testing.assert_array_equal(layer.kernel.numpy(), linear.weight.detach().T.numpy())
    np.testing.assert_array_equal(layer.bias.numpy(), linear.bias.detach().numpy())
