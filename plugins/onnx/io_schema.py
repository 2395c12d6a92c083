"""One input/output schema for ONNX graphs: flatten nested Python values to a flat tensor list, restore them.

An ONNX graph only takes and returns flat lists of tensors; modules take and return nests of tuples, lists,
dicts, None and constants. `flatten` walks a value once and records its shape as a `Node` tree (JSON-able);
`unflatten` rebuilds the same structure from a flat list. Export names graph inputs/outputs from the tree,
execution flattens with it and restores with it: one pair of primitives, not several similar recursions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

_CONST_TYPES = (bool, int, float, str)


@dataclass
class Node:
    kind: str                                  # tensor | none | const | tuple | list | dict
    name: str = ""                             # graph name of a tensor leaf
    index: int = -1                            # position of a tensor leaf in the flat list
    dtype: str = ""                            # torch dtype of a tensor leaf, e.g. "int64"
    rank: int = 0                              # number of dimensions of a tensor leaf
    dynamic: dict[int, str] = field(default_factory=dict)   # axis -> symbolic name
    value: Any = None                          # the value of a const leaf
    keys: list = field(default_factory=list)   # dict keys, in order
    items: list["Node"] = field(default_factory=list)

    def to_json(self) -> dict:
        out = {"kind": self.kind}
        if self.kind == "tensor":
            out.update(name=self.name, index=self.index, dtype=self.dtype, rank=self.rank,
                       dynamic={str(k): v for k, v in self.dynamic.items()})
        elif self.kind == "const":
            out["value"] = self.value
        elif self.kind in ("tuple", "list", "dict"):
            out["items"] = [i.to_json() for i in self.items]
            if self.kind == "dict":
                out["keys"] = list(self.keys)
        return out

    @staticmethod
    def from_json(d: dict) -> "Node":
        return Node(kind=d["kind"], name=d.get("name", ""), index=d.get("index", -1), dtype=d.get("dtype", ""),
                    rank=d.get("rank", 0), dynamic={int(k): v for k, v in d.get("dynamic", {}).items()},
                    value=d.get("value"), keys=list(d.get("keys", [])),
                    items=[Node.from_json(i) for i in d.get("items", [])])

    def leaves(self) -> list["Node"]:
        """Tensor leaves in flat-list order."""
        if self.kind == "tensor":
            return [self]
        return [leaf for item in self.items for leaf in item.leaves()]


def flatten(value: Any, name: str, dynamic_axes: Optional[dict[str, dict[int, str]]] = None,
            item_names: Optional[list[str]] = None) -> tuple[list[torch.Tensor], Node]:
    """Flatten a nest into tensors; leaf names are `name`, `name.0`, `name.key`..., except that the items
    of a top-level tuple/list are named by item_names when given (a module's positional arguments)."""
    tensors: list[torch.Tensor] = []
    dynamic_axes = dynamic_axes or {}

    def walk(v: Any, path: str) -> Node:
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            return Node("tensor", name=path, index=len(tensors) - 1, dtype=str(v.dtype).removeprefix("torch."),
                        rank=v.dim(), dynamic=dict(dynamic_axes.get(path, {})))
        if v is None:
            return Node("none")
        if isinstance(v, _CONST_TYPES):
            return Node("const", value=v)
        if isinstance(v, (tuple, list)):
            return Node(type(v).__name__, items=[walk(x, f"{path}.{i}") for i, x in enumerate(v)])
        if isinstance(v, dict):
            return Node("dict", keys=list(v), items=[walk(x, f"{path}.{k}") for k, x in v.items()])
        raise TypeError(f"{path}: cannot pass a {type(v).__name__} through an ONNX graph "
                        "(supported: tensors, tuples, lists, dicts, None, bool/int/float/str constants)")

    if item_names is not None and isinstance(value, (tuple, list)):
        if len(item_names) != len(value):
            raise ValueError(f"{name}: {len(value)} values but {len(item_names)} names {item_names}")
        return tensors, Node(type(value).__name__, items=[walk(v, n) for v, n in zip(value, item_names)])
    return tensors, walk(value, name)


def unflatten(node: Node, tensors: list) -> Any:
    """Inverse of flatten: rebuild the nest from the flat tensor list."""
    if node.kind == "tensor":
        return tensors[node.index]
    if node.kind == "none":
        return None
    if node.kind == "const":
        return node.value
    items = [unflatten(i, tensors) for i in node.items]
    if node.kind == "tuple":
        return tuple(items)
    if node.kind == "list":
        return items
    if node.kind == "dict":
        return dict(zip(node.keys, items))
    raise ValueError(f"unknown schema node kind {node.kind!r}")


@dataclass
class IOSchema:
    """The inputs and outputs of one graph: structure, names, dtypes and dynamic axes."""
    inputs: Node
    outputs: Node

    @property
    def input_names(self) -> list[str]:
        return [leaf.name for leaf in self.inputs.leaves()]

    @property
    def output_names(self) -> list[str]:
        return [leaf.name for leaf in self.outputs.leaves()]

    @property
    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        return {leaf.name: leaf.dynamic for leaf in self.inputs.leaves() + self.outputs.leaves() if leaf.dynamic}

    def to_json(self) -> dict:
        return {"inputs": self.inputs.to_json(), "outputs": self.outputs.to_json(),
                "input_names": self.input_names, "output_names": self.output_names,
                "dynamic_axes": {k: {str(a): n for a, n in v.items()} for k, v in self.dynamic_axes.items()}}

    @staticmethod
    def from_json(d: dict) -> "IOSchema":
        return IOSchema(Node.from_json(d["inputs"]), Node.from_json(d["outputs"]))
