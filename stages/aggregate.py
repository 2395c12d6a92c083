"""aggregate: the sharded checkpoint -> one full checkpoint (safetensors) and an ONNX model for inference.

Both are verified before they are published: the files reproduce the checkpoint's state bit for bit,
a plain single-process model loaded from them scores the train stage's final eval loss, and the ONNX
model's logits in ONNX Runtime match the torch model's.
"""
from __future__ import annotations

import onnx
import torch

from plugins import checkpoint as ckpt
from plugins import consolidate, hf
from plugins.data import build_batcher
from plugins.evaluate import eval_loss
from plugins.fsio import atomic_write_json, file_table, link_tree, read_json
from plugins.models import get_model
from plugins.onnx.exporter import export_model
from plugins.optim import build_optimizer
from plugins.partition import aliases as plan_aliases
from plugins.precision import Precision
from stages.base import Stage, StageContext

# the train stage evaluated in its layout (other reduction orders), engine (ONNX Runtime's kernels) and precision
# (bf16/fp16: the same autocast here, but maybe other kernels: the train stage may have run on a GPU)
EVAL_RTOL = {"torch": 1e-5, "ort": 1e-4}
MIXED_EVAL_RTOL = {"bf16": 2e-2, "fp16": 5e-3}


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
    broken = _nonfinite(expected["model"])
    if broken:
        raise RuntimeError(f"the checkpoint of step {manifest['step']} holds non-finite weights ({len(broken)} "
                           f"tensor(s), e.g. {broken[0]}): training diverged; nothing was aggregated")

    consolidate.save(ctx.out, model, optimizer, {"step": manifest["step"], "model": cfg.model.name})

    # 1. the files hold exactly the checkpoint's state
    plain = spec.build(cfg.model)
    plain_optimizer = build_optimizer(cfg.optimizer, plain)
    consolidate.load(ctx.out, plain, plain_optimizer)
    mismatches = _mismatches(expected, ckpt.training_state([(plain, plain_optimizer)], aliases))
    if mismatches:
        raise RuntimeError(f"aggregated files differ from the checkpoint in {len(mismatches)} entries: {mismatches[:5]}")

    # 2. a plain model loaded from them scores the train stage's final eval loss
    precision = Precision(cfg.precision.name, "cpu")
    loss = eval_loss(plain, spec.loss, build_batcher(cfg, ctx.inputs["tokenize"] / "tokens"), cfg.train.eval_batches,
                     precision.autocast)
    trained = read_json(ctx.inputs["train"] / "summary.json")["final_eval_loss"]
    rtol = MIXED_EVAL_RTOL.get(precision.name, EVAL_RTOL[cfg.engine.name])
    if not abs(loss - trained) <= rtol * max(1.0, abs(trained)):  # nan fails too
        raise RuntimeError(f"the aggregated model's eval loss {loss!r} differs from the train stage's final eval "
                           f"loss {trained!r} by more than {rtol:g} (relative; engine={cfg.engine.name}, "
                           f"precision={precision.name})")

    # 3. an ONNX model for inference (weights inside), checked in an ONNX runtime (exporter.run_graph)
    graph, schema, onnx_record = export_model(plain, spec, cfg.model, cfg.export, cfg.engine.opset,
                                              params_as_inputs=False)
    onnx_diff = onnx_record["check"]["max_abs_diff"]
    onnx.save(graph, ctx.out / "model.onnx")

    # 4. a folder transformers loads (AutoModelForCausalLM.from_pretrained(out / "hf"))
    hf_note = hf.save_folder(ctx.out / "hf", plain.state_dict(), cfg.model)
    if hf_note:
        ctx.log.warning("no hf/ folder: %s", hf_note)
    elif (ctx.inputs["tokenize"] / "tokenizer").is_dir():  # and the tokenizer the data was made with
        link_tree(ctx.inputs["tokenize"] / "tokenizer", ctx.out / "hf")
    atomic_write_json(ctx.out / "io_schema.json", schema.to_json())

    record = {"source_step": manifest["step"], "source_trainer": manifest["trainer"],
              "model_config": dict(cfg.model), "optimizer": cfg.optimizer.name,
              "verification": {"state_entries": sum(len(v) for v in expected.values()), "state_mismatches": 0,
                               "eval_loss": loss, "train_final_eval_loss": trained,
                               "onnx_max_abs_diff": onnx_diff, "onnx_check_runtime": onnx_record["check"]["runtime"]},
              "hf": hf_note or "hf/",
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
    """Entries whose bits differ (a NaN equals the same NaN: the comparison is of the stored bytes)."""
    bad = []
    for part in expected:
        for k in expected[part].keys() | got[part].keys():
            a, b = expected[part].get(k), got[part].get(k)
            same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                    and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))) or \
                (not isinstance(a, torch.Tensor) and a == b)
            if not same:
                bad.append(f"{part}:{k}")
    return sorted(bad)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _nonfinite(state: dict) -> list[str]:
    return sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_floating_point()
                  and not torch.isfinite(v).all())


def _summary(out) -> str:
    v = read_json(out / "manifest.json")["verification"]
    return f"eval {v['eval_loss']:.4f} (= train), ONNX check {v['onnx_max_abs_diff']:.1e}"


STAGE = Stage(
    name="aggregate",
    run=aggregate,
    after=("checkpoint", "train", "tokenize"),
    reads=("model", "optimizer", "data", "train", "export", "engine.opset", "engine.name", "precision.name"),
    code=("plugins.checkpoint", "plugins.consolidate", "plugins.models", "plugins.onnx", "plugins.data",
          "plugins.evaluate", "plugins.precision", "plugins.hf"),
    summary=_summary,
)
