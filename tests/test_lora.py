"""LoRA (peft=lora): adapters train beside a frozen imported model, as peft's LoraModel trains them on the
transformers model; the checkpoints hold the adapters alone; the aggregate writes the merged hf/ folder and peft's
folder, which peft loads to the merged folder's logits; data and pipeline parallelism give one process's losses."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from plugins.data.batcher import build_batcher
from plugins.models.lora import initial_A
from storage.dcp_reader import CheckpointReader
from storage.fsio import UMASK
from storage.hf import GPT2_CONV, LLAMA_NAMES
from orchestrator.config.errors import ConfigError
from orchestrator.config.validate import validate
from planning.plan import plan_of
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


def _run(tmp_path: Path, family: str, folder: Path, targets: str, *extra: str, work: str = "work",
         steps: int = STEPS, start: str = "") -> tuple[list[str], Path]:
    records(tmp_path / "qa.jsonl")
    overrides = [*FAMILIES[family][0], *args(tmp_path / "qa.jsonl", packing=True, seq_len=96),
                 f"train.init_from={start or f'hf:{folder}'}", "peft=lora", f"peft.targets={targets}", "peft.rank=4",
                 "peft.alpha=8", f"train.steps={steps}", "train.eval_every=0", "train.checkpoint_every=4",
                 "train.grad_clip=0", "optimizer=sgd", f"optimizer.lr={LR}", "optimizer.momentum=0",
                 "optimizer.schedule=constant", "optimizer.weight_decay=0", "optimizer.warmup_steps=0",
                 "tracking=none", f"train.seed={SEED}", *extra]
    (tmp_path / work).mkdir()
    result = run_cli(overrides, tmp_path / work, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "hf/ folder (merged); for peft: its peft/ folder, the adapters alone)" in result.stdout  # the last line
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
    written = sum(f.stat().st_size for f in checkpoint.parent.rglob("*") if f.is_file())
    planned = plan_of(make_cfg(*overrides)).stages["checkpoint"].writes  # the plan's disk line: DCP's entries too
    assert 0.8 <= planned / written <= 1.25, (planned, written)

    (out,) = (work / "runs" / "cache" / "aggregate").glob("*/peft")
    modes = {f.name: f.stat().st_mode & 0o777 for f in [*out.iterdir(), *(out.parent / "hf").iterdir()]}
    assert set(modes.values()) == {0o666 & ~UMASK}, modes  # safetensors creates its files 0600
    base = transformers.AutoModelForCausalLM.from_pretrained(folder)
    loaded = peft.PeftModel.from_pretrained(base, out).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(out.parent / "hf").eval()
    ids = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (loaded(ids).logits - merged(ids).logits).abs().max().item() <= 1e-5
        assert (model.eval()(ids).logits - merged(ids).logits).abs().max().item() <= 1e-4  # what peft trained


@pytest.mark.e2e  # up to eight ranks through `python -m orchestrator`, per layout
def test_lora_in_every_layout_gives_one_process_losses(tmp_path):
    """GPT with adapters on q, k, v too (peft's folder then holds c_attn's, of rank 3r): tensor parallelism with
    sequence and loss parallelism (a column-split Linear's B split by output, a row-split one's A by input) and
    dp2 x hp2 x pp2 sharded give the single process's losses; replicated data parallelism continues dp2_hp2_pp2's
    checkpoint of step 4 (train.init_from=<a LoRA checkpoint>: the base it names, its adapters resharded) with the
    single process's steps 5-8. peft loads the folder to the merged logits."""
    folder = saved("gpt", tmp_path / "hf")
    runs = {layout: _run(tmp_path, "gpt", folder, "[attention,mlp]", f"parallel={layout}", *extra, work=layout,
                         steps=steps)
            for layout, steps, extra in (("single", STEPS, ()), ("dp2_hp2_pp2", 4, ("parallel.dp_mode=shard",)),
                                         ("megatron_hp2", STEPS, ("parallel.sequence_parallel=true",
                                                                  "parallel.loss_parallel=true")))}
    losses = {layout: _losses(work) for layout, (_, work) in runs.items()}
    (four,) = (tmp_path / "dp2_hp2_pp2" / "runs" / "cache" / "checkpoint").glob("*/manifest.json")
    overrides, work = _run(tmp_path, "gpt", folder, "[attention,mlp]", "parallel=ddp2", work="ddp2",
                           start=f"{four.parent}")
    losses["ddp2"] = _losses(work)
    for layout, first in (("megatron_hp2", 0), ("dp2_hp2_pp2", 0), ("ddp2", 4)):
        want = losses["single"][first:first + len(losses[layout])]
        assert len(losses[layout]) == (4 if layout != "megatron_hp2" else STEPS), (layout, losses)
        assert max(abs(a - b) for a, b in zip(want, losses[layout])) <= 1e-5, (layout, losses)
    assert json.loads(next((work / "runs" / "cache" / "checkpoint").glob("*/manifest.json")).read_text())[
        "peft"]["base"]["init_from"] == f"hf:{folder}"  # the base, not the checkpoint it continued

    (out,) = (tmp_path / "single" / "runs" / "cache" / "aggregate").glob("*/peft")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["rank_pattern"] and set(config["rank_pattern"].values()) == {12}
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(folder), out).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(out.parent / "hf").eval()
    ids = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (loaded(ids).logits - merged(ids).logits).abs().max().item() <= 1e-5

    def refused(*changes: str, drop: tuple[str, ...] = ("parallel=",)) -> dict[str, str]:  # before launch
        with pytest.raises(ConfigError) as e:
            validate(make_cfg(*[o for o in overrides if not o.startswith(drop)], *changes,
                              runs_dir=tmp_path / "refused"))
        return {p.key: f"{p.rule} | {p.fix}" for p in e.value.problems}

    assert "trained with peft.rank=4" in refused("peft.rank=8")["peft.rank"]
    assert "peft=lora to continue them" in refused("peft=none", drop=("parallel=", "peft"))["train.init_from"]
    weights = next(folder.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert f"trained on hf:{folder}, whose files have changed" in refused()["train.init_from"]


def test_lora_in_bf16_holds_the_frozen_base_in_bf16_and_the_plan_counts_what_it_holds(monkeypatch):
    """precision=bf16: the blocks' frozen Linears are stored in bf16, which autocast computes them in anyway (the
    losses equal those of an fp32-stored base under the same autocast, and fp32's to bf16's 2e-2); the adapters,
    norms and embeddings stay fp32; the plan's parameter bytes are the bytes the layout holds."""
    import plugins.parallel.layout as layout_module
    from planning.estimate import estimate
    from planning.partition import build_plan
    from plugins.data.batcher import Batch
    from plugins.models import get_model
    from plugins.parallel.layout import build_layout
    from runtime.metrics import MemoryProbe
    from runtime.optim import build_optimizer
    from runtime.step import StepSettings, train_step

    def losses(precision: str) -> tuple[list[float], dict, int, int]:
        cfg = make_cfg("model=gpt_tiny", "train.batch_size=4", "train.seq_len=32", "peft=lora", "model.dropout=0",
                       f"precision={precision}")
        plan = build_plan(cfg.model, cfg.parallel, cfg.peft)
        layout = build_layout(cfg, plan, get_model("gpt"), torch.device("cpu"))
        dtypes = {name: p.dtype for name, p in layout.parts[0].named_parameters()}
        held = sum(p.numel() * p.element_size() for p in layout.parts[0].parameters())
        optimizers, settings = [build_optimizer(cfg.optimizer, part) for part in layout.parts], StepSettings.of(cfg)
        out = []
        for step in range(3):
            tokens = torch.randint(0, cfg.model.vocab_size, (4, 33), generator=torch.Generator().manual_seed(step))
            row = train_step(layout, optimizers, Batch(tokens[:, :-1], tokens[:, 1:], 1.0, 1.0), step, 1e-2,
                             settings, MemoryProbe(torch.device("cpu")))
            out.append(row["loss"].item())
        return out, dtypes, held, estimate(cfg, plan).parameters

    fp32, _, _, _ = losses("fp32")
    bf16, dtypes, held, planned = losses("bf16")
    assert {n for n, d in dtypes.items() if d == torch.bfloat16} == \
        {n for n in dtypes if n.startswith("layers.") and n.endswith(("wq.weight", "wk.weight", "wv.weight",
                                                                      "wo.weight", "fc1.weight", "fc2.weight"))}
    assert dtypes["layers.0.attn.wq.lora_A"] == dtypes["wte.weight"] == dtypes["layers.0.ln1.weight"] == torch.float32
    assert planned == held
    assert max(abs(a - b) / a for a, b in zip(fp32, bf16)) <= 2e-2
    monkeypatch.setattr(layout_module, "store_frozen", lambda module, dtype: None)  # the base kept in fp32
    assert losses("bf16")[0] == bf16


def test_targets_are_the_linears_they_adapt_however_they_are_spelled():
    """[attention,mlp] and the same Linears named one by one are one set of adapters (a LoRA checkpoint continues
    under either); the plan names the Linears GPT has (its MLP has no fc3)."""
    from planning.plan import partition_plan, peft_line
    from plugins.models.lora_rules import _adapted

    cfg = make_cfg("model=gpt_tiny", "peft=lora")
    assert _adapted(cfg, ["attention", "mlp"]) == _adapted(cfg, ["wq", "wk", "wv", "wo", "fc1", "fc2"]) == \
        {"wq", "wk", "wv", "wo", "fc1", "fc2"}
    (line,) = peft_line(cfg.peft, partition_plan(cfg)["parameters"])
    assert "on fc1, fc2, wk, wo, wq, wv:" in line, line
