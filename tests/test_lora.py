"""LoRA (peft=lora): adapters train beside a frozen imported model, as peft's LoraModel trains them on the
transformers model; the checkpoints hold the adapters alone; the aggregate writes the merged hf/ folder and peft's
folder, which peft loads to the merged folder's logits; data and pipeline parallelism give one process's losses."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from plugins.data.batcher import build_batcher
from plugins.models.lora import initial_A
from storage.dcp_reader import CheckpointReader
from storage.hf import GPT2_CONV, LLAMA_NAMES
from tests.conftest import make_cfg, run_cli
from tests.test_finetune import args, plain_loop, records
from tests.test_hf import FAMILIES, saved

import peft  # noqa: E402  (installed with lm-eval's hf model: .[eval], part of .[dev])
import transformers  # noqa: E402

STEPS, LR, SEED = 8, 0.05, 1234
# the adapters of each family whose module is one module of transformers' too (GPT-2's q, k and v are one c_attn)
TARGETS = {"llama": ("[attention,mlp]", [t.split(".")[-1] for t, m in LLAMA_NAMES.items() if "proj" in t]),
           "gpt": ("[wo,mlp]", [t.split(".")[-1] for t in GPT2_CONV])}


def _losses(work: Path) -> list[float]:
    (metrics,) = (work / "runs" / "cache" / "train").glob("*/metrics.jsonl")
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def _run(tmp_path: Path, family: str, folder: Path, targets: str, *extra: str, work: str = "work"
         ) -> tuple[list[str], Path]:
    records(tmp_path / "qa.jsonl")
    overrides = [*FAMILIES[family][0], *args(tmp_path / "qa.jsonl", packing=True, seq_len=96),
                 f"train.init_from=hf:{folder}", "peft=lora", f"peft.targets={targets}", "peft.rank=4",
                 "peft.alpha=8", f"train.steps={STEPS}", "train.eval_every=0", "train.checkpoint_every=4",
                 "train.grad_clip=0", "optimizer=sgd", f"optimizer.lr={LR}", "optimizer.momentum=0",
                 "optimizer.schedule=constant", "optimizer.weight_decay=0", "optimizer.warmup_steps=0",
                 "tracking=none", f"train.seed={SEED}", *extra]
    (tmp_path / work).mkdir()
    result = run_cli(overrides, tmp_path / work, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return overrides, tmp_path / work


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_trains_as_peft_does_on_the_transformers_model_and_peft_loads_what_it_wrote(tmp_path, family):
    """Eight steps of packed records through every stage against peft's LoraModel on transformers' model, the same
    initial adapters, a plain SGD loop: the losses agree to 1e-5. The checkpoint holds the adapters only; peft loads
    the aggregate's peft/ folder onto the base and gives the merged hf/ folder's logits."""
    folder = saved(family, tmp_path / "hf")
    overrides, work = _run(tmp_path, family, folder, TARGETS[family][0], "cluster=debug")
    ours = _losses(work)

    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS[family][1])
    model = peft.get_peft_model(model, config)
    names = LLAMA_NAMES if family == "llama" else GPT2_CONV  # transformers' module -> ours
    with torch.no_grad():  # our initial A, drawn from its own name (B is zero in both)
        for name, p in model.named_parameters():
            if (m := re.search(r"\.(?:layers|h)\.(\d+)\.(.+)\.lora_A\.", name)):
                p.copy_(initial_A(f"layers.{m.group(1)}.{names[m.group(2)]}.lora_A", tuple(p.shape), SEED))
    assert all(".lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    theirs = plain_loop(model, build_batcher(make_cfg(*overrides, runs_dir=tmp_path / "plain")), STEPS, LR)
    assert len(ours) == STEPS and theirs[-1] < theirs[0]
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 1e-5, (ours, theirs)

    (checkpoint,) = (work / "runs" / "cache" / "checkpoint").glob("*/manifest.json")
    held = CheckpointReader(checkpoint.parent).tensors("model")
    assert held and [n for n in held if not n.endswith((".lora_A", ".lora_B"))] == []  # the adapters alone
    assert json.loads(checkpoint.read_text())["peft"]["base"]["init_from"] == f"hf:{folder}"

    (out,) = (work / "runs" / "cache" / "aggregate").glob("*/peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(folder)
    loaded = peft.PeftModel.from_pretrained(base, out).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(out.parent / "hf").eval()
    ids = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (loaded(ids).logits - merged(ids).logits).abs().max().item() <= 1e-5
        assert (model.eval()(ids).logits - merged(ids).logits).abs().max().item() <= 1e-4  # what peft trained


@pytest.mark.e2e  # up to eight ranks through `python -m orchestrator`, per layout
def test_lora_in_every_layout_gives_one_process_losses(tmp_path):
    """GPT with adapters on q, k, v too (peft's folder then holds c_attn's, of rank 3r): replicated data
    parallelism, tensor parallelism with sequence and loss parallelism (a column-split Linear's B split by output,
    a row-split one's A by input), and dp2 x hp2 x pp2 sharded give the single process's losses; peft loads the
    folder to the merged logits."""
    folder = saved("gpt", tmp_path / "hf")
    runs = {layout: _losses(_run(tmp_path, "gpt", folder, "[attention,mlp]", f"parallel={layout}", *extra,
                                 work=layout)[1])
            for layout, extra in (("single", ()), ("ddp2", ()),
                                  ("megatron_hp2", ("parallel.sequence_parallel=true", "parallel.loss_parallel=true")),
                                  ("dp2_hp2_pp2", ("parallel.dp_mode=shard",)))}
    for layout in ("ddp2", "megatron_hp2", "dp2_hp2_pp2"):
        assert max(abs(a - b) for a, b in zip(runs["single"], runs[layout])) <= 1e-5, (layout, runs)
    (out,) = (tmp_path / "single" / "runs" / "cache" / "aggregate").glob("*/peft")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["rank_pattern"] and set(config["rank_pattern"].values()) == {12}
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(folder), out).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(out.parent / "hf").eval()
    ids = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (loaded(ids).logits - merged(ids).logits).abs().max().item() <= 1e-5
