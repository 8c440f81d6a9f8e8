"""The value encoding of docs/FORMAT.md ("Values"): exact JSON forms, refusals, malformed trees."""

from __future__ import annotations

import base64
import collections
import enum
import json

import numpy as np
import pytest
import torch
from helpers import assert_same, float_from_bits, roundtrip

from ckptzip import CorruptCheckpointError, UnsupportedObjectError
from ckptzip.tree import MAX_DEPTH, flatten, unflatten


def _unflatten(tree: object, tensors: list[torch.Tensor] | None = None) -> object:
    tensors = tensors or []
    return unflatten(tree, tensors.__getitem__, len(tensors))


@pytest.mark.parametrize(
    ("value", "encoded"),
    [
        (None, None),
        (True, True),
        (-3, -3),
        (2**100, 2**100),
        ("s", "s"),
        (1.0, {"float": "3ff0000000000000"}),
        (-0.0, {"float": "8000000000000000"}),
        (float("-inf"), {"float": "fff0000000000000"}),
        (float_from_bits(0x7FF0_0000_0000_0001), {"float": "7ff0000000000001"}),
        (b"\x00\xff", {"bytes": base64.b64encode(b"\x00\xff").decode()}),
        ([1, "a"], [1, "a"]),
        ((1, (2,)), {"tuple": [1, {"tuple": [2]}]}),
        ({"a": 1, 2: None}, {"dict": [["a", 1], [2, None]]}),
        (torch.float8_e5m2, {"dtype": "float8_e5m2"}),
        (torch.device("cuda", 1), {"device": "cuda:1"}),
        (torch.Size([2, 0]), {"size": [2, 0]}),
        (np.float32(1.0), {"npscalar": ["<f4", "0000803f"]}),
        (np.float64(2.0), {"npscalar": ["<f8", "0000000000000040"]}),
    ],
)
def test_values_encode_as_the_spec_says(value: object, encoded: object) -> None:
    flat = flatten(value)
    assert flat.tree == encoded and flat.tensors == []
    assert json.loads(json.dumps(flat.tree)) == flat.tree  # plain JSON
    assert_same(_unflatten(flat.tree), value)


def test_ordered_dict_carries_metadata() -> None:
    od = collections.OrderedDict(w=1)
    od._metadata = {"": {"version": 2}}  # type: ignore[attr-defined]
    assert flatten(od).tree == {"odict": [["w", 1]], "meta": {"dict": [["", {"dict": [["version", 2]]}]]}}
    assert flatten(collections.OrderedDict()).tree == {"odict": [], "meta": None}


def test_tensors_are_referenced_by_position_and_named_by_path() -> None:
    w = torch.ones(2)
    flat = flatten({"model": {"w": w, "tied": w, "b": torch.zeros(1)}, "arr": np.arange(3), "list": [torch.ones(1)]})
    assert [t.name for t in flat.tensors] == ["model.w", "model.b", "arr", "list.0"]
    model = flat.tree["dict"][0][1]["dict"]
    assert model == [["w", {"tensor": 0}], ["tied", {"tensor": 0}], ["b", {"tensor": 1}]]
    assert flat.tree["dict"][1] == ["arr", {"ndarray": 2}]


def test_colliding_paths_get_unique_names() -> None:
    flat = flatten({"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}, "x": torch.empty(0), "y": torch.empty(0)})
    assert [t.name for t in flat.tensors] == ["a.b", "a.b#2", "x", "y"]
    assert flatten(torch.ones(1)).tensors[0].name == "tensor"


class _Custom:
    pass


class _Color(enum.Enum):
    RED = 1


@pytest.mark.parametrize(
    ("obj", "path", "kind"),
    [
        ({"model": {"hook": lambda x: x}}, "model.hook", "function"),
        ({"cfg": [1, _Custom()]}, "cfg.1", "_Custom"),
        ({"opts": {"color": _Color.RED}}, "opts.color", "_Color"),
        ({"tags": {1, 2}}, "tags", "set"),
        ({"z": 1 + 2j}, "z", "complex"),
        (_Custom(), "<root>", "_Custom"),
        ({"s": torch.ones(2, 2).to_sparse()}, "s", None),
    ],
)
def test_unsupported_objects_are_refused_with_their_path(obj: object, path: str, kind: str | None) -> None:
    with pytest.raises(UnsupportedObjectError) as info:
        flatten(obj)
    message = str(info.value)
    assert repr(path) in message
    if kind:
        assert kind in message and "loading never runs code" in message


def test_sparse_tensor_message_says_what_to_do() -> None:
    with pytest.raises(UnsupportedObjectError, match=r"tensor at 's' has layout torch.sparse_coo.*\.to_dense\(\)"):
        flatten({"s": torch.ones(2).to_sparse()})


def test_tensor_subclass_is_refused() -> None:
    class Sub(torch.Tensor):
        pass

    with pytest.raises(UnsupportedObjectError, match=r"tensor at 'x' is a .*Sub; store a plain tensor"):
        flatten({"x": torch.ones(2).as_subclass(Sub)})


def _nested(depth: int) -> object:
    obj: object = 0
    for i in range(depth):
        obj = [obj] if i % 3 == 0 else (obj,) if i % 3 == 1 else {"k": obj}
    return obj


def test_nesting_up_to_max_depth_round_trips() -> None:
    obj = _nested(MAX_DEPTH)
    assert_same(roundtrip(obj), obj)


def test_nesting_past_max_depth_is_refused() -> None:
    with pytest.raises(UnsupportedObjectError, match=f"nested deeper than {MAX_DEPTH} levels"):
        flatten(_nested(MAX_DEPTH + 1))


def test_self_referencing_object_is_refused() -> None:
    loop: list = []
    loop.append(loop)
    with pytest.raises(UnsupportedObjectError, match=r"value at '0' is the list at '<root>' that contains it \(a reference cycle\)"):
        flatten(loop)


def test_huge_int_is_refused_on_save() -> None:
    with pytest.raises(UnsupportedObjectError, match="cannot be written as JSON"):
        roundtrip({"n": 10**5000})


def _deep_tree(depth: int) -> object:
    tree: object = 1
    for _ in range(depth):
        tree = {"tuple": [tree]}
    return tree


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ({"set": [1]}, "unknown value tag 'set'"),
        ({}, "expected a tagged value"),
        (1.5, "expected a tagged value"),
        ({"float": "3ff0"}, "malformed 'float' value"),
        ({"float": "zzzzzzzzzzzzzzzz"}, "malformed 'float' value"),
        ({"float": 1.0}, "malformed 'float' value"),
        ({"bytes": "***"}, "malformed 'bytes' value"),
        ({"bytes": 5}, "malformed 'bytes' value"),
        ({"tensor": 1}, r"tree refers to tensor 1, expected an index in \[0, 1\)"),
        ({"tensor": -1}, "tree refers to tensor -1"),
        ({"tensor": True}, "tree refers to tensor True"),
        ({"tensor": "0"}, "tree refers to tensor '0'"),
        ({"ndarray": 7}, "tree refers to array 7"),
        ({"tensor": 0, "x": 1}, r"keys \['tensor', 'x'\], expected \['tensor'\]"),
        ({"odict": []}, r"expected \['meta', 'odict'\]"),
        ({"dict": [[1]]}, "malformed 'dict' value"),
        ({"dict": {"a": 1}}, "malformed 'dict' value"),
        ({"dict": [[[1], 2]]}, "unhashable dict key"),
        ({"tuple": 3}, "malformed 'tuple' value"),
        ({"npscalar": ["<f8", ""]}, "malformed 'npscalar' value"),
        ({"npscalar": ["O", "00"]}, "malformed 'npscalar' value"),
        ({"npscalar": ["not a dtype", "00"]}, "malformed 'npscalar' value"),
        ({"dtype": "Tensor"}, "malformed 'dtype' value"),
        ({"dtype": "__class__"}, "malformed 'dtype' value"),
        ({"device": "toaster:0"}, "malformed 'device' value"),
        ({"device": "cuda:-5"}, "malformed 'device' value"),
        ({"size": [-1]}, "malformed 'size' value"),
        ({"size": [1.5]}, "malformed 'size' value"),
        (_deep_tree(MAX_DEPTH + 1), f"nested deeper than {MAX_DEPTH} levels"),
        (_deep_tree(5000), "nested"),
    ],
)
def test_malformed_trees_raise_corrupt(tree: object, message: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=message):
        _unflatten(tree, [torch.zeros(1)])


def test_tree_references_share_one_tensor() -> None:
    t = torch.ones(3)
    out = _unflatten({"tuple": [{"tensor": 0}, [{"tensor": 0}]]}, [t])
    assert isinstance(out, tuple)
    assert out[0] is out[1][0] is t
