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
    Returns {"bytes": weights' bytes, "external_data": the data file's name or None}."""
    path = Path(path)
    inputs = {i.name: i for i in model.graph.input}
    sizes = {n: _numel(inputs[n]) * _itemsize(inputs[n]) for n in names}
    external = sum(sizes.values()) > external_above_bytes
    data_name = f"{path.name}.data"
    offset = 0
    with open(path.with_name(data_name), "wb") if external else contextlib.nullcontext() as data:
        for name in names:
            value = weight(name).detach().cpu().contiguous().numpy()
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
    return {"bytes": sum(sizes.values()), "external_data": data_name if external else None}


def _numel(value_info: onnx.ValueInfoProto) -> int:
    n = 1
    for d in value_info.type.tensor_type.shape.dim:
        n *= d.dim_value
    return n


def _itemsize(value_info: onnx.ValueInfoProto) -> int:
    return onnx.helper.tensor_dtype_to_np_dtype(value_info.type.tensor_type.elem_type).itemsize
