"""aggregate: the sharded checkpoint -> one full checkpoint (safetensors), an ONNX model and a Hugging Face folder.

Everything streams, so a model of any size aggregates on a node that could never hold its training state:
1. the weights and the optimizer state go from the DCP shards into Hugging Face's sharded safetensors layout a few
   tensors at a time, by a thread each, each file read back and checked tensor by tensor against what was written.
   The weights are written once: as hf/, the folder transformers loads, where the model has that form (the reader,
   storage.consolidate.weights, maps it back to our names bit for bit), else as model.safetensors;
2. the plain single-process model, read from those files one piece at a time (embedding, each block, head),
   scores the train stage's final eval loss;
3. the export stage's graph (the same model, its parameters as inputs) becomes the ONNX inference model: dropout
   off, the weights written in one at a time (external data above aggregate.onnx_external_data_mb), checked in ONNX
   Runtime against the plain model's outputs (made piece by piece, in step 2's pass over the parts).
Steps 2 and 3 start as soon as the weights are written: the optimizer state (twice their bytes with AdamW) is
still being written beside them, so the disk keeps writing while they compute. No step holds the model. Peak
memory: ONNX Runtime's copy of the weights in step 3 (aggregate.onnx=false skips it), else one piece, or each
writer's read group and the largest tensor, plus the optimizer state's writer beside steps 2 and 3; the manifest
records the process's peak after each phase (peak_rss_mb: weights, eval, onnx, optimizer state), so the streaming
steps' own peak is the one after the eval. The file table of everything written is the cache entry's
(_entry.json), checked on every reuse.
"""
from __future__ import annotations

import resource
import time
from pathlib import Path

import onnx
import torch

from storage import checkpoint as ckpt
from storage import consolidate
from storage import adapters, disk_speed, hf
from storage.adapters import MergedSource
from plugins.data import build_batcher
from plugins.engines import get_engine
from storage.dcp_reader import CheckpointReader
from runtime.evaluate import eval_loss_by_piece, piece_budgets
from storage.fsio import atomic_write_json, link_tree, read_json, tree_bytes
from plugins.models import get_model
from plugins.models.lora import apply_lora
from plugins.models.registry import build_on_meta, materialise, vocab_rows
from plugins.onnx.exporter import check_shape, save_inference
from plugins.onnx.io_schema import IOSchema
from runtime.precision import Precision
from storage.weights import load_full, tied_aliases
from stages.base import Stage, StageContext

# the train stage evaluated in its layout (other reduction orders), engine (ONNX Runtime's kernels) and precision
# (bf16/fp16: the same autocast here, but maybe other kernels: the train stage may have run on a GPU)
MIXED_EVAL_RTOL = {"bf16": 2e-2, "fp16": 5e-3}
MB = 10**6


def aggregate(ctx: StageContext) -> None:
    cfg, a = ctx.cfg, ctx.cfg.aggregate
    spec = get_model(cfg.model.name)
    source = ctx.inputs["checkpoint"]
    manifest = ckpt.read_manifest(source)
    aliases = tied_aliases(manifest["partition_plan"])
    base_model = build_on_meta(spec, cfg.model)
    order = [name for name, _ in base_model.named_parameters()]
    reader = CheckpointReader(source)
    # the base a LoRA checkpoint's adapters apply to (init_from's, or the one a continued LoRA checkpoint names)
    base_folder = adapters.base_folder(cfg.train.init_from) if cfg.peft.name == "lora" else None
    if base_folder is not None:  # the checkpoint holds the adapters: the whole model is the base's with them merged
        order = [name for name, _ in apply_lora(build_on_meta(spec, cfg.model), cfg.peft).named_parameters()]
        base = hf.load_state(base_folder, vocab_rows(cfg.model))
        reader = MergedSource(reader, base, {n: (tuple(p.shape), torch.float32) for n, p in
                                             base_model.named_parameters()}, cfg.peft.alpha / cfg.peft.rank)

    seconds: dict[str, float] = {}
    peak_rss_mb: dict[str, float] = {}  # the process's peak so far after each phase (the phases run in this order)
    clock = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal clock
        seconds[phase] = time.perf_counter() - clock
        peak_rss_mb[phase] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        clock = time.perf_counter()

    checked: dict = {}  # what the checks of the weights found, while the optimizer state was still being written

    def check_weights(files: dict) -> None:
        """2. and 3., on the weights' files as soon as they are written (the optimizer state's writing goes on)."""
        if broken:
            raise RuntimeError(f"the checkpoint of step {manifest['step']} holds non-finite weights ({len(broken)} "
                               f"tensor(s), e.g. {broken[0]}): training diverged; nothing was aggregated")
        if "hf_note" in files:
            ctx.log.warning("no hf/ folder: %s", files["hf_note"])
        elif (ctx.inputs["tokenize"] / "tokenizer").is_dir():  # and the tokenizer the data was made with
            link_tree(ctx.inputs["tokenize"] / "tokenizer", ctx.out / consolidate.HF)
        lap("weights")
        weights = consolidate.weights(ctx.out)
        # the ONNX check's inputs, and their outputs made in the eval's pass over the model's parts
        args = spec.example_inputs(cfg.model, *check_shape(cfg.export, cfg.model.max_seq_len)) if a.onnx else ()
        checked["loss"], checked["trained"], reference = evaluate(weights, list(args))
        lap("eval")
        if a.onnx:
            checked["onnx"] = inference_model(weights, args, reference)
            lap("onnx")

    def evaluate(weights, beside: list) -> tuple[float, float, list]:
        """The plain model, a piece at a time, scores the train stage's final eval loss: (its loss, the train
        stage's, its fp32 outputs for `beside`, made in the same pass)."""
        precision = Precision(cfg.precision.name, "cpu")
        loss, outputs = eval_loss_by_piece(pieces(weights), spec.loss,
                                           build_batcher(cfg, ctx.inputs["tokenize"] / "tokens"),
                                           cfg.train.eval_batches, precision.autocast,
                                           *piece_budgets(cfg.model.d_model, vocab_rows(cfg.model)), beside=beside)
        summary = read_json(ctx.inputs["train"] / "summary.json")  # an objective of rows: its examples' next-token loss
        trained = summary.get("final_eval_nll", summary["final_eval_loss"])
        rtol = MIXED_EVAL_RTOL.get(precision.name, get_engine(cfg.engine.name).eval_rtol)
        if not abs(loss - trained) <= rtol * max(1.0, abs(trained)):  # nan fails too
            raise RuntimeError(f"the aggregated model's next-token eval loss {loss!r} differs from the train stage's "
                               f"final eval loss (next-token) {trained!r} by more than {rtol:g} (relative; engine="
                               f"{cfg.engine.name}, precision={precision.name})")
        return loss, trained, outputs

    def inference_model(weights, args: tuple, reference: list) -> dict:
        """An ONNX model for inference: the export stage's graph (the same model, parameters as inputs) with the
        weights written in, checked in an ONNX runtime (exporter.run_graph) against the plain model's outputs for
        `args` (the reference, made piece by piece)."""
        graph = onnx.load(ctx.inputs["export"] / "model.onnx")
        schema = IOSchema.from_json(read_json(ctx.inputs["export"] / "io_schema.json"))
        made = save_inference(graph, schema, weights.__getitem__, args, reference, cfg.export,
                              ctx.out / "model.onnx", int(a.onnx_external_data_mb * MB))
        atomic_write_json(ctx.out / "io_schema.json", schema.to_json())
        return made

    def make(weights, layers: list[int], first: bool, last: bool) -> torch.nn.Module:
        """A part of the plain model (pipeline split's contract), with its weights from the files."""
        module = materialise(spec.split(build_on_meta(spec, cfg.model), layers, first, last), torch.device("cpu"))
        load_full(module, weights, aliases)
        return module

    def pieces(weights) -> list:
        """The plain model in parts: the embedding, each block, the head (runtime.evaluate.forward_streams)."""
        n = cfg.model.n_layers
        return [lambda: make(weights, [], True, False),
                *[lambda i=i: make(weights, [i], False, False) for i in range(n)],
                lambda: make(weights, [], False, True)]

    # 1. the checkpoint's state, streamed into safetensors shards (each verified as it is written): the weights once,
    # as the Hugging Face folder hf/ where the model has that form, and the optimizer state, by a thread each; the
    # weights checked (2, 3) as soon as they are written, while the optimizer state's writing goes on
    index = read_json(ctx.inputs["tokenize"] / "tokens" / "index.json")
    broken: list[str] = []
    files = consolidate.write_from_checkpoint(ctx.out, reader, order,
                                              {"step": manifest["step"], "model": cfg.model.name},
                                              int(a.shard_size_mb * MB),
                                              inspect=lambda name, t: broken.append(name) if nonfinite(t) else None,
                                              model_cfg=cfg.model,
                                              token_ids={k: index[t] for k, t in (("eos_token_id", "eos"),
                                                                                  ("pad_token_id", "pad"))
                                                         if index[t] < cfg.model.vocab_size},
                                              with_weights=check_weights, known=ctx.hashes)
    lap("optimizer state")  # what its writing took beyond the checks
    peft_note = None
    if cfg.peft.name == "lora" and cfg.peft.trainable:  # peft's folder would hold the adapters without them
        peft_note = (f"no peft/ folder: peft.trainable={list(cfg.peft.trainable)} trained besides the adapters, and "
                     "peft's folder holds adapters only; hf/ holds every trained weight, merged")
        ctx.log.warning("%s", peft_note)
    elif cfg.peft.name == "lora":  # and the adapters alone, as peft's folder
        files[adapters.PEFT] = adapters.write_peft_folder(ctx.out / adapters.PEFT, CheckpointReader(source), cfg.peft,
                                                          cfg.model, str(base_folder.resolve()))
    hf_note = files.pop("hf_note", None)
    loss, trained, onnx_record = checked["loss"], checked["trained"], checked.get("onnx")

    onnx_diff = onnx_record["check"]["max_abs_diff"] if onnx_record else None
    record = {"source_step": manifest["step"], "source_trainer": manifest["trainer"],
              "model_config": dict(cfg.model), "optimizer": cfg.optimizer.name,
              "verification": {"state_entries": sum(f["tensors"] for f in files.values()), "state_mismatches": 0,
                               "eval_loss": loss, "train_final_eval_loss": trained,
                               "onnx_max_abs_diff": onnx_diff,
                               "onnx_check_runtime": onnx_record["check"]["runtime"] if onnx_record else None},
              "safetensors": files, "onnx": onnx_record or "skipped (aggregate.onnx=false)",
              "hf": hf_note or "hf/", "seconds": seconds, "peak_rss_mb": peak_rss_mb,
              **({"peft": peft_note or "peft/"} if cfg.peft.name == "lora" else {})}
    atomic_write_json(ctx.out / "manifest.json", record)
    ctx.tracker.log_metrics({"eval_loss": loss, **({"onnx_max_abs_diff": onnx_diff} if onnx_record else {})})
    ctx.tracker.log_artifact(ctx.out / "manifest.json")
    lap("manifest")
    disk_speed.record(Path(cfg.cache_dir).expanduser().resolve(), disk_speed.aggregate_kind(a.onnx),
                      tree_bytes(ctx.out), sum(seconds.values()))  # the plan's time for the next
    ctx.log.info("aggregated step %d: eval next-token loss %.6f (train stage: %.6f), %s; %s", manifest["step"],
                 loss, trained,
                 f"ONNX check {onnx_diff:.1e}" if onnx_record else "no ONNX model (aggregate.onnx=false)",
                 ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()))


def nonfinite(t: torch.Tensor) -> bool:
    return t.is_floating_point() and not bool(torch.isfinite(t).all())


def _summary(out) -> str:
    v = read_json(out / "manifest.json")["verification"]
    onnx_text = f"ONNX check {v['onnx_max_abs_diff']:.1e}" if v.get("onnx_max_abs_diff") is not None else "no ONNX"
    # next-token, as the train stage's row says for SFT; for DPO that row's eval is the pairs' loss (another number)
    return f"eval next-token loss {v['eval_loss']:.4f} (= train's), {onnx_text}"


STAGE = Stage(
    name="aggregate",
    run=aggregate,
    after=("checkpoint", "train", "tokenize", "export"),
    reads=("model", "optimizer", "data", "train", "export", "aggregate", "engine.opset", "engine.name", "peft",
           "precision.name"),
    summary=_summary,
)
