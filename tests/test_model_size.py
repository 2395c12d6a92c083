"""Models of any size: a rank allocates only what it holds, aggregation streams into sharded files that transformers,
orchestrator.load and ONNX Runtime read, and the bytes that decide it are small here (shard and external-data
thresholds of a few hundred KB force the code paths a 70B model takes)."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import orchestrator
from storage import consolidate
from storage.dcp_reader import CheckpointReader
from storage.fsio import KnownHashes, sha256_file
from storage.safetensors_shards import Reader, same_bits
from tests.conftest import ROOT, cache_entry, cli_env, run_debug
from tests.layout_memory_rank import peak_allocated

BOOKKEEPING = 16 * 2**10  # what building a layout allocates besides parameters (the mesh's rank tensor, ...)


def _rank_lines(world: int, *args: str) -> list[dict]:
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                             str(ROOT / "tests" / "layout_memory_rank.py"), *args], capture_output=True, text=True,
                            timeout=600, env=cli_env())
    found = re.search(r"^(\[\{.*)$", result.stdout, re.M)
    assert found, result.stdout[-2000:] + result.stderr[-3000:]
    return json.loads(found.group(1))


def test_train_init_from_loads_into_the_shards_one_tensor_at_a_time(tmp_path):
    """train.init_from=hf:<folder> and a DCP checkpoint written by one process, loaded into hp2 x pp2: each rank reads
    one tensor at a time into its shards (a fused GPT-2 q/k/v with the part it takes), never the model. A DCP load
    also makes the rank's optimizer state: torch's _init_optim_state runs one step with zero gradients (gradients,
    AdamW's two moments and the step's temporaries: 3.7x the rank's parameters measured, what every training step
    allocates too), then DCP reads the saved tensors into it; the full state (3x the model) is never near."""
    from tests.test_hf import FAMILIES, saved

    folder = saved("gpt", tmp_path / "hf")
    report = run_debug(tmp_path, *FAMILIES["gpt"][0], "train.steps=2", "train.eval_every=0",
                       "train.checkpoint_every=0")
    checkpoint = cache_entry(tmp_path, report, "checkpoint")
    layout = [*FAMILIES["gpt"][0], "parallel.hp=2", "parallel.pp=2", "parallel.microbatches=2"]
    for rank in _rank_lines(4, f"--hf={folder}", f"--dcp={checkpoint}", *layout):
        assert rank["load_peak_hf"] <= 2 * rank["largest"] + BOOKKEEPING < rank["model"] / 4, rank
        assert rank["load_peak_dcp"] <= 5 * rank["held"] + 2 * rank["largest"] + BOOKKEEPING < 3 * rank["model"], rank


def test_the_plan_states_every_stage_and_refuses_what_cannot_fit_before_anything_runs(tmp_path):
    """The 0.52B model (2.08 GB of weights) against what a SLURM task may use: at 2 GB the single train rank and the
    aggregate's ONNX check (ONNX Runtime's copy of the weights) are refused, the latter's fix naming
    aggregate.onnx=false; with pp=10 only the ONNX check is, and aggregate.onnx=false clears it (export needs no
    model: its graph is traced on the meta device); at 0.5 GB the export stage's check is refused too."""
    from orchestrator.config.errors import ConfigError
    from orchestrator.config.validate import validate
    from planning.plan import memory_line, plan_of
    from tests.conftest import make_cfg

    big = ["model.d_model=2048", "model.n_layers=10", "model.n_heads=16", "model.d_ff=8192", "model.vocab_size=8192",
           "model.max_seq_len=64", "train.seq_len=32", "train.batch_size=10", "cluster=slurm", "tracking=none",
           f"cache_dir={tmp_path}"]

    def refused(*args: str) -> dict[str, list]:
        """key -> the problems validation names for it (none: the config is accepted)."""
        try:
            validate(make_cfg(*big, *args))
        except ConfigError as e:
            found: dict[str, list] = {}
            for p in e.problems:
                if p.key != "cluster":  # SLURM's commands are on this machine or not
                    found.setdefault(p.key, []).append(p)
            return found
        return {}

    problems = refused("cluster.mem_per_task_gb=2")
    assert set(problems) == {"parallel", "aggregate.onnx"}
    (onnx_check,) = problems["aggregate.onnx"]
    assert "ONNX check" in onnx_check.rule and "aggregate.onnx=false" in onnx_check.fix
    deep = ["cluster.mem_per_task_gb=2", "parallel.pp=10", "parallel.microbatches=10"]
    assert set(refused(*deep)) == {"aggregate.onnx"}
    assert refused(*deep, "aggregate.onnx=false") == {}
    rules = [p.rule for p in refused("cluster.mem_per_task_gb=0.5", "aggregate.onnx=false")["model"]]
    assert any(r.startswith("the export stage needs about") and "twin" in r for r in rules)
    assert any(r.startswith("the aggregate stage needs about") for r in rules)
    line = memory_line(plan_of(make_cfg(*big, *deep)))
    assert re.search(r"one process each: export [\d.]+ GB .*; checkpoint [\d.]+ GB .*; aggregate [\d.]+ GB", line)
    assert re.search(r"disk: checkpoints 5\.8\d GB each, the aggregate's files", line)


def test_the_writer_streams_a_checkpoint_in_read_groups_not_the_model(tmp_path, monkeypatch):
    """Aggregation's writer holds one read group (and the tensor being read back), never the state: with a 64 KB
    group, the peak of live bytes stays far below the checkpoint's, and the files hold the checkpoint bit for bit.
    A tensor whose bytes read back differ from those written stops the writer, naming it."""
    report = run_debug(tmp_path, "train.steps=2", "train.eval_every=0", "train.checkpoint_every=0")
    source = CheckpointReader(cache_entry(tmp_path, report, "checkpoint"))
    state = sum(math.prod(shape) * 4 for section in ("model", "optim") for shape, _ in source.tensors(section).values())
    largest = max(math.prod(shape) * 4 for shape, _ in source.tensors("model").values())
    known = KnownHashes()  # each file's sha256 from its bytes as written: the cache entry reads none back
    peak, _ = peak_allocated(lambda: consolidate.write_from_checkpoint(tmp_path / "out", source, [], {},
                                                                       max_shard_bytes=10**9, read_bytes=64 * 2**10,
                                                                       known=known))
    assert peak <= 64 * 2**10 + 3 * largest + BOOKKEEPING < state / 4, (peak, state, largest)
    files = sorted((tmp_path / "out").glob("*.safetensors"))
    assert len(files) == 2 and all(known.get(f) == sha256_file(f) for f in files)
    written = Reader(tmp_path / "out", consolidate.MODEL)
    want = source.read("model", list(written))
    assert all(same_bits(written[k], want[k]) for k in written) and len(written) == len(source.tensors("model"))

    honest, victim = Reader.__getitem__, sorted(written)[-1]

    def one_byte_off(self, name):
        tensor = honest(self, name)
        if name == victim:
            tensor.view(-1).view(torch.uint8)[0] ^= 1
        return tensor
    monkeypatch.setattr(Reader, "__getitem__", one_byte_off)
    with pytest.raises(RuntimeError, match=f"{re.escape(victim)} read back differs from what was written"):
        consolidate.write_from_checkpoint(tmp_path / "again", source, [], {}, max_shard_bytes=10**9)


def test_small_thresholds_shard_the_files_and_put_the_onnx_weights_outside(tmp_path):
    """aggregate.shard_size_mb=0.5 and onnx_external_data_mb=0 on the 1.7 MB default model with its vocabulary
    padded (320 -> 384 rows): several safetensors shards with an index (optimizer and hf/, the one copy of the
    weights, the padding's rows beside it), model.onnx + model.onnx.data; transformers loads hf/, orchestrator.load
    reads the shards bit for bit against the checkpoint, padding included, ONNX Runtime runs the model from its
    external data, all with the torch model's logits."""
    import onnxruntime as ort
    import transformers

    report = run_debug(tmp_path, "aggregate.shard_size_mb=0.5", "aggregate.onnx_external_data_mb=0",
                       "model.pad_vocab_to=128")
    assert report.exit_code == 0
    out = cache_entry(tmp_path, report, "aggregate")
    assert not list(out.glob("model*.safetensors*")) and (out / "vocab_padding.safetensors").is_file()
    for folder, stem in ((out, "optimizer"), (out / "hf", "model")):
        index = json.loads((folder / f"{stem}.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) >= 3 and all(re.fullmatch(rf"{stem}-\d{{5}}-of-{len(files):05d}\.safetensors", f)
                                       for f in files)
        assert not (folder / f"{stem}.safetensors").exists()
        assert max((folder / f).stat().st_size for f in files) <= 0.5e6 + 300e3  # a shard, or one larger tensor
    assert (out / "model.onnx.data").stat().st_size > (out / "model.onnx").stat().st_size

    model, optimizer = orchestrator.load(out, optimizer=True)
    checkpoint = CheckpointReader(cache_entry(tmp_path, report, "checkpoint"))
    want = checkpoint.read("model", list(checkpoint.tensors("model")))
    assert all(same_bits(model.get_parameter(k).detach(), v) for k, v in want.items())
    moments = checkpoint.read("optim", list(checkpoint.tensors("optim")))
    param = dict(model.named_parameters())["layers.3.mlp.fc1.weight"]
    assert same_bits(optimizer.state[param]["exp_avg"], moments["state.layers.3.mlp.fc1.weight.exp_avg"])

    ids = torch.randint(0, 258, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out / "hf").eval()(ids).logits
    onnx_logits = ort.InferenceSession(str(out / "model.onnx")).run(None, {"input_ids": ids.numpy()})[0]
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert np.abs(onnx_logits - ours.numpy()).max() <= 1e-4
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["onnx"]["external_data"] == "model.onnx.data"
    assert manifest["verification"]["eval_loss"] == pytest.approx(manifest["verification"]["train_final_eval_loss"],
                                                                  rel=1e-6)


def test_without_the_onnx_model_the_rest_is_aggregated(tmp_path):
    report = run_debug(tmp_path, "train.steps=2", "train.eval_every=0", "aggregate.onnx=false")
    assert report.exit_code == 0
    out = cache_entry(tmp_path, report, "aggregate")
    assert not (out / "model.onnx").exists() and (out / "hf" / "model.safetensors").is_file()
    assert json.loads((out / "manifest.json").read_text())["onnx"] == "skipped (aggregate.onnx=false)"


def test_a_model_over_the_check_size_is_traced_on_meta_and_checked_on_a_twin(tmp_path, monkeypatch):
    """Above CHECK_WEIGHTS_BYTES (0 here) the export stage holds no model: its graph is traced on the meta device
    (byte for byte the graph a real model gives) and checked on a two-layer twin; the aggregate stage checks the
    whole graph with the trained weights."""
    import onnx

    import stages.export
    from plugins.models import build_on_meta, get_model
    from plugins.models.registry import materialise
    from plugins.onnx.exporter import export_model
    from tests.conftest import make_cfg

    monkeypatch.setattr(stages.export, "CHECK_WEIGHTS_BYTES", 0)
    report = run_debug(tmp_path, "train.steps=2", "train.eval_every=0")
    assert report.exit_code == 0
    export = cache_entry(tmp_path, report, "export")
    record = json.loads((export / "export.json").read_text())["model"]
    assert record["checked_on"].startswith("a 2-layer twin") and record["check"]["max_abs_diff"] <= 1e-4
    cfg = make_cfg()
    spec = get_model("gpt")
    real = materialise(build_on_meta(spec, cfg.model), torch.device("cpu"))
    spec.init_weights(real, cfg.model, 0)
    graph, _, _ = export_model(real, spec, cfg.model, cfg.export, cfg.engine.opset, params_as_inputs=True)
    assert onnx.load(export / "model.onnx").SerializeToString() == graph.SerializeToString()
    manifest = json.loads((cache_entry(tmp_path, report, "aggregate") / "manifest.json").read_text())
    assert manifest["verification"]["onnx_max_abs_diff"] <= 1e-4
