"""Running a unit's forward and backward graphs in ONNX Runtime from torch autograd.

OrtUnit holds one InferenceSession over the unit's fw+bw graph and a TrainingAgent (the pieces ORTModule
used, still in onnxruntime-training 1.19.2). `apply(*inputs)` runs the forward; autograd calls the
backward with the output gradients. Tensors cross by DLPack without copies (made contiguous first). The
inputs are saved for backward, so an in-place change of a parameter between forward and backward is caught
by torch's version check instead of silently using other values.

Zero-bubble pipeline schedules (zbv, interleaved_zb) split a backward in two: torch calls a node's backward once
for the input gradient and again, later, for the weight gradients. ORT's backward yields both at once, so the
first call runs it and keeps the gradients; the second returns them (one ORT backward per forward: counted in
`runs`).
"""
from __future__ import annotations

import torch
from torch.utils.dlpack import to_dlpack

from plugins.engines.ort.graphs import OrtGraphError

# ORT backend severity per engine.log_level (ORT: 0 verbose, 1 info, 2 warning, 3 error, 4 fatal)
SEVERITY = {"VERBOSE": 0, "DEVINFO": 1, "INFO": 2, "WARNING": 3}


def _to_ort(tensors):  # -> onnxruntime.capi._pybind_state.OrtValueVector
    from onnxruntime.capi import _pybind_state as C

    vec = C.OrtValueVector()
    vec.reserve(len(tensors))
    for t in tensors:
        if type(t) is not torch.Tensor and callable(getattr(t, "wait", None)):
            # an AsyncCollectiveTensor (e.g. a tensor-parallel embedding's all-reduced output that no torch op has
            # touched yet): its memory is valid only once waited for; DLPack would hand ORT a dangling pointer
            t = t.wait()
        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        if t.dtype == torch.bool:  # DLPack has no bool: ORTModule's workaround
            vec.push_back(to_dlpack(t.to(torch.uint8)), True)
        else:
            vec.push_back(to_dlpack(t), False)
    return vec


def _from_ort(vec) -> list[torch.Tensor]:
    from torch._C import _from_dlpack

    out = list(vec.to_dlpacks(_from_dlpack))
    for j in vec.bool_tensor_indices():
        out[j] = out[j].to(torch.bool)
    return out


class OrtUnit:
    """One unit graph, ready to run: `unit.apply(x, *params)` is differentiable like a torch function."""

    def __init__(self, grad_model: bytes, record: dict, threads: int, severity: int, device: torch.device):
        import onnxruntime as ort
        from onnxruntime.capi import _pybind_state as C

        ort.set_default_logger_severity(severity)
        self.record = record
        opts = ort.SessionOptions()
        opts.enable_mem_pattern = False  # ORTModule's settings for partial (forward / backward) runs
        opts.enable_mem_reuse = False
        opts.log_severity_level = severity
        opts.intra_op_num_threads = threads
        opts.add_session_config_entry("session.disable_prepacking", "1")
        # ORT's idle workers spin between calls and steal the cores torch's threads need: 4.4x slower
        # than torch at 2 threads with spinning, 1.3x without (benchmarks/ort_engine.py)
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = ["CUDAExecutionProvider"] if device.type == "cuda" else ["CPUExecutionProvider"]
        try:
            self.session = ort.InferenceSession(grad_model, opts, providers=providers)
            ort_device = C.OrtDevice(C.OrtDevice.cuda() if device.type == "cuda" else C.OrtDevice.cpu(),
                                     C.OrtDevice.default_memory(), device.index or 0)
            n_forward = len(record["user_outputs"]) + record["frontier_outputs"]
            self.agent = C.TrainingAgent(self.session._sess, record["graph_inputs"], [ort_device] * n_forward,
                                         record["backward_outputs"], [ort_device] * len(record["backward_outputs"]), 0)
        except Exception as e:
            raise OrtGraphError(f"ONNX Runtime could not start a session for the graph: {str(e).strip().splitlines()[0]}") from e
        trainable = set(record["trainable"])
        order, k = [], 0
        for name in record["graph_inputs"]:  # graph input i -> index of its gradient among backward outputs
            order.append(k if name in trainable else -1)
            k += name in trainable
        self.gradient_index = order
        self.runs = {"forward": 0, "backward": 0}
        self.function = self._make_function()

    def apply(self, *inputs: torch.Tensor):
        outputs = self.function.apply(*inputs)
        return outputs[0] if len(outputs) == 1 else outputs

    def _make_function(self):
        from onnxruntime.capi import _pybind_state as C

        agent, record, gradient_index, runs = self.agent, self.record, self.gradient_index, self.runs
        non_differentiable = set(record["non_differentiable_outputs"])
        full_shape = set(record["full_shape_output_grads"])

        class OrtFunction(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *inputs):
                state = C.PartialGraphExecutionState()
                outputs = C.OrtValueVector()
                agent.run_forward(_to_ort(inputs), outputs, state, None)
                runs["forward"] += 1
                results = _from_ort(outputs)
                ctx.state = state
                ctx.meta = [(r.shape, r.dtype, r.device) for r in results]
                ctx.save_for_backward(*inputs)  # version counters: in-place changes before backward are errors
                ctx.set_materialize_grads(False)
                for i in non_differentiable:
                    ctx.mark_non_differentiable(results[i])
                return tuple(results)

            @staticmethod
            def backward(ctx, *grads):
                ctx.saved_tensors  # noqa: B018  (raises if an input was modified in place since forward)
                if getattr(ctx, "gradients", None) is not None:  # a split backward's second call (weights)
                    gradients, ctx.gradients = ctx.gradients, None
                    return gradients
                feeds = []
                for i, g in enumerate(grads):
                    if i in non_differentiable:
                        continue
                    if g is None:
                        shape, dtype, device = ctx.meta[i]
                        g = torch.zeros(shape, dtype=dtype, device=device) if i in full_shape else \
                            torch.tensor(0.0, dtype=dtype, device=device)
                    feeds.append(g)
                outputs = C.OrtValueVector()
                agent.run_backward(_to_ort(feeds), outputs, ctx.state)
                runs["backward"] += 1
                del ctx.state
                results = _from_ort(outputs)
                gradients = tuple(results[k] if k >= 0 else None for k in gradient_index)
                ctx.gradients = gradients  # for a second call; freed with the graph when none comes
                return gradients

        return OrtFunction
