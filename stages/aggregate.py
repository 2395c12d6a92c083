"""aggregate: the sharded checkpoint -> one full checkpoint (safetensors) and an ONNX model for inference.

Both are verified before they are published: the files reproduce the checkpoint's state bit for bit,
a plain single-process model loaded from them scores the train stage's final eval loss, and the ONNX
model's logits in ONNX Runtime match the torch model's.
"""
from __future__ import annotations

import onnx
import torch

from plugins import checkpoint as ckpt
from plugins import consolidate
from plugins.data import build_batcher, data_fingerprint
from plugins.evaluate import eval_loss
from plugins.fsio import atomic_write_json, file_table, read_json
from plugins.models import get_model
from plugins.onnx.exporter import export_model
from plugins.optim import build_optimizer
from plugins.partition import aliases as plan_aliases
from stages.base import Stage, StageContext

# the train stage evaluated in its layout (other reduction orders) and engine (ONNX Runtime's kernels)
EVAL_RTOL = {"torch": 1e-5, "ort": 1e-4}


def aggregate(ctx: StageContext) -> None:
    cfg = ctx.cfg
    spec = get_model(cfg.model.name)
    source = ctx.inputs["checkpoint"]

    # the distributed state, loaded into a plain single-process model and optimizer
    aliases = plan_aliases(ckpt.read_manifest(source)["partition_plan"])
    model = spec.build(cfg.model)
    optimizer = build_optimizer(cfg.optimizer, model)
    manifest = ckpt.load(source, [(model, optimizer)], aliases)
    expected = _clone(ckpt.training_state([(model, optimizer)], aliases))

    consolidate.save(ctx.out, model, optimizer, {"step": manifest["step"], "model": cfg.model.name})

    # 1. the files hold exactly the checkpoint's state
    plain = spec.build(cfg.model)
    plain_optimizer = build_optimizer(cfg.optimizer, plain)
    consolidate.load(ctx.out, plain, plain_optimizer)
    mismatches = _mismatches(expected, ckpt.training_state([(plain, plain_optimizer)], aliases))
    if mismatches:
        raise RuntimeError(f"aggregated files differ from the checkpoint in {len(mismatches)} entries: {mismatches[:5]}")

    # 2. a plain model loaded from them scores the train stage's final eval loss
    loss = eval_loss(plain, spec.loss, build_batcher(cfg), cfg.train.eval_batches)
    trained = read_json(ctx.inputs["train"] / "summary.json")["final_eval_loss"]
    rtol = EVAL_RTOL[cfg.engine.name]
    if abs(loss - trained) > rtol * max(1.0, abs(trained)):
        raise RuntimeError(f"the aggregated model's eval loss {loss!r} differs from the train stage's final eval "
                           f"loss {trained!r} by more than {rtol:g} (relative; engine={cfg.engine.name})")

    # 3. an ONNX model for inference (weights inside), checked in ONNX Runtime
    graph, schema, onnx_record = export_model(plain, spec, cfg.model, cfg.export, cfg.engine.opset,
                                              params_as_inputs=False)
    onnx_diff = onnx_record["check"]["max_abs_diff"]
    onnx.save(graph, ctx.out / "model.onnx")
    atomic_write_json(ctx.out / "io_schema.json", schema.to_json())

    record = {"source_step": manifest["step"], "source_trainer": manifest["trainer"],
              "model_config": dict(cfg.model), "optimizer": cfg.optimizer.name,
              "verification": {"state_entries": sum(len(v) for v in expected.values()), "state_mismatches": 0,
                               "eval_loss": loss, "train_final_eval_loss": trained,
                               "onnx_max_abs_diff": onnx_diff},
              "files": file_table(ctx.out)}
    atomic_write_json(ctx.out / "manifest.json", record)
    ctx.tracker.log_metrics({"eval_loss": loss, "onnx_max_abs_diff": onnx_diff})
    ctx.tracker.log_artifact(ctx.out / "manifest.json")
    ctx.log.info("aggregated step %d: eval loss %.6f (train stage: %.6f), ONNX check %.1e",
                 manifest["step"], loss, trained, onnx_diff)


def _clone(state: dict) -> dict:
    return {part: {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in entries.items()}
            for part, entries in state.items()}


def _mismatches(expected: dict, got: dict) -> list[str]:
    bad = []
    for part in expected:
        for k in expected[part].keys() | got[part].keys():
            a, b = expected[part].get(k), got[part].get(k)
            same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                    and torch.equal(a, b)) or (not isinstance(a, torch.Tensor) and a == b)
            if not same:
                bad.append(f"{part}:{k}")
    return sorted(bad)


def _summary(out) -> str:
    v = read_json(out / "manifest.json")["verification"]
    return f"eval {v['eval_loss']:.4f} (= train), ONNX check {v['onnx_max_abs_diff']:.1e}"


STAGE = Stage(
    name="aggregate",
    run=aggregate,
    after=("checkpoint", "train"),
    reads=("model", "optimizer", "data", "train", "export", "engine.opset", "engine.name"),
    code=("plugins.checkpoint", "plugins.consolidate", "plugins.models", "plugins.onnx", "plugins.data",
          "plugins.evaluate"),
    fingerprint=data_fingerprint,
    summary=_summary,
)
