"""Planning: order, content keys (what enters them and what does not), cache hits, atomic publishing."""
from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator.cache.store import Cache
from orchestrator.dag import plan
from runtime.threads import usable_cores
from storage.fsio import verify_file_table
from stages import all_stages
from stages.base import Stage
from tests.conftest import make_cfg


def keys(*overrides: str, cache_root: Path) -> dict[str, str]:
    return {ps.name: ps.key for ps in plan(make_cfg(*overrides), all_stages(), Cache(cache_root))}


def test_plan_is_in_dependency_order_with_resources(tmp_path):
    planned = plan(make_cfg(), all_stages(), Cache(tmp_path))
    assert [ps.name for ps in planned] == ["tokenize", "export", "transform", "train", "checkpoint", "aggregate"]
    assert all(not ps.cached for ps in planned)
    # tokenize takes every usable core (the default corpus has more pieces than this machine has cores)
    assert [ps.resources.tasks for ps in planned] == [usable_cores(), 1, 1, 1, 1, 1]


def test_keys_are_stable(tmp_path):
    assert keys(cache_root=tmp_path) == keys(cache_root=tmp_path)


def test_lr_change_reuses_export_and_transform(tmp_path):
    a, b = keys(cache_root=tmp_path), keys("optimizer.lr=3e-4", cache_root=tmp_path)
    assert a["export"] == b["export"] and a["transform"] == b["transform"]
    assert a["train"] != b["train"] and a["checkpoint"] != b["checkpoint"] and a["aggregate"] != b["aggregate"]


def test_layout_change_keeps_export(tmp_path):
    a, b = keys(cache_root=tmp_path), keys("parallel.microbatches=2", cache_root=tmp_path)
    assert a["export"] == b["export"] and a["transform"] != b["transform"]


@pytest.mark.parametrize("override", ["train.resume=false", "train.log_every=5", "train.progress=false",
                                      "tracking=none", "tracking.uri=sqlite:///elsewhere.db", "cluster=debug",
                                      "cluster.threads_per_rank=1", "dry_run=true", "train.keep_checkpoints=5",
                                      "data.tasks=1"])
def test_execution_only_keys_do_not_change_keys(override, tmp_path):
    assert keys(override, cache_root=tmp_path) == keys(cache_root=tmp_path)


DOWNSTREAM_OF_TRAIN = {"train", "checkpoint", "aggregate"}


@pytest.mark.parametrize("override,changed", [
    ("model.d_model=128", {"export", "transform"} | DOWNSTREAM_OF_TRAIN),
    ("engine.opset=16", {"export", "transform"} | DOWNSTREAM_OF_TRAIN),
    ("train.seed=1", DOWNSTREAM_OF_TRAIN),
    ("data=synthetic", {"tokenize"} | DOWNSTREAM_OF_TRAIN),
    ("data.tokenizer=bpe", {"tokenize"} | DOWNSTREAM_OF_TRAIN),
    ("memory=level1", DOWNSTREAM_OF_TRAIN),
])
def test_content_keys_change_in_the_stages_that_read_them_and_downstream(override, changed, tmp_path):
    a, b = keys(cache_root=tmp_path), keys(override, cache_root=tmp_path)
    assert {name for name in a if a[name] != b[name]} == changed


def test_data_files_enter_the_key(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"doc{i}.txt").write_text("hello world " * 50 * (i + 1))
    args = ("data=text", f"data.paths=[{corpus}]")
    before = keys(*args, cache_root=tmp_path / "c")
    (corpus / "doc0.txt").write_text("changed text " * 80)
    after = keys(*args, cache_root=tmp_path / "c")
    assert before["transform"] == after["transform"] and before["tokenize"] != after["tokenize"]
    assert before["train"] != after["train"]


def test_code_enters_the_key(tmp_path, monkeypatch):
    """A module a stage reaches only through other modules' imports enters its key: storage/fsio.py (every stage
    reaches it, most through plugins they import) and planning/partition.py (transform, and train and aggregate
    through plugins.parallel and the aggregate's imports) edited in a copy of the tree give new keys to the stages
    that reach them and leave the others' as they were. (Hand-kept lists had fsio in the checkpoint stage's only.)"""
    import shutil

    import orchestrator.cache.code_keys as code_keys

    copy, checkout = tmp_path / "tree", code_keys.ROOT
    for package in code_keys.PACKAGES:
        shutil.copytree(checkout / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))
    cfg, stages = make_cfg(), all_stages()

    def keys(root) -> dict[str, str]:
        monkeypatch.setattr(code_keys, "ROOT", root)
        code_keys.source_hash.cache_clear()  # sources are read once per process: here they change in between
        code_keys.reached.cache_clear()
        return {ps.name: ps.key for ps in plan(cfg, stages, Cache(tmp_path / "cache"))}

    original = keys(checkout)
    assert keys(copy) == original  # the same sources, the same keys
    fsio = copy / "storage" / "fsio.py"
    fsio.write_text(fsio.read_text() + "# an edit\n")
    edited = keys(copy)
    assert all(edited[name] != original[name] for name in original), (edited, original)
    fsio.write_text((checkout / "storage" / "fsio.py").read_text())
    partition = copy / "planning" / "partition.py"
    partition.write_text(partition.read_text() + "# an edit\n")
    edited = keys(copy)
    assert [n for n in original if edited[n] == original[n]] == ["tokenize", "export"]


def test_cycles_and_unknown_upstreams_are_rejected(tmp_path):
    s = all_stages()
    cyclic = [replace(s[0], after=("aggregate",)), *s[1:]]
    with pytest.raises(ValueError, match="cycle"):
        plan(make_cfg(), cyclic, Cache(tmp_path))
    with pytest.raises(ValueError, match="unknown stage"):
        plan(make_cfg(), [replace(s[0], after=("nope",))], Cache(tmp_path))


def _export(planned):
    return next(ps for ps in planned if ps.name == "export")


def test_published_entry_is_a_hit_and_verifiable(tmp_path):
    cache = Cache(tmp_path)
    cfg = make_cfg()
    first = _export(plan(cfg, all_stages(), cache))
    out, scratch = cache.begin(first.name, first.key)
    (out / "model.onnx").write_bytes(b"graph")
    for i in range(5):  # files hashed several at once (fsio.digests): each hash lands on its own file
        (out / f"weights-{i}.bin").write_bytes(bytes([i]) * (1000 + i))
    assert not cache.is_complete(first.name, first.key)  # being written: never a hit
    entry = cache.publish(first.name, first.key, {"material": first.material})
    assert cache.is_complete(first.name, first.key)
    assert not cache.work(first.name, first.key).exists()
    record = cache.record(first.name, first.key)
    assert verify_file_table(entry, record["files"]) == []
    assert _export(plan(cfg, all_stages(), cache)).cached
    (entry / "model.onnx").write_bytes(b"grapH")  # same size: only the hash sees it
    assert verify_file_table(entry, record["files"]) == ["model.onnx: sha256 differs from the manifest"]
    assert record["files"]["weights-3.bin"] == {"bytes": 1003, "sha256": hashlib.sha256(b"\x03" * 1003).hexdigest()}
    (entry / "weights-1.bin").unlink()
    (entry / "weights-2.bin").write_bytes(b"\x02" * 1000)
    (entry / "weights-4.bin").write_bytes(b"\x05" * 1004)
    assert verify_file_table(entry, record["files"]) == [
        "model.onnx: sha256 differs from the manifest", "weights-1.bin: missing",
        "weights-2.bin: 1000 bytes, manifest says 1002", "weights-4.bin: sha256 differs from the manifest"]
    damaged = _export(plan(cfg, all_stages(), cache))
    assert not damaged.cached and damaged.damage[0] == "model.onnx: sha256 differs from the manifest"
    assert not entry.exists() and len(list((tmp_path / "export" / ".damaged").iterdir())) == 1


def test_an_entry_s_table_takes_the_hashes_its_stage_made_while_the_files_are_unchanged(tmp_path, monkeypatch):
    """The checkpoint stage hashes the checkpoint once, to check it against its manifest (StageContext.hashes):
    publishing reuses those hashes, and hashes what the stage did not, or changed since."""
    from storage import fsio

    cache = Cache(tmp_path)
    out, _ = cache.begin("checkpoint", "k")
    for name in ("__0_0.distcp", "__1_0.distcp", "manifest.json"):
        (out / name).write_bytes(name.encode() * 100)
    known = fsio.KnownHashes()
    assert [known.sha256(out / n) for n in ("__0_0.distcp", "__1_0.distcp")] == \
        [fsio.sha256_file(out / n) for n in ("__0_0.distcp", "__1_0.distcp")]
    (out / "__1_0.distcp").write_bytes(b"changed after its hash")
    hashed, real = [], fsio.sha256_file
    monkeypatch.setattr(fsio, "sha256_file", lambda p, *a: hashed.append(Path(p).name) or real(p, *a))
    entry = cache.publish("checkpoint", "k", {}, known=known)
    assert sorted(hashed) == ["__1_0.distcp", "manifest.json"]
    assert verify_file_table(entry, cache.record("checkpoint", "k")["files"]) == []


def test_a_new_attempt_clears_output_but_keeps_scratch(tmp_path):
    cache = Cache(tmp_path)
    out, scratch = cache.begin("train", "k")
    (out / "half.bin").write_bytes(b"x")
    (scratch / "checkpoints").mkdir()
    out, scratch = cache.begin("train", "k")
    assert list(out.iterdir()) == [] and (scratch / "checkpoints").is_dir()


def test_stage_progress_hint_shows_in_the_plan(tmp_path):
    cache = Cache(tmp_path)
    cfg = make_cfg()
    train = next(ps for ps in plan(cfg, all_stages(), cache) if ps.name == "train")
    (cache.scratch("train", train.key) / "checkpoints" / "step_0000100").mkdir(parents=True)
    (cache.scratch("train", train.key) / "checkpoints" / "step_0000100" / "manifest.json").write_text(
        '{"format": "orchestrator-dcp-v1", "files": {}}')
    again = next(ps for ps in plan(cfg, all_stages(), cache) if ps.name == "train")
    assert again.note == "resumes from step 100"


def test_stage_declares_its_module():
    assert {s.name: s.module for s in all_stages()}["train"] == "stages.train"
    assert isinstance(all_stages()[0], Stage)


def test_stage_params_take_sections_and_single_keys():
    from orchestrator.tracking.tracker import config_params

    params = config_params(make_cfg(), ("model", "engine.opset"))
    assert params["engine.opset"] == "17" and params["model.n_layers"] == "8" and params["model.name"] == "gpt"


def test_an_optional_upstream_is_an_input_only_when_the_config_runs_it(tmp_path):
    """train after a stage only some configs run (the reference log-probabilities of preference pairs, cached):
    planned after it, its key in train's, when it runs; else neither, and train's key is the one without it."""
    stages, cache = all_stages(), Cache(tmp_path)
    alone = [replace(s, after=tuple(u for u in s.after if u != "reference"), optional=()) if s.name == "train" else s
             for s in stages if s.name != "reference"]
    for overrides in ((), ("objective=dpo", "objective.reference=online")):
        off = {ps.name: ps for ps in plan(make_cfg(*overrides), stages, cache)}
        assert "reference" not in off and "reference" not in off["train"].stage.after
        assert off["train"].key == {ps.name: ps for ps in plan(make_cfg(*overrides), alone, cache)}["train"].key
    on = {ps.name: ps for ps in plan(make_cfg("objective=dpo"), stages, cache)}
    assert "reference" in on["train"].stage.after and on["train"].material["inputs"]["reference"] == on["reference"].key
    assert list(on).index("tokenize") < list(on).index("reference") < list(on).index("train")
    required = [replace(s, optional=()) if s.name == "train" else s for s in stages]
    with pytest.raises(ValueError, match="unknown stage"):
        plan(make_cfg(), required, cache)
