"""The model registry entry, the partition plan, the data batcher and the optimizer pieces."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from plugins.data import Batcher, Corpus, build_batcher
from plugins.data.registry import split_named
from plugins.data.tokenizer import EOS, PAD, decode, encode, encode_documents
from plugins.models import get_model, model_names
from runtime.optim import build_optimizer, lr_factor
from planning.partition import build_plan, pipeline_stages
from tests.conftest import make_cfg


def tiny(*overrides):
    cfg = make_cfg("model.n_layers=4", "model.d_model=32", "model.d_ff=64", *overrides)
    spec = get_model(cfg.model.name)
    model = spec.build(cfg.model)
    spec.init_weights(model, cfg.model, seed=7)
    return cfg, spec, model


def test_registry_has_gpt_and_names_unknown_models():
    assert "gpt" in model_names()
    with pytest.raises(KeyError, match="not registered"):
        get_model("nope")


def test_tied_embedding_and_shapes():
    cfg, spec, model = tiny()
    assert model.lm_head.weight is model.wte.weight
    logits = model(torch.randint(0, 320, (2, 10)))
    assert logits.shape == (2, 10, 320)


def test_init_is_layout_independent():
    """A pipeline stage's parameters equal the full model's under the same seed (names are global)."""
    cfg, spec, full = tiny()
    stage = spec.split(spec.build(cfg.model), [2, 3], first=False, last=True)
    spec.init_weights(stage, cfg.model, seed=7)
    names = dict(stage.named_parameters())
    assert "layers.2.attn.wq.weight" in names and "layers.0.attn.wq.weight" not in names
    assert "wte.weight" not in names and "lm_head.weight" in names
    full_params = dict(full.named_parameters(remove_duplicate=False))
    for n, p in names.items():
        assert torch.equal(p, full_params[n]), n


@pytest.mark.parametrize("level", [1, 2])
def test_recompute_levels_change_no_numbers(level):
    cfg, spec, model = tiny()
    other = copy.deepcopy(model)
    spec.apply_memory(other, level)
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    spec.loss(model(x), y).backward()
    spec.loss(other(x), y).backward()
    for (n, a), (_, b) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), n


def test_loss_ignores_padding_labels():
    cfg, spec, model = tiny()
    logits = torch.randn(1, 4, 320)
    labels = torch.tensor([[1, 2, -100, -100]])
    assert torch.isclose(spec.loss(logits, labels), spec.loss(logits[:, :2], labels[:, :2]))


def test_partition_plan_for_hp2_pp2():
    cfg = make_cfg("parallel=dp2_hp2_pp2")
    plan = build_plan(cfg.model, cfg.parallel)
    p = plan["parameters"]
    assert p["layers.0.attn.wq.weight"] == {"shape": [64, 64], "partition_axis": 0, "partition_name": "colwise",
                                             "is_partitioned": True, "shard_shape": [32, 64], "pp_stages": [0],
                                             "tied_to": None, "trainable": True}
    assert p["layers.7.mlp.fc2.weight"]["shard_shape"] == [64, 128] and p["layers.7.mlp.fc2.weight"]["pp_stages"] == [1]
    assert p["layers.0.mlp.fc2.bias"]["is_partitioned"] is False
    assert p["lm_head.weight"]["tied_to"] == "wte.weight" and p["lm_head.weight"]["pp_stages"] == [1]
    assert p["wte.weight"]["pp_stages"] == [0] and p["wte.weight"]["partition_name"] == "vocab"
    assert plan["layout"]["world_size"] == 8


def test_single_process_plan_partitions_nothing():
    cfg = make_cfg()
    plan = build_plan(cfg.model, cfg.parallel)
    assert not any(v["is_partitioned"] for v in plan["parameters"].values())
    assert plan["pipeline"] == [{"stage": 0, "rank": 0, "chunk": 0, "layers": list(range(8)),
                                 "embedding": True, "head": True}]
    assert plan["n_parameters"] == sum(p.numel() for p in get_model("gpt").build(cfg.model).parameters())


def test_pipeline_stage_placement():
    loop = pipeline_stages(8, pp=4, chunks=2, schedule="interleaved_1f1b")
    assert [(s["stage"], s["rank"], s["chunk"]) for s in loop][:5] == [(0, 0, 0), (1, 1, 0), (2, 2, 0), (3, 3, 0),
                                                                        (4, 0, 1)]
    v = pipeline_stages(8, pp=2, chunks=2, schedule="zbv")
    assert [s["rank"] for s in v] == [0, 1, 1, 0]  # V: rank 0 holds the first and the last stage


def test_tokenizer_round_trip():
    text = "def f():\n    return 'é'\n".encode()
    assert decode(encode(text)) == text


def test_batches_depend_only_on_step_and_seed():
    cfg = make_cfg("data=synthetic", "train.batch_size=4", "train.seq_len=16")
    a, b = build_batcher(cfg), build_batcher(cfg)
    assert torch.equal(a.train_batch(5).inputs, b.train_batch(5).inputs)
    assert not torch.equal(a.train_batch(5).inputs, a.train_batch(6).inputs)
    batch = a.train_batch(3)
    assert torch.equal(batch.inputs[:, 1:], batch.labels[:, :-1])  # labels are the next tokens
    assert batch.input_density == 1.0 and batch.n_labels == 4 * 16


def _draws(batcher, steps: int, kind: str) -> list:
    """The examples `steps` batches hold: a record's or pair's number, a window's or a row of whole documents' first
    token ids."""
    out = []
    for step in range(steps):
        b = getattr(batcher, f"{kind}_batch")(step)
        if batcher.pairs:
            out += [int(d) // 2 for d in b.drawn[0::2] if d >= 0]
        elif not batcher.corpus.packed and batcher.rows is None:
            out += [int(d) for d in b.drawn if d >= 0]
        else:
            out += [tuple(row[:4]) for row, n in zip(b.inputs.tolist(), b.real) if n]
    return out


@pytest.mark.parametrize("kind", ["records", "pairs", "rows of whole documents", "windows"])
def test_every_example_is_drawn_once_an_epoch_and_every_held_out_one_scored_once(kind):
    """Training draws epochs: each a seeded permutation of the split's examples, so n consecutive draws hold each
    example once, and the next epoch another order; the held-out batches hold each held-out example once, the last
    one's rows past the split's end empty (nothing learned, no example counted)."""
    rng = np.random.default_rng(0)
    docs = [np.concatenate([[i % 250, i // 250], rng.integers(0, 250, size=int(rng.integers(3, 20)))]) for i in
            range(60)]  # each document's first two ids tell it apart
    if kind == "windows":
        stream = np.arange(31 * 16 + 1) % 250  # a window's first ids tell it apart
        corpus, n_train, n_val = Corpus([stream], [stream[:16 * 5 + 1]], 258, packed=True), 31, 5
    else:
        corpus = Corpus(docs[:42], docs[42:], 258, packed=False)
        n_train, n_val = (21, 9) if kind == "pairs" else (42, 18)
    batcher = Batcher(corpus, 6, 16, seed=3, pairs=kind == "pairs",
                      whole_documents="split" if kind == "rows of whole documents" else None)
    if kind == "rows of whole documents":
        n_train, n_val = len(batcher.rows[0]["train"]), len(batcher.rows[0]["val"])
    units = 3 if kind == "pairs" else 6
    drawn = _draws(batcher, -(-2 * n_train // units), "train")
    first, second = drawn[:n_train], drawn[n_train:2 * n_train]
    assert len(set(first)) == len(set(second)) == n_train and set(first) == set(second) and first != second
    assert batcher.eval_batches(100) == -(-n_val // units) and batcher.eval_batches(1) == 1
    held = _draws(batcher, batcher.eval_batches(100), "eval")
    assert len(held) == len(set(held)) == n_val
    last = batcher.eval_batch(batcher.eval_batches(100) - 1)
    assert last.examples == n_val - (batcher.eval_batches(100) - 1) * units
    assert torch.equal(last.inputs, batcher.eval_batch(batcher.eval_batches(100) - 1).inputs)


def test_unpacked_short_documents_are_padded_and_masked():
    cfg = make_cfg("data.packing=false", "data.val_fraction=0.5")
    docs = [(f"d{i}", b"x" * (5 + i)) for i in range(8)]
    train, val = split_named(docs, cfg.data)
    corpus = Corpus(encode_documents(train), encode_documents(val), 258, packed=False)
    batcher = Batcher(corpus, batch_size=4, seq_len=32, seed=0)
    batch = batcher.train_batch(0)
    assert (batch.inputs == PAD).any() and (batch.labels == -100).any()
    assert 0 < batch.input_density < 1 and 0 < batch.label_density < 1
    assert (batch.labels[batch.inputs == PAD] == -100).all()
    assert (batch.labels == EOS).sum() == 4  # each row predicts its document's end


def test_stdlib_corpus_has_a_held_out_split():
    cfg = make_cfg()
    batcher = build_batcher(cfg)
    assert isinstance(batcher.corpus, Corpus) and batcher.corpus.packed
    assert len(batcher.corpus.train[0]) > 10 * len(batcher.corpus.val[0]) > 0
    assert batcher.eval_batch(0).inputs.max() < 258


def test_the_plan_says_how_much_of_the_training_split_the_steps_draw(tmp_path):
    import json

    from plugins.data.preview import passes_line

    (tmp_path / "index.json").write_text(json.dumps({"train": {"documents": 40, "tokens": 4_000}}))
    assert passes_line(make_cfg("train.steps=150", "train.batch_size=8", "train.seq_len=64"), tmp_path) == [
        "data: 150 steps of 8 rows = 19.35 epochs of the training split's 62 windows of 64 tokens (each drawn once an "
        "epoch)"]
    assert passes_line(make_cfg("train.steps=2", "train.batch_size=8", "data.packing=false"), tmp_path) == [
        "data: 2 steps of 8 rows = 0.40 epochs of the training split's 40 records (40.00% of them, none twice)"]
    assert passes_line(make_cfg(), tmp_path / "no index here") == []  # an entry without counts: nothing said


def test_too_little_data_is_explained():
    corpus = Corpus([np.arange(10)], [np.arange(10)], 320, packed=True)
    with pytest.raises(ValueError, match="fewer than train.seq_len"):
        Batcher(corpus, 2, 64, 0)


def test_lr_schedule_warmup_then_cosine():
    cfg = make_cfg("optimizer.warmup_steps=10", "optimizer.min_lr_ratio=0.1").optimizer
    assert lr_factor(cfg, 0, 100) == pytest.approx(0.1)
    assert lr_factor(cfg, 9, 100) == pytest.approx(1.0)
    assert lr_factor(cfg, 10, 100) == pytest.approx(1.0)
    assert lr_factor(cfg, 55, 100) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(cfg, 100, 100) == pytest.approx(0.1)


@pytest.mark.parametrize("name,impl,flag", [("adamw", "auto", "fused"), ("adamw", "foreach", "foreach"),
                                            ("sgd", "auto", "fused"), ("sgd", "for_loop", "foreach")])
def test_optimizer_kernels(name, impl, flag):
    cfg, spec, model = tiny(f"optimizer={name}", f"optimizer.impl={impl}")
    opt = build_optimizer(cfg.optimizer, model)
    group = opt.param_groups[0]
    assert group[flag] is (impl != "for_loop")
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    assert id(model.wte.weight) in decayed and id(model.layers["0"].ln1.weight) not in decayed


def test_a_data_source_and_an_engine_from_entry_points_are_accepted_and_used(tmp_path, monkeypatch):
    """A package that registers a data source and an engine through the `orchestrator.data` and
    `orchestrator.engines` entry points (installed here as a dist-info folder on the path, as pip would leave it):
    each is a valid name (the registries decide which names exist, not lists in the schema; an unknown name lists
    them), the tokenize stage reads the source's documents, the transform stage asks the engine to prepare."""
    import json

    from orchestrator.config.errors import ConfigError
    from orchestrator.config.validate import validate
    from orchestrator.run import orchestrate
    from plugins.data import registry
    from plugins.engines.registry import ENGINES
    from tests.conftest import DEBUG

    site = tmp_path / "site"
    (site / "poems_source").mkdir(parents=True)
    (site / "poems_source" / "__init__.py").write_text(
        "from plugins.data.registry import DataSource, register_source\n"
        "from plugins.engines.registry import EngineSpec, register_engine\n\n"
        "LINES = [f'line {i}: the quick brown fox jumps over the lazy dog'.encode() for i in range(400)]\n\n"
        "def register():\n"
        "    register_source('poems', DataSource(lambda cfg: 'poems-v1',\n"
        "                    documents=lambda cfg: [(f'poem{i}', b'\\n'.join(LINES[i:i + 40])) for i in range(0, 400, 40)]))\n\n"
        "def prepare(cfg, plan, export, out, log, tracker):\n"
        "    out.mkdir()\n"
        "    (out / 'prepared.txt').write_text(f\"{len(plan['parameters'])} parameters\")\n\n"
        "def register_engine_():\n"
        "    register_engine('traced', EngineSpec(prepare=prepare))\n")
    dist = site / "poems_source-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: poems-source\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[orchestrator.data]\npoems = poems_source:register\n\n"
                                           "[orchestrator.engines]\ntraced = poems_source:register_engine_\n")
    monkeypatch.syspath_prepend(str(site))
    for kind in (registry.SOURCES, ENGINES):  # their registrations go with the test
        monkeypatch.setattr(kind, "_specs", dict(kind._specs))
        monkeypatch.setattr(kind, "_loaded", False)

    for key, wrong, known in (("data.name", "sonnets", ("poems", "stdlib")), ("engine.name", "onnx", ("traced", "ort"))):
        with pytest.raises(ConfigError) as refused:
            validate(make_cfg("data=stdlib", f"{key}={wrong}"))
        (p,) = refused.value.problems
        assert p.key == key and all(name in p.fix for name in known), p
    overrides = [*DEBUG, "data=stdlib", "data.name=poems", "engine.name=traced"]
    results = {until: orchestrate(make_cfg(*overrides, runs_dir=tmp_path / "runs"), tmp_path / until, overrides,
                                  until=until).results[until] for until in ("tokenize", "transform")}
    assert results["tokenize"].status == results["transform"].status == "ran"
    entry = next(p for p in (tmp_path / "runs" / "cache" / "tokenize").iterdir() if not p.name.startswith("."))
    index = json.loads((entry / "tokens" / "index.json").read_text())
    assert index["train"]["documents"] + index["val"]["documents"] == 10  # the source's ten poems
    prepared = tmp_path / "runs" / "cache" / "transform" / results["transform"].key / "traced" / "prepared.txt"
    assert prepared.read_text().endswith(" parameters")


def test_a_run_that_learned_nothing_is_said_so_beside_its_result():
    """A held-out loss no lower than at the reference (DPO: log 2) or, without one, than at the first evaluation,
    and a held-out reward accuracy at chance, are said in the summary, the stage table and the sweep table."""
    import math

    from orchestrator.sweeps.launcher import _table
    from plugins.objectives import get_objective
    from runtime.train_report import not_learned
    from tests.conftest import make_cfg

    at_reference = get_objective("dpo").at_reference(make_cfg("objective=dpo").objective)
    assert at_reference == pytest.approx(math.log(2))
    pairs = [{"step": 10, "eval_loss": 0.70, "eval_rewards/accuracies": 0.53},
             {"step": 20, "eval_loss": 0.7230, "eval_rewards/accuracies": 0.53}]
    assert "no lower than at the reference model (0.6931)" in not_learned(pairs, at_reference)
    assert not_learned([{"step": 20, "eval_loss": 0.65, "eval_rewards/accuracies": 0.5}], at_reference) == \
        "its held-out reward accuracy 0.50 is at chance (0.5)"
    assert not_learned([{"step": 20, "eval_loss": 0.60, "eval_rewards/accuracies": 0.8}], at_reference) is None
    sft = [{"step": 10, "eval_loss": 2.0}, {"step": 20, "eval_loss": 2.1}]
    assert "no lower than at its first evaluation (2.0000, step 10)" in not_learned(sft)
    assert not_learned(sft[:1]) is None and not_learned([*sft[:1], {"step": 20, "eval_loss": 1.9}]) is None
    assert not_learned([{"step": 5, "loss": 1.0}]) is None  # no evaluation: nothing to say
    row = {"point": 0, "overrides": "objective.beta=0.5", "layout": "dp1 hp1 pp1", "objective": 0.53,
           "final_loss": 0.7, "tokens_per_s": 1.0, "status": "ok", "not_learned": not_learned(pairs, at_reference)}
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(_table([row], "eval_reward_accuracy", 1.0))
    assert "ok, learned nothing" in console.export_text()
