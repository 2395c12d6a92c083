"""Hugging Face interop, checked by `transformers` itself: a tiny random GPT-2 and Llama (made and saved locally,
no network) are imported with the logits of transformers' own forward, trained a few steps in dp2_hp2_pp2, and the
aggregate's hf/ folder loads with AutoModelForCausalLM and gives the logits of our model; Llama 3.1's rope scaling
both ways; the shipped Llama shapes at scale against their published config.json and parameter counts."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from orchestrator.config.errors import ConfigError
from orchestrator.config.validate import validate
from storage import consolidate, hf
from plugins.models import get_model
from tests.conftest import cache_entry, make_cfg, run_cli, run_debug, run_folder

import transformers  # noqa: E402  (the [hf] extra, part of .[dev])

# the sizes of our gpt_tiny / llama_tiny options, as Hugging Face configs
LLAMA_TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=192, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
FAMILIES = {
    "gpt": (["model=gpt_tiny", "model.activation=gelu_tanh"], lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=320, n_positions=128, n_embd=64, n_layer=8, n_head=4, n_inner=256,
                                activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                bos_token_id=None, eos_token_id=None))),
    "llama": (["model=llama_tiny"], lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_TINY))),
}
IDS = torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(0))


def saved(family: str, folder: Path) -> Path:
    torch.manual_seed(1)
    model = FAMILIES[family][1]().eval()
    model.save_pretrained(folder)
    return folder


def ours(family: str, state: dict) -> torch.nn.Module:
    cfg = make_cfg(*FAMILIES[family][0])
    spec = get_model(cfg.model.name)
    model = spec.build(cfg.model)
    model.load_state_dict(state, strict=False)
    if cfg.model.tie_embeddings:
        model.lm_head.weight = model.wte.weight
    missing = {n for n, _ in model.named_parameters()} - set(state) - ({"lm_head.weight"} if cfg.model.tie_embeddings
                                                                        else set())
    assert not missing, missing
    return model.eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_gives_transformers_logits(family, tmp_path):
    folder = saved(family, tmp_path / family)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        want = theirs(IDS).logits
        got = ours(family, hf.load_state(folder))(IDS)
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.e2e  # eight ranks through `python -m orchestrator`
@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trip_through_a_distributed_run(family, tmp_path):
    """hf folder -> train.init_from=hf: -> 3 steps in dp2_hp2_pp2 -> aggregate's hf/ -> transformers."""
    folder = saved(family, tmp_path / "in")
    work = tmp_path / "work"
    work.mkdir()
    args = [*FAMILIES[family][0], "parallel=dp2_hp2_pp2", f"train.init_from=hf:{folder}", "train.steps=3",
            "train.batch_size=8", "train.seq_len=32", "train.eval_every=0", "train.checkpoint_every=0",
            "tracking=none"]
    result = run_cli(args, work, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = run_folder(result)
    aggregate = run_dir / "stages/aggregate/output"
    assert json.loads((aggregate / "manifest.json").read_text())["hf"] == "hf/"
    log = (run_dir / "stages/train/rank0.log").read_text()
    assert "starting from the Hugging Face weights" in log

    cfg = make_cfg(*FAMILIES[family][0])
    trained = get_model(cfg.model.name).build(cfg.model)
    consolidate.load(aggregate, trained)
    trained.eval()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(aggregate / "hf").eval()
    with torch.no_grad():
        want, got = trained(IDS), loaded(IDS).logits
        before = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()(IDS).logits
    assert (got - want).abs().max().item() <= 1e-5
    assert (want - before).abs().max().item() > 1e-4  # the weights did train


def test_zero_steps_hand_the_starting_weights_through_every_stage_as_they_are(tmp_path):
    """train.steps=0, a baseline: the folder's weights saved as the checkpoint of step 0 and aggregated into an hf/
    folder that holds exactly them, their held-out loss in the train stage's summary; refused without a folder."""
    folder = saved("gpt", tmp_path / "in")
    report = run_debug(tmp_path, *FAMILIES["gpt"][0], f"train.init_from=hf:{folder}", "train.steps=0",
                       "train.batch_size=8", "train.seq_len=32", "train.eval_batches=2")
    summary = json.loads((cache_entry(tmp_path, report, "train") / "summary.json").read_text())
    assert summary["final_loss"] is None and summary["final_eval_loss"] > 0 and summary["steps"] == 0
    ours = transformers.AutoModelForCausalLM.from_pretrained(cache_entry(tmp_path, report, "aggregate") / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert ours.state_dict().keys() == theirs.keys()
    assert all(torch.equal(t, theirs[name]) for name, t in ours.state_dict().items())
    with pytest.raises(ConfigError) as e:
        validate(make_cfg("train.steps=0"))
    assert [p.key for p in e.value.problems] == ["train.steps"] and "random initialisation" in e.value.problems[0].rule


def test_a_mismatched_model_is_refused_listing_the_fields(tmp_path):
    folder = saved("llama", tmp_path / "llama")
    with pytest.raises(ConfigError) as e:
        validate(make_cfg("model=llama_tiny", "model.n_layers=4", "model.d_ff=256", f"train.init_from=hf:{folder}"))
    (p,) = [p for p in e.value.problems if p.key == "train.init_from"]
    assert "model.n_layers: ours 4, theirs 8" in p.rule and "model.d_ff: ours 256, theirs 192" in p.rule
    assert p.fix == "model.n_layers=8 model.d_ff=192"
    with pytest.raises(ConfigError) as e:
        validate(make_cfg("model=gpt_tiny", f"train.init_from=hf:{folder}"))
    (p,) = [p for p in e.value.problems if p.key == "train.init_from"]
    assert "another model (llama)" in p.rule and p.fix.startswith("model=llama_tiny")


def test_an_unsupported_architecture_is_named(tmp_path):
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"}))
    with pytest.raises(ConfigError) as e:
        validate(make_cfg(f"train.init_from=hf:{folder}"))
    (p,) = [p for p in e.value.problems if p.key == "train.init_from"]
    assert "BertForMaskedLM is not supported" in p.rule and "GPT2LMHeadModel, LlamaForCausalLM" in p.rule


def test_models_that_hf_cannot_express_are_said_so(tmp_path):
    cfg = make_cfg("model.activation=elu")
    model = get_model("gpt").build(cfg.model)
    note = hf.save_folder(tmp_path / "hf", model.state_dict(), cfg.model)
    assert note == "GPT-2 has no activation 'elu'" and not (tmp_path / "hf").exists()
    assert OmegaConf.select(cfg, "model.activation") == "elu"


def test_a_padded_vocabulary_gives_transformers_logits_and_saves_the_real_one(tmp_path):
    """model.pad_vocab_to=128: 320 -> 384 rows (zeros from the import), logits of the 320 real ones."""
    folder = saved("gpt", tmp_path / "gpt")
    cfg = make_cfg(*FAMILIES["gpt"][0], "model.pad_vocab_to=128")
    model = get_model("gpt").build(cfg.model)
    model.load_state_dict(hf.load_state(folder, vocab_rows=384), strict=False)
    model.lm_head.weight = model.wte.weight
    assert model.wte.weight.shape[0] == 384
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        want, got = theirs(IDS).logits, model.eval()(IDS)
    assert got.shape == want.shape == (2, 48, 320) and (got - want).abs().max().item() <= 1e-5
    assert hf.save_folder(tmp_path / "out", model.state_dict(), cfg.model) is None
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == 320
    with torch.no_grad():
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()(IDS).logits
    assert (again - want).abs().max().item() <= 1e-5


def _losses(result) -> list[float]:
    run_dir = run_folder(result)
    train = run_dir / "stages/train/output"
    return [json.loads(line)["loss"] for line in (train / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.e2e  # four ranks through `python -m orchestrator`
def test_a_padded_vocabulary_trains_vocab_parallel_with_the_unpadded_loss(tmp_path):
    """hp=2 x pp=2 with the logits vocab-sharded on the last stage (the padding's columns masked to -inf on the shard
    that holds them) and the padded embedding tied across the first and last stage: the same losses as the
    unpadded model in one process (layouts equal one process: tests/test_layouts.py), and an hf/ folder with the
    real vocabulary."""
    folder = saved("gpt", tmp_path / "in")
    model = [*FAMILIES["gpt"][0], f"train.init_from=hf:{folder}", "train.steps=3", "train.batch_size=8",
             "train.seq_len=32", "train.eval_every=0", "train.checkpoint_every=0", "tracking=none"]
    plain = run_debug(tmp_path / "plain", *model)
    (tmp_path / "padded").mkdir()
    padded = run_cli([*model, "model.pad_vocab_to=128", "parallel=megatron_hp2", "parallel.pp=2",
                      "parallel.microbatches=2", "parallel.loss_parallel=true"], tmp_path / "padded", timeout=900)
    assert padded.returncode == 0, padded.stdout[-3000:] + padded.stderr[-3000:]
    metrics = cache_entry(tmp_path / "plain", plain, "train") / "metrics.jsonl"
    one_process = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(one_process) == 3 and _losses(padded) == pytest.approx(one_process, rel=1e-5, abs=0)
    run_dir = run_folder(padded)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "stages/aggregate/output/hf")
    assert loaded.config.vocab_size == 320


# Llama 3.1's long-context rotary scaling on the tiny shape, its bands chosen so that each rule applies to some of the
# 8 frequencies (head_dim 16, theta 10000: wavelengths 6.3 kept, 20 and 63 blended, 199 and longer divided by 4)
ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}
ROPE_OVERRIDES = ["model.rope_scaling=llama3", "model.rope_factor=4", "model.rope_original_max_seq_len=64"]


def test_llama3_rope_scaling_gives_transformers_logits_in_and_out(tmp_path):
    """A LlamaForCausalLM with rope_type llama3 imports as model.rope_scaling=llama3 (its config matching ours) with
    transformers' logits, which the plain rotary embedding does not give; exported, transformers reads the same."""
    torch.manual_seed(1)
    rope = dict(ROPE)  # a copy: transformers adds rope_theta to the dict it is given
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_TINY, rope_scaling=rope)).eval()
    theirs.save_pretrained(tmp_path / "in")
    cfg = make_cfg(*FAMILIES["llama"][0], *ROPE_OVERRIDES)
    assert hf.differences(cfg.model, tmp_path / "in") == {}
    assert hf.differences(make_cfg(*FAMILIES["llama"][0]).model, tmp_path / "in")["rope_scaling"] == ("none", "llama3")
    model = get_model("llama").build(cfg.model)
    model.load_state_dict(hf.load_state(tmp_path / "in"), strict=False)
    plain = ours("llama", hf.load_state(tmp_path / "in"))
    with torch.no_grad():
        want, got, unscaled = theirs(IDS).logits, model.eval()(IDS), plain(IDS)
    assert (got - want).abs().max().item() <= 1e-5 < (unscaled - want).abs().max().item()
    assert hf.save_folder(tmp_path / "out", model.state_dict(), cfg.model) is None
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["rope_scaling"] == ROPE  # as Llama 3.1's config.json says it (transformers 4.x reads this)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert (loaded(IDS).logits - want).abs().max().item() <= 1e-5


def test_other_rope_scalings_are_refused_by_name(tmp_path):
    folder = saved("llama", tmp_path / "llama")
    config = json.loads((folder / "config.json").read_text())
    for rope, words in (({"rope_type": "yarn", "factor": 4.0}, "rope scaling 'yarn' is not supported"),
                        ({"rope_type": "llama3", "factor": 8.0}, "without low_freq_factor, high_freq_factor")):
        (folder / "config.json").write_text(json.dumps({**config, "rope_parameters": rope}))
        with pytest.raises(hf.HFError, match=words):
            hf.read_config(folder)


# The published config.json of each shipped shape (huggingface.co/meta-llama/<name>/blob/main/config.json; the
# sources of each value are in the option's conf/model/<option>.yaml), and the parameters Hugging Face counts
LLAMA31 = {"rope_theta": 500000.0, "max_position_embeddings": 131072, "vocab_size": 128256,
           "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
PUBLISHED = {
    "llama2_70b": ({"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
                    "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 4096,
                    "rope_theta": 10000.0, "rope_scaling": None}, 68_976_648_192),
    "llama3_8b": ({"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, **LLAMA31}, 8_030_261_248),
    "llama3_70b": ({"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8, **LLAMA31}, 70_553_706_496),
    "llama3_405b": ({"hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
                     "num_attention_heads": 128, "num_key_value_heads": 8, **LLAMA31}, 405_853_388_800),
}


@pytest.mark.parametrize("option", list(PUBLISHED))
def test_shipped_llama_shapes_are_the_published_ones(option, tmp_path):
    """The option imports a folder of the published config.json with no difference (a real folder of it starts from
    its weights, rope scaling included), its partition plan (no weights) holds the published number of parameters,
    and each weight has the shape of Hugging Face's tensor it maps to."""
    from planning.partition import build_plan

    published, count = PUBLISHED[option]
    c = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-05, "hidden_act": "silu",
         "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, **published}
    (tmp_path / "config.json").write_text(json.dumps(c))
    cfg = make_cfg(f"model={option}")
    assert hf.differences(cfg.model, tmp_path) == {}
    plan = build_plan(cfg.model, cfg.parallel)
    assert plan["n_parameters"] == count
    shapes = {name: tuple(p["shape"]) for name, p in plan["parameters"].items()}
    assert sum(math.prod(s) for s in shapes.values()) == count
    d, ff, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * d // c["num_attention_heads"]  # key/value heads x head_dim
    layer = {"self_attn.q_proj": (d, d), "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d),
             "self_attn.o_proj": (d, d), "mlp.gate_proj": (ff, d), "mlp.up_proj": (ff, d), "mlp.down_proj": (d, ff),
             "input_layernorm": (d,), "post_attention_layernorm": (d,)}
    top = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,), "lm_head.weight": (vocab, d)}
    recipes, config = hf.folder_plan(cfg.model, shapes)
    assert len(recipes) == len(shapes) == len(layer) * c["num_hidden_layers"] + len(top)
    for theirs, recipe in recipes.items():
        (mine,) = recipe.sources
        m = re.match(r"model\.layers\.\d+\.(.+)\.weight$", theirs)
        assert shapes[mine] == (layer[m.group(1)] if m else top[theirs]), theirs
    assert {k: config.get(k) for k in published} == published  # and exported, the published config.json's values
