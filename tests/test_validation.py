"""Every validation rule: a bad config fails before anything starts, naming key, value, rule and fix."""
from __future__ import annotations

import json

import shutil

import pytest
import torch
from hydra.errors import HydraException

from orchestrator.config.errors import ConfigError, from_hydra
from orchestrator.config.validate import validate
from tests.conftest import CONF, make_cfg


def problems_of(*overrides: str) -> list:
    cfg = make_cfg(*overrides)
    try:
        validate(cfg, overrides)
    except ConfigError as e:
        return e.problems
    return []


def test_default_config_is_valid():
    assert problems_of() == []


@pytest.mark.parametrize("group", ["model", "parallel", "optimizer", "memory", "precision", "triton", "engine",
                                   "data", "cluster", "tracking", "objective"])
def test_every_option_composes_and_validates(group, tmp_path):
    """Each option validates; the only problems allowed are the machine's: no SLURM commands here, or too little
    memory or disk for a GPU-sized model (llama_1b on a CI runner; the export and aggregate stages of llama3_70b and
    its kin too). data=text and data=chat are given files."""
    from tests.test_chat import CHATML, CHATS

    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS * 400))
    (tmp_path / "chatml.jinja").write_text(CHATML)
    given = {"text": ["data.paths=[README.md]"],
             "chat": [f"data.paths=[{tmp_path}/chats.jsonl]", f"data.chat_template={tmp_path}/chatml.jinja"],
             "megatron": _megatron_corpus(tmp_path), "preference": [*_pairs(tmp_path), "objective=dpo"],
             **{name: [*_pairs(tmp_path), "data=preference"] for name in ("dpo", "simpo", "orpo")},
             "unpaired": [*_unpaired(tmp_path), "objective=kto"], "kto": [*_unpaired(tmp_path), "data=unpaired"]}
    for option in sorted(p.stem for p in (CONF / group).glob("*.yaml")):
        overrides = [f"{group}={option}"] + (given.get(option, []) if group in ("data", "objective") else [])
        got = [p for p in problems_of(*overrides) if not _machine_problem(p)]
        assert got == [], (group, option, [(p.key, str(p.value), p.rule) for p in got])


def _pairs(tmp_path) -> list[str]:
    """Preference pairs (data=preference's paths)."""
    pair = {"prompt": "What is 2 + 3? ", "chosen": "5.", "rejected": "6."}
    (tmp_path / "pairs.jsonl").write_text((json.dumps(pair) + "\n") * 400)
    return [f"data.paths=[{tmp_path}/pairs.jsonl]"]


def _unpaired(tmp_path) -> list[str]:
    """Unpaired records (data=unpaired's paths)."""
    records = [{"prompt": "What is 2 + 3? ", "completion": c, "label": c == "5."} for c in ("5.", "6.")]
    (tmp_path / "feedback.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) * 200)
    return [f"data.paths=[{tmp_path}/feedback.jsonl]"]


def _megatron_corpus(tmp_path) -> list[str]:
    """A Megatron indexed dataset of 30 documents and the word-level tokenizer of its ids (data=megatron's keys)."""
    import numpy as np
    from tokenizers import Tokenizer, models

    from plugins.data.indexed_dataset import write_index

    docs = [np.arange(1, 40 + i, dtype=np.uint16) for i in range(30)]
    (tmp_path / "corpus_text_document.bin").write_bytes(np.concatenate(docs).tobytes())
    write_index(str(tmp_path / "corpus_text_document"), np.uint16, [len(d) for d in docs])
    (tmp_path / "tok").mkdir()
    Tokenizer(models.WordLevel({f"<{i}>": i for i in range(256)}, unk_token="<0>")).save(
        str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<0>"}))
    return [f"data.paths=[{tmp_path}/corpus_text_document]", f"data.tokenizer=hf:{tmp_path}/tok"]


def _machine_problem(p) -> bool:
    if p.key == "cluster" and str(p.value) == "slurm":
        return not shutil.which("sbatch")
    return (p.key == "parallel" and "a rank may use" in p.rule) or (p.key == "cache_dir" and "MB free" in p.rule) or \
        (p.key in ("model", "aggregate.onnx") and "it may use (available RAM)" in p.rule)  # a stage's (the 70Bs')


# Each rule's refusal (key, value, rule, fix) is in the catalogue of tests/refusal_catalogue.py; the tests here check
# composition, defaults and the finer points of particular messages.


def test_hp_fix_lists_valid_degrees():
    p = next(p for p in problems_of("parallel.hp=3") if p.key == "parallel.hp")
    assert "{1, 2, 4}" in p.fix


def test_unknown_key_suggests_the_close_one():
    p = next(p for p in problems_of("+model.n_head=2") if p.key == "model.n_head")
    assert "did you mean model.n_heads" in p.fix


def test_all_problems_are_reported_together():
    keys = {p.key for p in problems_of("train.batch_size=0", "model.dropout=2", "+parallel.foo=1")}
    assert {"train.batch_size", "model.dropout", "parallel.foo"} <= keys


def test_ort_kernels_need_cuda_and_ort_triton():
    if torch.cuda.is_available():
        pytest.fail("this test checks the refusal on a machine without CUDA")
    p = next(p for p in problems_of("engine=ort", "triton=on") if p.key == "triton.enabled")
    assert "need a CUDA GPU and ORT's Triton build" in p.rule and "no CUDA device" in p.rule
    assert "engine=torch triton=on" in p.fix
    assert problems_of("engine=torch", "triton=on") == []


def test_a_cuda_machine_gives_each_local_rank_a_gpu_and_bf16_needs_ampere(monkeypatch):
    """Rules of a CUDA machine, checked on this one with its answers faked: two GPUs, no bf16."""
    from runtime import machine

    monkeypatch.setattr(machine, "has_cuda", lambda: True)
    monkeypatch.setattr(machine, "cuda_devices", lambda: 2)
    monkeypatch.setattr(machine, "cuda_bf16", lambda: False)
    (p,) = [p for p in problems_of("parallel=megatron_hp4", "precision=fp32") if p.key == "parallel"]
    assert p.value == "dp1 hp4 pp1" and "4 ranks (dp*hp*pp) on a CUDA GPU of its own" in p.rule
    assert "shows 2" in p.rule and "at most 2 rank(s)" in p.fix and "cluster.gpus_per_task=1" in p.fix
    assert "CUDA_VISIBLE_DEVICES=" in p.fix
    assert problems_of("parallel=ddp2", "precision=fp32") == []
    assert problems_of("parallel=megatron_hp4", "precision=fp32", "cluster=slurm", "dry_run=true") == []
    (p,) = problems_of("precision=bf16")
    assert (p.key, p.value) == ("precision.name", "bf16") and "compute capability 8.0" in p.rule
    assert "precision=fp16" in p.fix


def test_each_rank_takes_the_gpu_it_sees_as_its_own(monkeypatch):
    """cuda:LOCAL_RANK where a rank sees every GPU of its node; cuda:0 where SLURM shows each task only its own
    (--gpus-per-task): LOCAL_RANK 3 there was an invalid device ordinal."""
    from plugins.parallel import mesh

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    for visible, local, want in ((8, "3", 3), (1, "3", 0), (2, "3", 1), (4, "0", 0)):
        monkeypatch.setattr(torch.cuda, "device_count", lambda n=visible: n)
        monkeypatch.setenv("LOCAL_RANK", local)
        assert mesh.pick_device() == torch.device("cuda", want)
    assert chosen == [3, 0, 1, 0]


def test_missing_option_lists_the_options():
    with pytest.raises(HydraException) as info:
        make_cfg("model=nonexistent")
    fix = from_hydra(info.value).problems[0].fix
    assert "gpt_tiny" in fix and "schema" not in fix
