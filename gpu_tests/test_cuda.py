"""The train stage on a CUDA GPU: precision, the hot loop, compiled kernels and the GPUs of local ranks, each
checked where CI cannot (it has no GPU). Small models: these check behaviour; benchmarks/gpu.py measures speed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import torch.nn.functional as F

from benchmarks.gpu import StageSide, document_batches
from plugins.data import build_batcher
from plugins.models.registry import get_model
from plugins.models.transformer import init_weights, set_attention
from plugins.parallel.mesh import pick_device
from tests.conftest import cache_entry, make_cfg, run_cli, run_debug, run_folder
from tests.test_hf import FAMILIES

STEPS = ["train.steps=10", "train.eval_every=5", "train.checkpoint_every=5", "train.log_every=5"]


def losses(tmp_path: Path, report) -> list[float]:
    train = cache_entry(tmp_path, report, "train")
    return [json.loads(line)["loss"] for line in (train / "metrics.jsonl").read_text().splitlines()]


def relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("precision,documents", [("fp32", False), ("bf16", False), ("bf16", True)])
def test_the_hot_loop_never_waits_for_the_gpu(precision, documents):
    """Between log steps nothing in a step synchronises with the host (torch's sync debug mode raises at the first
    op that would): the batch goes up through pinned memory, the clip's weights stay python floats, the loss and
    the gradient norm stay on the device; rows of documents get their block mask on the device too."""
    cfg = make_cfg("model=gpt_tiny", f"precision={precision}", "data=synthetic", "train.batch_size=8",
                   "train.seq_len=64", "train.grad_clip=1.0", "train.log_every=1000", "triton.attention=flex")
    batches = document_batches(cfg, 4, median=20) if documents else [build_batcher(cfg).train_batch(i) for i in range(4)]
    side = StageSide(cfg, pick_device(), batches)
    side.run(2)  # lazy state first: optimizer moments, cuBLAS handles, the caching allocators
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        side.run(3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(side.window.rows) == 5 and all(r["loss"].is_cuda for r in side.window.rows)
    assert all(row["loss"] > 0 for row in side.window.flush())


def test_auto_precision_trains_in_bf16_on_the_gpu_and_reports_mfu_and_memory(tmp_path):
    done = run_cli(["tracking=none", *STEPS], tmp_path, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "precision=auto: bf16" in done.stdout
    run_dir = run_folder(done)
    summary = json.loads((run_dir / "stages/train/output/summary.json").read_text())
    assert summary["precision"] == "bf16" and summary["device"] == torch.cuda.get_device_name()
    assert summary["optimizer_impl"] == "fused" and summary["attention_kernel"] in ("flash", "cudnn", "efficient")
    assert summary["memory_kind"] == "cuda" and summary["peak_memory_mb"] > 0
    if summary["peak_flops"]:  # a GPU of the peak table (H100, A100, ...); another gets no MFU rather than a guess
        assert 0 < summary["mfu"] < 1
    else:
        assert summary["mfu"] is None


@pytest.mark.parametrize("family", list(FAMILIES))
def test_flex_attention_gives_the_cpu_reference_on_rows_of_documents(family):
    """FlexAttention, compiled, on the GPU against SDPA with the dense document mask on the CPU (the path the CPU
    suite checks against transformers): the same weights, rows of several documents, fp32 without TF32; the
    log-probabilities and every gradient."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = make_cfg(*FAMILIES[family][0], "train.seq_len=128", "train.batch_size=2")
    spec = get_model(cfg.model.name)
    (batch,) = document_batches(cfg, 1, seed=1, median=30)
    assert batch.documents.max() >= 3
    results = {}
    for device, kernel in (("cpu", "sdpa"), ("cuda", "flex")):
        model = spec.build(cfg.model)
        init_weights(model, cfg.model, seed=0)
        set_attention(model.to(device), kernel)
        logits = model(batch.inputs.to(device), documents=batch.documents.to(device))
        F.cross_entropy(logits.flatten(0, 1), batch.labels.to(device).flatten(), ignore_index=-100).backward()
        results[kernel] = (F.log_softmax(logits.detach(), -1).cpu(),
                           {n: p.grad.cpu() for n, p in model.named_parameters()})
    (ref, ref_grads), (got, got_grads) = results["sdpa"], results["flex"]
    # relative to each gradient, with a floor: some are zero but for rounding (a key bias shifts a query's scores
    # alike, which the softmax ignores)
    floor = 1e-6 * torch.cat([g.flatten() for g in ref_grads.values()]).norm()
    worst = max(((got_grads[n] - g).norm() / (g.norm() + floor)).item() for n, g in ref_grads.items())
    print(f"{family}: log-probabilities within {(got - ref).abs().max().item():.2e}, gradients {worst:.2e}")
    assert (got - ref).abs().max() <= 1e-4
    assert worst <= 1e-4


def test_rows_of_whole_documents_train_with_flex_attention_on_the_gpu(tmp_path):
    """triton.attention=auto picks FlexAttention for rows of whole records on a GPU; the losses are those of SDPA's
    dense mask (fp32, no TF32), and bf16 follows them within 2e-2."""
    from tests.test_finetune import args, records

    records(tmp_path / "qa.jsonl")
    data = [*FAMILIES["llama"][0], *args(tmp_path / "qa.jsonl", packing=True, seq_len=96), *STEPS]
    runs = {name: run_debug(tmp_path / name, *data, *extra) for name, extra in (
        ("auto", ["precision=fp32", "precision.tf32=false"]),
        ("sdpa", ["precision=fp32", "precision.tf32=false", "triton.attention=sdpa"]),
        ("bf16", ["precision=bf16"]))}
    summary = json.loads((cache_entry(tmp_path / "auto", runs["auto"], "train") / "summary.json").read_text())
    assert summary["attention_kernel"] == "flex", summary
    flex, sdpa, bf16 = (losses(tmp_path / name, runs[name]) for name in ("auto", "sdpa", "bf16"))
    print(f"flex vs sdpa (fp32): {relative(flex, sdpa):.2e}; bf16 flex vs fp32: {relative(bf16, sdpa):.2e}")
    assert relative(flex, sdpa) <= 1e-4, (flex, sdpa)
    assert relative(bf16, sdpa) <= 2e-2, (bf16, sdpa)


def test_mixed_precision_losses_follow_fp32_on_the_gpu(tmp_path):
    """bf16 and fp16 (loss scaling) within 2e-2 of fp32 over 10 steps, as the CPU suite asks of bf16 there."""
    runs = {p: losses(tmp_path / p, run_debug(tmp_path / p, f"precision={p}", "precision.tf32=false", *STEPS))
            for p in ("fp32", "bf16", "fp16")}
    assert len(runs["fp32"]) == 10
    assert relative(runs["bf16"], runs["fp32"]) <= 2e-2, runs
    assert relative(runs["fp16"], runs["fp32"]) <= 2e-2, runs


def test_compiled_blocks_give_the_eager_losses_in_bf16(tmp_path):
    eager, compiled = (losses(tmp_path / name, run_debug(tmp_path / name, "precision=bf16", *STEPS, *extra))
                       for name, extra in (("eager", []), ("compiled", ["triton=on"])))
    assert relative(compiled, eager) <= 1e-2, (compiled, eager)


def test_each_local_rank_gets_a_gpu_of_its_own(tmp_path):
    """With two GPUs or more, ddp2 trains with the losses of one GPU (NCCL); with one, it is refused before
    launch, naming the fix."""
    args = ["parallel=ddp2", "tracking=none", "precision=fp32", *STEPS]
    done = run_cli(args, tmp_path, timeout=900)
    if torch.cuda.device_count() < 2:
        said = " ".join(done.stderr.split())  # the refusal, its lines joined
        assert done.returncode == 2 and "x parallel=" in said and "CUDA GPU of its own" in said, said
        return
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    single = losses(tmp_path / "one", run_debug(tmp_path / "one", "precision=fp32", *STEPS))
    run_dir = run_folder(done)
    rows = (run_dir / "stages/train/output/metrics.jsonl").read_text().splitlines()
    assert relative([json.loads(r)["loss"] for r in rows], single) <= 1e-3


def on_host(state: dict) -> dict:
    return {part: {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in entries.items()}
            for part, entries in state.items()}


def test_async_saves_from_the_gpu_hold_their_steps_state(tmp_path):
    """train.async_checkpoint=async on a GPU: the state is copied to host memory before the save returns, so the
    steps queued after it do not reach its files, and the next save holds its own step's state."""
    from storage import checkpoint as ckpt
    cfg = make_cfg("model=gpt_tiny", "data=synthetic", "train.batch_size=4", "train.seq_len=64",
                   "train.log_every=1000")
    batches = [build_batcher(cfg).train_batch(i) for i in range(2)]
    side = StageSide(cfg, pick_device(), batches)
    parts = list(zip(side.layout.parts, side.optimizers))
    saved = []
    for step in (1, 4):
        side.run(1)
        state = on_host(ckpt.training_state(parts))
        pending = ckpt.save_async(ckpt.step_dir(tmp_path, step), parts, {"step": step, "trainer": {}})
        side.run(2)  # queued on the GPU while the files are written
        saved.append((state, pending.finish()))
    assert not torch.equal(saved[0][0]["model"]["wte.weight"], saved[1][0]["model"]["wte.weight"])
    for state, path in saved:
        fresh = StageSide(cfg, pick_device(), batches)
        fresh_parts = list(zip(fresh.layout.parts, fresh.optimizers))
        ckpt.load(path, fresh_parts)
        got = on_host(ckpt.training_state(fresh_parts))
        for part in ("model", "optim"):
            assert state[part].keys() == got[part].keys()
            assert all(torch.equal(v, got[part][k]) if isinstance(v, torch.Tensor) else v == got[part][k]
                       for k, v in state[part].items())
