"""Weights into an ONNX graph, one tensor at a time: inside the model, or as external data beside it.

A graph exported with its parameters as inputs holds no weights. `embed` turns those inputs into initializers,
reading each weight when its turn comes: inside the proto while the total stays under a threshold (protobuf cannot
serialise more than 2 GiB), else in `<model>.data` (ONNX's external data: each initializer names the file, an
offset and a length), which ONNX Runtime and onnx.load read from beside the model. Memory holds one weight.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable

import onnx
import torch
from onnx.external_data_helper import set_external_data
from onnx.helper import np_dtype_to_tensor_dtype

ALIGN = 4096  # each external tensor starts on a page: ONNX Runtime can map it instead of copying


def embed(model: onnx.ModelProto, names: list[str], weight: Callable[[str], torch.Tensor], path: Path,
          external_above_bytes: int) -> dict:
    """Make the graph inputs `names` initializers with the values weight(name), and save the model at path.

    A weight the graph reads only through a Transpose (how the exporter writes every Linear when weights are inputs)
    is stored transposed under that node's output name and the node dropped: what constant folding would have done,
    and what ONNX Runtime would otherwise do at every load, holding each weight twice. Returns {"bytes": the
    initializers' bytes, "external_data": the data file's name or None}."""
    path = Path(path)
    inputs = {i.name: i for i in model.graph.input}
    folded = _fold_transposes(model, set(names), inputs)
    used = {i for node in model.graph.node for i in node.input} | {o.name for o in model.graph.output}
    stored = [(n, n, False) for n in names if n in used] + [(new, source, True) for new, source in folded.items()]
    size = sum(_numel(inputs[source]) * _itemsize(inputs[source]) for _, source, _ in stored)
    external = size > external_above_bytes
    data_name = f"{path.name}.data"
    offset = 0
    with open(path.with_name(data_name), "wb") if external else contextlib.nullcontext() as data:
        for name, source, transpose in stored:
            value = weight(source).detach().cpu()
            value = (value.t() if transpose else value).contiguous().numpy()
            tensor = onnx.TensorProto(name=name, dims=list(value.shape), data_type=np_dtype_to_tensor_dtype(value.dtype))
            if external:
                data.write(b"\0" * (-offset % ALIGN))
                offset += -offset % ALIGN
                data.write(memoryview(value).cast("B"))
                tensor.raw_data = b""  # set_external_data insists on the field; onnx's own converter clears it after
                set_external_data(tensor, data_name, offset, value.nbytes)
                tensor.ClearField("raw_data")
                tensor.data_location = onnx.TensorProto.EXTERNAL
                offset += value.nbytes
            else:
                tensor.raw_data = value.tobytes()
            model.graph.initializer.append(tensor)
            del value
    kept = [i for i in model.graph.input if i.name not in set(names)]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    onnx.save(model, path)
    return {"bytes": size, "external_data": data_name if external else None}


def _fold_transposes(model: onnx.ModelProto, params: set[str], inputs: dict) -> dict[str, str]:
    """Drop every 2-D Transpose of a parameter; returns {its output's name: the parameter} (stored transposed)."""
    folded, keep = {}, []
    for node in model.graph.node:
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0])
        if node.op_type == "Transpose" and node.input[0] in params and perm == [1, 0] and \
                len(inputs[node.input[0]].type.tensor_type.shape.dim) == 2:
            folded[node.output[0]] = node.input[0]
        else:
            keep.append(node)
    del model.graph.node[:]
    model.graph.node.extend(keep)
    return folded


def _numel(value_info: onnx.ValueInfoProto) -> int:
    n = 1
    for d in value_info.type.tensor_type.shape.dim:
        n *= d.dim_value
    return n


def _itemsize(value_info: onnx.ValueInfoProto) -> int:
    return onnx.helper.tensor_dtype_to_np_dtype(value_info.type.tensor_type.elem_type).itemsize
