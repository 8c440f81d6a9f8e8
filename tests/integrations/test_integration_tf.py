"""ckptzip.integrations.tf with real TensorFlow / Keras on the CPU: variable trees, Keras models
with their optimizers, the every-N-steps callback, and bit-exact resume."""

from __future__ import annotations

import io
import pathlib
import re
from typing import Any

import numpy as np
import pytest
import torch

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import ckptzip  # noqa: E402
from ckptzip.errors import TargetMismatchError  # noqa: E402
from ckptzip.integrations import tf as ckz  # noqa: E402


def bits(x: Any) -> np.ndarray:
    """The bytes of a variable's or tensor's value."""
    a = np.asarray(tf.convert_to_tensor(x).numpy())
    return a.reshape(-1).view(np.uint8)


def assert_same_variables(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g.dtype, tuple(g.shape)) == (w.dtype, tuple(w.shape)), getattr(w, "path", w.name)
        np.testing.assert_array_equal(bits(g), bits(w), err_msg=getattr(w, "path", w.name))


def bf16_from_bits(values: list[int]) -> Any:
    return tf.bitcast(tf.constant(values, dtype=tf.uint16), tf.bfloat16)


def variable_tree(fill: bool) -> dict[str, Any]:
    """Variables of several dtypes; ``fill=False`` gives the same shapes holding zeros."""
    special = [0x7FC1, 0xFF81, 0x8000, 0x0001, 0x7F80, 0x3F80]  # NaN payloads, -0.0, subnormal, inf, 1.0
    values = {
        "bf16": bf16_from_bits(special),
        "f32": tf.constant(np.random.default_rng(0).standard_normal((3, 4)), dtype=tf.float32),
        "ints": [tf.constant([1, -(2**40), 2**62], dtype=tf.int64), tf.constant([[True, False]])],
        "scalar": tf.constant(3.5, dtype=tf.float16),
    }
    return tf.nest.map_structure(lambda t: tf.Variable(t if fill else tf.zeros_like(t)), values)


def test_variable_tree_round_trips_bit_exact() -> None:
    saved, fresh = variable_tree(fill=True), variable_tree(fill=False)
    buf = io.BytesIO()
    ckz.save({"vars": saved, "step": 7, "note": "x"}, buf)
    loaded = ckz.restore({"vars": fresh}, buf.getvalue())
    assert_same_variables(tf.nest.flatten(fresh), tf.nest.flatten(saved))
    assert loaded["step"] == 7 and loaded["note"] == "x"
    assert isinstance(loaded["vars"]["ints"], list) and loaded["vars"]["bf16"].dtype == tf.bfloat16


def test_to_torch_views_tensors_and_snapshots_variables() -> None:
    constant = tf.constant([1.0, 2.0])
    view = ckz.to_torch(constant)
    view[0] = 9.0  # a view of TensorFlow's buffer, not a copy
    assert constant.numpy().tolist() == [9.0, 2.0]
    variable = tf.Variable([1.0, 2.0])
    snapshot = ckz.to_torch(variable)
    variable.assign_add([1.0, 1.0])  # copy-on-write: the saved view keeps the old values
    assert snapshot.tolist() == [1.0, 2.0] and variable.numpy().tolist() == [2.0, 3.0]


def make_model(seed: int, width: int = 8) -> Any:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(width, activation="tanh", dtype="bfloat16"),
            keras.layers.Dropout(0.25),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.standard_normal((16, 4)).astype("float32"), rng.standard_normal((16, 1)).astype("float32")


def fit(model: Any, epochs: int, initial_epoch: int = 0, callbacks: list[Any] | None = None) -> None:
    x, y = data()
    model.fit(x, y, batch_size=4, epochs=epochs, initial_epoch=initial_epoch, shuffle=False, verbose=0,
              callbacks=callbacks)


def test_keras_model_and_optimizer_restore_into_a_fresh_model(tmp_path: pathlib.Path) -> None:
    trained = make_model(seed=0)
    fit(trained, epochs=1)
    ckz.save_model(trained, tmp_path / "m.ckz")
    fresh = make_model(seed=5)  # other initial weights, other variable paths (dense_2, ...)
    assert fresh.optimizer.variables != [] and not fresh.optimizer.built
    ckz.restore_model(fresh, tmp_path / "m.ckz")
    assert_same_variables(fresh.variables, trained.variables)
    assert_same_variables(fresh.optimizer.variables, trained.optimizer.variables)
    assert int(fresh.optimizer.iterations.numpy()) == 4
    names = ckptzip.open(tmp_path / "m.ckz").keys()
    assert [n.split(".", 1)[0] for n in names].count("optimizer") == len(trained.optimizer.variables)
    # Keras numbers layer names per process: dense, dense_1, ...
    assert any(re.fullmatch(r"model\.sequential(_\d+)?/dense(_\d+)?/kernel", n) for n in names), names


def test_callback_resume_is_bit_exact(tmp_path: pathlib.Path) -> None:
    uninterrupted = make_model(seed=0)
    fit(uninterrupted, epochs=4)

    first = make_model(seed=0)
    callback = ckz.CkptzipCallback(tmp_path / "ckpt", every_n_steps=4, keep_last=2, async_save=True)
    fit(first, epochs=2, callbacks=[callback])
    callback.close()
    assert callback.manager.all_steps() == [4, 8]

    resumed = make_model(seed=3)
    callback = ckz.CkptzipCallback(tmp_path / "ckpt", every_n_steps=4, keep_last=2)
    assert callback.restore_latest(resumed) == 8
    fit(resumed, epochs=4, initial_epoch=2, callbacks=[callback])
    callback.close()
    assert callback.manager.all_steps() == [12, 16]
    assert_same_variables(resumed.variables, uninterrupted.variables)
    assert_same_variables(resumed.optimizer.variables, uninterrupted.optimizer.variables)


def test_restore_latest_without_checkpoints_restores_nothing(tmp_path: pathlib.Path) -> None:
    callback = ckz.CkptzipCallback(tmp_path / "empty", every_n_steps=1)
    assert callback.restore_latest(make_model(seed=0)) is None
    callback.close()


def test_restoring_into_another_architecture_is_refused(tmp_path: pathlib.Path) -> None:
    ckz.save_model(make_model(seed=0), tmp_path / "m.ckz")
    with pytest.raises(TargetMismatchError, match=r"the checkpoint's tensor at 'model\..*dense.*/kernel' is "
                       r"bfloat16\[4, 8\], the variable .* is bfloat16\[4, 16\]"):
        ckz.restore_model(make_model(seed=0, width=16), tmp_path / "m.ckz")


def test_an_unbuilt_optimizer_is_named_with_the_fix(tmp_path: pathlib.Path) -> None:
    trained = make_model(seed=0)
    fit(trained, epochs=1)
    ckz.save_model(trained, tmp_path / "m.ckz")
    fresh = make_model(seed=0)
    with pytest.raises(TargetMismatchError, match=r"the Adam at 'optimizer' has 2 variables, the checkpoint "
                       r"holds 10 tensors there\. Build it first: optimizer\.build"):
        ckz.restore({"optimizer": fresh.optimizer}, tmp_path / "m.ckz")


def test_an_entry_the_file_lacks_is_named(tmp_path: pathlib.Path) -> None:
    ckz.save({"a": tf.Variable([1.0])}, tmp_path / "v.ckz")
    with pytest.raises(TargetMismatchError, match="the target has an entry at 'b' that the checkpoint does not hold"):
        ckz.restore({"a": tf.Variable([0.0]), "b": tf.Variable([0.0])}, tmp_path / "v.ckz")


def test_load_returns_tf_tensors(tmp_path: pathlib.Path) -> None:
    ckptzip.save({"w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "n": 3}, tmp_path / "t.ckz")
    loaded = ckz.load(tmp_path / "t.ckz")
    assert loaded["n"] == 3 and loaded["w"].dtype == tf.bfloat16 and loaded["w"].shape == (2, 3)
    np.testing.assert_array_equal(tf.cast(loaded["w"], tf.float32).numpy(), np.arange(6.0).reshape(2, 3))


@pytest.mark.gpu
def test_gpu_variables_leave_as_cuda_views_and_restore_on_the_gpu(tmp_path: pathlib.Path) -> None:
    if not tf.config.list_physical_devices("GPU"):
        pytest.skip("needs TensorFlow with CUDA (pip install 'tensorflow[and-cuda]')")
    with tf.device("/GPU:0"):
        saved, fresh = variable_tree(fill=True), variable_tree(fill=False)
    view = ckz.to_torch(saved["f32"])
    assert view.is_cuda
    ckz.save(saved, tmp_path / "g.ckz")
    ckz.restore(fresh, tmp_path / "g.ckz")
    assert "GPU" in fresh["f32"].device
    assert_same_variables(tf.nest.flatten(fresh), tf.nest.flatten(saved))
