"""Checkpoints: complete only with a verified manifest; resume exactness; the consolidated format."""
from __future__ import annotations

import sys

import pytest
import torch

from storage import checkpoint as ckpt
from storage import fsio
from storage import consolidate
from plugins.models import get_model
from runtime.checkpointer import pacing_advice
from runtime.optim import build_optimizer
from tests.conftest import make_cfg


def trained(steps=2, seed=0):
    cfg = make_cfg("model.n_layers=2", "model.d_model=32", "model.d_ff=64")
    spec = get_model("gpt")
    model = spec.build(cfg.model)
    spec.init_weights(model, cfg.model, seed)
    opt = build_optimizer(cfg.optimizer, model)
    for s in range(steps):
        x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(s))
        spec.loss(model(x), x).backward()
        opt.step()
        opt.zero_grad()
    return cfg, spec, model, opt


def states_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def test_save_and_load_are_exact(tmp_path, monkeypatch):
    """The manifest's checksums are the writer's, taken as it wrote (the save reads no file back); they hold."""
    cfg, spec, model, opt = trained()
    with monkeypatch.context() as m:
        m.setattr(fsio, "sha256_file", lambda path: pytest.fail(f"the save read {path} back to hash it"))
        path = ckpt.save(ckpt.step_dir(tmp_path, 2), [(model, opt)], {"step": 2, "trainer": {}})
    assert ckpt.verify(path) == []
    manifest = ckpt.read_manifest(path)
    assert manifest["step"] == 2 and manifest["files"] and all(f["sha256"] for f in manifest["files"].values())
    _, _, fresh, fresh_opt = trained(steps=0, seed=1)
    ckpt.load(path, [(fresh, fresh_opt)])
    want, got = ckpt.training_state([(model, opt)]), ckpt.training_state([(fresh, fresh_opt)])
    assert states_equal(want["model"], got["model"]) and states_equal(want["optim"], got["optim"])


def test_settings_are_one_entry_a_parameter_and_a_checkpoint_of_an_entry_a_setting_still_loads(tmp_path):
    """Each parameter's optimizer settings are one DCP entry (not eleven: the save's planning and writing are per
    entry); a checkpoint written with an entry per setting (format v1) loads as before, the settings included."""
    import torch.distributed.checkpoint as dcp

    _, _, model, opt = trained()
    for group in opt.param_groups:
        group["lr"] = 0.0123  # a setting the fresh optimizer does not have
    path = ckpt.save(ckpt.step_dir(tmp_path, 2), [(model, opt)], {"step": 2, "trainer": {}})
    entries = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    settings = [k for k in entries if k.startswith("optim.param_groups.")]
    assert len(settings) == len(list(model.parameters())) and "optim.param_groups.wte.weight" in settings
    flat = ckpt.training_state([(model, opt)], grouped=False)
    assert flat["optim"]["param_groups.wte.weight.lr"] == 0.0123 and ckpt.expand_settings(
        ckpt.training_state([(model, opt)])["optim"]) == flat["optim"]

    old = tmp_path / "v1"
    dcp.save(flat, checkpoint_id=str(old))
    fsio.atomic_write_json(old / ckpt.MANIFEST, {"format": ckpt.FLAT_SETTINGS, "step": 2, "files": {}})
    _, _, fresh, fresh_opt = trained(steps=0, seed=1)
    ckpt.load(old, [(fresh, fresh_opt)])
    assert fresh_opt.param_groups[0]["lr"] == 0.0123
    assert states_equal(flat["optim"], ckpt.training_state([(fresh, fresh_opt)], grouped=False)["optim"])


def copied(state: dict) -> dict:
    return {part: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entries.items()}
            for part, entries in state.items()}


def loads_as(path, spec_state: dict) -> bool:
    _, _, fresh, fresh_opt = trained(steps=0, seed=1)
    ckpt.load(path, [(fresh, fresh_opt)])
    got = ckpt.training_state([(fresh, fresh_opt)])
    return states_equal(spec_state["model"], got["model"]) and states_equal(spec_state["optim"], got["optim"])


def test_an_async_save_holds_the_state_of_its_step_and_the_bytes_of_a_sync_one(tmp_path):
    """train.async_checkpoint=async: the state is copied before training goes on, so steps taken while the files are
    written do not reach them; once finished the checkpoint is published as a sync save publishes it, with the same
    shards (DCP's .metadata names the folder it was written to). The next async save holds its own step's state,
    and the first checkpoint still holds the first's."""
    cfg, spec, model, opt = trained()
    switch_interval = sys.getswitchinterval()
    at_save = copied(ckpt.training_state([(model, opt)]))
    sync = ckpt.save(tmp_path / "sync" / "step_0000002", [(model, opt)], {"step": 2, "trainer": {}})
    pending = ckpt.save_async(ckpt.step_dir(tmp_path / "async", 2), [(model, opt)], {"step": 2, "trainer": {}})
    for s in range(3):  # training goes on while the checkpoint is written
        x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(10 + s))
        spec.loss(model(x), x).backward()
        opt.step()
        opt.zero_grad()
    assert not ckpt.step_dir(tmp_path / "async", 2).exists()  # not a checkpoint until finished
    path = pending.finish()
    assert ckpt.verify(path) == [] and ckpt.read_manifest(path)["step"] == 2
    shards = [name for name in ckpt.read_manifest(sync)["files"] if name.endswith(".distcp")]
    assert shards and all((path / name).read_bytes() == (sync / name).read_bytes() for name in shards)
    assert loads_as(path, at_save)
    at_next = copied(ckpt.training_state([(model, opt)]))
    assert not states_equal(at_next["model"], at_save["model"])
    following = ckpt.save_async(ckpt.step_dir(tmp_path / "async", 5), [(model, opt)],
                                {"step": 5, "trainer": {}}).finish()
    assert loads_as(following, at_next) and loads_as(path, at_save)
    assert sys.getswitchinterval() == switch_interval  # lowered only while a write was in flight


def test_saves_that_come_faster_than_the_disk_writes_them_are_named_with_the_interval_that_fits():
    """Step 10's save began at t=100 s and was published at t=112 s; step 20's was asked for at t=105 s (10 steps of
    0.5 s): training waited 7 s, and saves 24 steps apart (12 s of writing at 0.5 s a step) would not wait."""
    advice = pacing_advice(10, 100.0, 20, 105.0, 112.0)
    assert advice.startswith("the checkpoint of step 20 waited 7.0 s for step 10's, still being written: a save "
                             "takes about 12.0 s here and the 10 steps between saves 5.0 s")
    assert advice.endswith("train.checkpoint_every=24 or more keeps the writes out of the steps' way")
    assert pacing_advice(10, 100.0, 20, 105.0, 105.3) is None    # a wait under floor_s (0.5 s)
    assert pacing_advice(10, 100.0, 20, 200.0, 205.0) is None    # 5 s against 100 s of steps: under a tenth


def test_partial_and_damaged_checkpoints_are_never_taken(tmp_path):
    cfg, spec, model, opt = trained()
    ckpt.save(ckpt.step_dir(tmp_path, 1), [(model, opt)], {"step": 1, "trainer": {}})
    ckpt.save(ckpt.step_dir(tmp_path, 2), [(model, opt)], {"step": 2, "trainer": {}})
    # a crash mid-save leaves a partial folder and no step_3
    (tmp_path / ".step_0000003.partial").mkdir()
    # a folder under a final name but without a manifest (never produced by save, but never trusted either)
    (tmp_path / "step_0000004").mkdir()
    assert ckpt.latest(tmp_path)[0] == 2
    # flip one byte of the newest: latest() falls back to step 1 and says why
    victim = next(p for p in ckpt.step_dir(tmp_path, 2).iterdir() if p.name.endswith(".distcp"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    step, path, rejected = ckpt.latest(tmp_path)
    assert step == 1 and any("step_0000002" in r and "sha256 differs" in r for r in rejected)
    assert any("step_0000004" in r and "manifest.json is missing" in r for r in rejected)
    ckpt.prune(tmp_path, keep=1)
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path)] == [2]
    assert not (tmp_path / ".step_0000003.partial").exists()


def test_missing_manifest_is_reported(tmp_path):
    assert "manifest.json is missing" in ckpt.verify(tmp_path)[0]


def test_consolidated_round_trip_with_tied_weights(tmp_path):
    cfg, spec, model, opt = trained()
    consolidate.save(tmp_path, model, opt, {"step": 2})
    weights = consolidate.tensors(tmp_path, consolidate.MODEL_FILE)
    assert "lm_head.weight" not in weights or "wte.weight" not in weights  # stored once
    _, _, fresh, fresh_opt = trained(steps=0, seed=3)
    consolidate.load(tmp_path, fresh, fresh_opt)
    assert fresh.lm_head.weight is fresh.wte.weight
    want, got = ckpt.training_state([(model, opt)]), ckpt.training_state([(fresh, fresh_opt)])
    assert states_equal(want["model"], got["model"]) and states_equal(want["optim"], got["optim"])
    # and it trains on identically
    x = torch.randint(0, 256, (2, 8))
    for m, o in ((model, opt), (fresh, fresh_opt)):
        spec.loss(m(x), x).backward()
        o.step()
    assert torch.equal(model.layers["0"].attn.wq.weight, fresh.layers["0"].attn.wq.weight)
