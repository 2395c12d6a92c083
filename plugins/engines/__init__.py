"""Engines: who executes the shard-local compute of each block. `torch` is the model's own forward;
`ort` runs each block's units (the compute between tensor-parallel collectives) in ONNX Runtime."""
