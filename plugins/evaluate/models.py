"""The models lm-eval scores: its `hf` model (HFLM) on the aggregate's hf/ folder, and the same class with its forward
pass in ONNX Runtime on the aggregate's model.onnx.

The ONNX one is HFLM with one part replaced: `_create_model` makes a module whose forward runs the session
(input_ids -> logits, the inference graph's contract, plugins/onnx/io_schema.py) instead of loading the weights.
Everything else (the tokenizer beside hf/, batching, padding, the loglikelihoods of the continuations) is lm-eval's
own code, shared with the hf model, so a score that differs between the two is the exported graph's. The hf/
folder is read for its config and tokenizer only; its weights are not loaded twice. Generation (generate_until) is
not the graph's: generation tasks are scored from hf/ only.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch


def hf_model(hf_folder: Path, ev, device: str):
    """lm-eval's hf model on the folder (fp32, the tokenizer beside it)."""
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(hf_folder), dtype="float32", batch_size=ev.batch_size, device=device)


class _Session(torch.nn.Module):
    """An ONNX Runtime session in the place of the transformers model HFLM calls: model(input_ids).logits."""

    def __init__(self, path: Path, config, threads: int, device: str):
        super().__init__()
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        providers = (["CUDAExecutionProvider"] if device.startswith("cuda") and "CUDAExecutionProvider" in
                     ort.get_available_providers() else []) + ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(str(path), options, providers=providers)
        self.input = self.session.get_inputs()[0].name
        self.output = self.session.get_outputs()[0].name
        self.config, self.name_or_path = config, str(path)

    def forward(self, input_ids: torch.Tensor, **_) -> SimpleNamespace:
        (logits,) = self.session.run([self.output], {self.input: input_ids.detach().cpu().numpy()})
        return SimpleNamespace(logits=torch.from_numpy(logits).to(input_ids.device))

    def tie_weights(self) -> None:  # HFLM ties a transformers model's weights; the graph holds its own
        pass


def onnx_model(hf_folder: Path, onnx_path: Path, ev, device: str):
    """lm-eval's hf model whose forward is the ONNX graph's (the folder read for its config and tokenizer)."""
    from lm_eval.models.huggingface import HFLM

    from runtime.threads import usable_cores

    class OnnxLM(HFLM):
        def _create_model(self, pretrained, **kwargs) -> None:
            self._model = _Session(onnx_path, self.config, usable_cores(), device)

    return OnnxLM(pretrained=str(hf_folder), dtype="float32", batch_size=ev.batch_size, device=device)
