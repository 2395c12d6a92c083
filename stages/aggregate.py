"""aggregate: the sharded checkpoint -> one full checkpoint (safetensors), an ONNX model and a Hugging Face folder.

Everything streams, so a model of any size aggregates on a node that could never hold its training state:
1. the weights and the optimizer state go from the DCP shards into Hugging Face's sharded safetensors layout a few
   tensors at a time, each file read back and checked tensor by tensor against what the checkpoint held;
2. the plain single-process model, read from those files one piece at a time (embedding, each block, head),
   scores the train stage's final eval loss;
3. the ONNX inference model is traced, then given its weights one at a time (external data above
   aggregate.onnx_external_data_mb) and checked in ONNX Runtime against the torch model's outputs;
4. hf/ is written from the files, tensor by tensor, sharded like save_pretrained.
Peak memory: ONNX Runtime's (or the traced model's) copy of the weights for step 3; one piece, or one read group
and the largest tensor, otherwise. aggregate.onnx=false skips step 3.
"""
from __future__ import annotations

import torch

from plugins import checkpoint as ckpt
from plugins import consolidate, hf
from plugins.data import build_batcher
from plugins.dcp_reader import CheckpointReader
from plugins.evaluate import eval_loss_by_piece
from plugins.fsio import atomic_write_json, file_table, link_tree, read_json
from plugins.models import get_model
from plugins.models.registry import build_on_meta, materialise
from plugins.onnx.exporter import export_inference
from plugins.partition import aliases as plan_aliases
from plugins.precision import Precision
from plugins.safetensors_shards import Reader
from stages.base import Stage, StageContext

# the train stage evaluated in its layout (other reduction orders), engine (ONNX Runtime's kernels) and precision
# (bf16/fp16: the same autocast here, but maybe other kernels: the train stage may have run on a GPU)
EVAL_RTOL = {"torch": 1e-5, "ort": 1e-4}
MIXED_EVAL_RTOL = {"bf16": 2e-2, "fp16": 5e-3}
EVAL_CHUNK_BYTES = 2**30  # hidden states of the eval batches held at once by the piece-by-piece evaluation
MB = 10**6


def aggregate(ctx: StageContext) -> None:
    cfg, a = ctx.cfg, ctx.cfg.aggregate
    spec = get_model(cfg.model.name)
    source = ctx.inputs["checkpoint"]
    manifest = ckpt.read_manifest(source)
    aliases = plan_aliases(manifest["partition_plan"])
    order = [name for name, _ in build_on_meta(spec, cfg.model).named_parameters()]

    # 1. the checkpoint's state, streamed into safetensors shards (each verified as it is written)
    broken: list[str] = []
    files = consolidate.write_from_checkpoint(ctx.out, CheckpointReader(source), order,
                                              {"step": manifest["step"], "model": cfg.model.name},
                                              int(a.shard_size_mb * MB),
                                              inspect=lambda name, t: broken.append(name) if nonfinite(t) else None)
    if broken:
        raise RuntimeError(f"the checkpoint of step {manifest['step']} holds non-finite weights ({len(broken)} "
                           f"tensor(s), e.g. {broken[0]}): training diverged; nothing was aggregated")
    weights = Reader(ctx.out, consolidate.MODEL)

    def make(layers: list[int], first: bool, last: bool) -> torch.nn.Module:
        """A part of the plain model (pipeline split's contract), with its weights from the files."""
        module = materialise(spec.split(build_on_meta(spec, cfg.model), layers, first, last), torch.device("cpu"))
        consolidate.load_weights(module, weights, aliases)
        return module

    def whole() -> torch.nn.Module:
        return make(list(range(cfg.model.n_layers)), True, True)

    # 2. the plain model, a piece at a time, scores the train stage's final eval loss
    precision = Precision(cfg.precision.name, "cpu")
    pieces = [lambda: make([], True, False), *[lambda i=i: make([i], False, False) for i in range(cfg.model.n_layers)],
              lambda: make([], False, True)]
    loss = eval_loss_by_piece(pieces, spec.loss, build_batcher(cfg, ctx.inputs["tokenize"] / "tokens"),
                              cfg.train.eval_batches, precision.autocast,
                              tokens_per_chunk=EVAL_CHUNK_BYTES // (4 * cfg.model.d_model))
    trained = read_json(ctx.inputs["train"] / "summary.json")["final_eval_loss"]
    rtol = MIXED_EVAL_RTOL.get(precision.name, EVAL_RTOL[cfg.engine.name])
    if not abs(loss - trained) <= rtol * max(1.0, abs(trained)):  # nan fails too
        raise RuntimeError(f"the aggregated model's eval loss {loss!r} differs from the train stage's final eval "
                           f"loss {trained!r} by more than {rtol:g} (relative; engine={cfg.engine.name}, "
                           f"precision={precision.name})")

    # 3. an ONNX model for inference, checked in an ONNX runtime (exporter.run_graph)
    onnx_record = None
    if a.onnx:
        schema, onnx_record = export_inference(whole, weights.__getitem__, spec,
                                               cfg.model, cfg.export, cfg.engine.opset, ctx.out / "model.onnx",
                                               int(a.onnx_external_data_mb * MB))
        atomic_write_json(ctx.out / "io_schema.json", schema.to_json())

    # 4. a folder transformers loads (AutoModelForCausalLM.from_pretrained(out / "hf"))
    hf_note = hf.save_folder(ctx.out / "hf", weights, cfg.model, int(a.shard_size_mb * MB))
    if hf_note:
        ctx.log.warning("no hf/ folder: %s", hf_note)
    elif (ctx.inputs["tokenize"] / "tokenizer").is_dir():  # and the tokenizer the data was made with
        link_tree(ctx.inputs["tokenize"] / "tokenizer", ctx.out / "hf")

    onnx_diff = onnx_record["check"]["max_abs_diff"] if onnx_record else None
    record = {"source_step": manifest["step"], "source_trainer": manifest["trainer"],
              "model_config": dict(cfg.model), "optimizer": cfg.optimizer.name,
              "verification": {"state_entries": sum(f["tensors"] for f in files.values()), "state_mismatches": 0,
                               "eval_loss": loss, "train_final_eval_loss": trained,
                               "onnx_max_abs_diff": onnx_diff,
                               "onnx_check_runtime": onnx_record["check"]["runtime"] if onnx_record else None},
              "safetensors": files, "onnx": onnx_record or "skipped (aggregate.onnx=false)",
              "hf": hf_note or "hf/",
              "files": file_table(ctx.out)}
    atomic_write_json(ctx.out / "manifest.json", record)
    ctx.tracker.log_metrics({"eval_loss": loss, **({"onnx_max_abs_diff": onnx_diff} if onnx_record else {})})
    ctx.tracker.log_artifact(ctx.out / "manifest.json")
    ctx.log.info("aggregated step %d: eval loss %.6f (train stage: %.6f), %s", manifest["step"], loss, trained,
                 f"ONNX check {onnx_diff:.1e}" if onnx_record else "no ONNX model (aggregate.onnx=false)")


def nonfinite(t: torch.Tensor) -> bool:
    return t.is_floating_point() and not bool(torch.isfinite(t).all())


def _summary(out) -> str:
    v = read_json(out / "manifest.json")["verification"]
    onnx_text = f"ONNX check {v['onnx_max_abs_diff']:.1e}" if v.get("onnx_max_abs_diff") is not None else "no ONNX"
    return f"eval {v['eval_loss']:.4f} (= train), {onnx_text}"


STAGE = Stage(
    name="aggregate",
    run=aggregate,
    after=("checkpoint", "train", "tokenize"),
    reads=("model", "optimizer", "data", "train", "export", "aggregate", "engine.opset", "engine.name",
           "precision.name"),
    code=("plugins.checkpoint", "plugins.consolidate", "plugins.models", "plugins.onnx", "plugins.data",
          "plugins.evaluate", "plugins.precision", "plugins.hf", "plugins.dcp_reader", "plugins.safetensors_shards"),
    summary=_summary,
)
