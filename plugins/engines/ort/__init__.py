"""The ONNX Runtime engine: graphs built by the transform stage (graphs.py), run during training by
TrainingAgent inside a torch.autograd.Function (runtime.py), between Megatron's f/g collectives
(megatron.py), installed on a model's blocks by engine.py."""
