"""The train stage's checkpoints (TorchTitan's CheckpointManager, slimmed): where a run starts from, a save at a
step, pruning, and what is left when a run stops. Every rank calls restore and save (DCP is collective); rank 0
chooses the folder and verifies it."""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

from storage import checkpoint as ckpt
from storage import disk_speed
from storage import adapters, hf
from storage.fsio import atomic_write_json, link_tree, read_json, remove_tree, tree_bytes

ADOPTED = "adopted.json"  # in the scratch folder: the checkpoint an earlier attempt under another key left


class Checkpointer:
    """vocab_rows: the model's embedding rows (model.pad_vocab_to's padding included): Hugging Face weights
    (train.init_from=hf:) are padded to them. adapters: the names a base model's weights do not have (LoRA's, which
    then train alone: the base is read from train.init_from's folder, the rest from the checkpoint); None: none."""

    def __init__(self, ctx, layout, parts, scaler, meta: dict, history, vocab_rows: int,
                 adapters: Optional[Callable[[str], bool]] = None):
        self.ctx, self.layout, self.parts, self.scaler = ctx, layout, parts, scaler
        self.meta, self.history, self.vocab_rows, self.adapters = meta, history, vocab_rows, adapters
        self.folder = ctx.scratch / "checkpoints"
        self.keep = max(ctx.cfg.train.keep_checkpoints, 1)
        self.background = ctx.cfg.train.get("async_checkpoint", "disabled") == "async"
        self.pending: Optional[ckpt.PendingSave] = None
        # the background writer's collectives get a gloo group of their own (as TorchTitan's): on training's group
        # they would interleave with the step's
        self.group = dist.new_group(backend="gloo") if self.background and layout.world else None
        self.in_flight: Optional[tuple[int, float]] = None  # (step, when) of the background save being written
        self.advised = False

    def forget(self) -> None:
        """train.resume=false: this key's earlier checkpoints are not resumed (rank 0 removes them)."""
        if self.ctx.is_rank0:
            remove_tree(self.folder)

    def save(self, step: int, wait: bool = False) -> None:
        """A checkpoint of this step. With train.async_checkpoint=async it is written in the background (the one
        before it finished first) unless `wait`: the last step's, and a stop's, are complete when this returns."""
        asked = time.monotonic()
        self.wait()
        if self.in_flight is not None and not wait and self.ctx.is_rank0 and not self.advised:
            advice = pacing_advice(*self.in_flight, step, asked, time.monotonic())
            if advice:
                self.ctx.log.warning("%s", advice)
                self.advised = True
        self.in_flight = (step, time.monotonic()) if self.background and not wait else None
        if self.ctx.is_rank0:
            self.history.sync()  # the metrics up to the step, on disk before the checkpoint that resumes after them
        path, meta = ckpt.step_dir(self.folder, step), {**self.meta, "step": step,
                                                         "loss_scaler": self.scaler.state_dict()}
        if self.background:
            self.pending = ckpt.save_async(path, self.parts, meta, self.layout.aliases, self.group)
            if wait:
                self.wait()
            return
        began = time.monotonic()
        ckpt.save(path, self.parts, meta, self.layout.aliases)
        self._record(path, time.monotonic() - began)
        ckpt.prune(self.folder, keep=self.keep)

    def wait(self) -> None:
        """Finish the checkpoint being written in the background, if any: complete and published on return."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._record(pending.finish(), pending.seconds)
            ckpt.prune(self.folder, keep=self.keep)

    def _record(self, path: Path, seconds: float) -> None:
        """The save's bytes and time, for the plan's time of the saves (storage/disk_speed.py)."""
        if self.ctx.is_rank0:
            store = Path(self.ctx.cfg.cache_dir).expanduser().resolve()
            disk_speed.record(store, "checkpoint", tree_bytes(path), seconds)

    def last(self, step: int) -> Path:
        return ckpt.step_dir(self.folder, step)

    def last_good(self) -> str:
        good = ckpt.complete_checkpoints(self.folder)
        return f"the checkpoint of step {good[-1][0]} (written before; intact)" if good else "none (no checkpoint yet)"

    def restore(self) -> int:
        """The step to start from: this run's latest complete checkpoint, else `train.init_from`, else 0.
        Rank 0 chooses (and verifies checksums); every rank loads the same folder. fp16's loss scale continues
        from the checkpoint (one written in another precision has none: the scale starts afresh)."""
        ctx, init_from = self.ctx, self.ctx.cfg.train.init_from
        choice = self._choose(init_from) if ctx.is_rank0 else None
        if self.layout.world:
            box = [choice]
            dist.broadcast_object_list(box, src=0)
            choice = box[0]
        if choice is None:
            return 0
        if self.adapters is not None and not hf.folder_of(choice):
            # the frozen base first (the checkpoint holds the adapters only): init_from's, or the one a continued
            # LoRA checkpoint names
            self._load_base(adapters.base_folder(init_from))
        if hf.folder_of(choice):  # weights only: a fresh optimizer, step 0
            self._load_base(hf.folder_of(choice))
            ctx.log.info("starting from the Hugging Face weights in %s", hf.folder_of(choice))
            ctx.tracker.set_tags({"resumed_from_step": 0, "resumed_from": choice})
            return 0
        manifest = ckpt.load(Path(choice), self.parts, self.layout.aliases)
        self.scaler.load_state_dict(manifest.get("loss_scaler"))
        step = manifest["step"]
        written_by = manifest.get("trainer", {})
        ctx.log.info("starting from the checkpoint of step %d (%s; written by dp%s hp%s pp%s)", step, choice,
                     written_by.get("dp"), written_by.get("hp"), written_by.get("pp"))
        ctx.tracker.set_tags({"resumed_from_step": step, "resumed_from": choice})
        return step

    def _load_base(self, folder: Path) -> None:
        """A Hugging Face folder's weights into every parameter it has (LoRA's adapters keep their initial values)."""
        ckpt.load_full_weights(self.parts, hf.load_state(folder, self.vocab_rows), self.layout.aliases,
                               leave=self.adapters)

    def _choose(self, init_from: Optional[str]) -> Optional[str]:
        ckpt.sweep_partials(self.folder)
        self._check_adopted()
        aside = self.ctx.aside / f"{self.ctx.key}-checkpoints" if self.ctx.aside else None
        found = ckpt.latest(self.folder, set_aside=True, aside=aside)
        for problem in found[2] if found else []:
            self.ctx.log.warning("skipping a damaged checkpoint: %s", problem)
        if found and found[1] is None:
            self.ctx.log.warning("every checkpoint of this run is damaged (%d set aside): training restarts from %s",
                                 len(found[2]), f"train.init_from={init_from}" if init_from else "step 0")
        if found and found[1] is not None:
            return str(found[1])
        if hf.folder_of(init_from):
            return init_from
        if init_from:
            problems = ckpt.verify(Path(init_from))
            if problems:
                raise RuntimeError(f"train.init_from={init_from} is not a complete checkpoint: {'; '.join(problems)}")
            return str(Path(init_from).resolve())
        return None


    def _check_adopted(self) -> None:
        """A checkpoint adopted from an attempt under another key (other code, another layout) is resumed only if
        it holds the parameters this run's partition plan has (names and full shapes): the code may have changed
        the model. Otherwise it is dropped, and the run starts as it would have without it."""
        adopted = self.ctx.scratch / ADOPTED
        if not adopted.is_file():
            return
        record = read_json(adopted)
        step_dir = ckpt.step_dir(self.folder, record["step"])
        if not step_dir.is_dir():
            return
        theirs = _shapes(ckpt.read_manifest(step_dir).get("partition_plan", {}))
        ours = _shapes(self.meta["partition_plan"])
        if theirs != ours:
            differ = sorted(set(theirs.items()) ^ set(ours.items()))[:3]
            self.ctx.log.warning("not resuming the checkpoint of step %d written under key %s: its parameters differ "
                                 "from this run's (%s)", record["step"], record["from_key"], differ)
            remove_tree(step_dir)
            adopted.unlink()


def _shapes(plan: dict) -> dict[str, tuple]:
    return {name: tuple(p["shape"]) for name, p in plan.get("parameters", {}).items()}


def adopt(cfg, earlier: Path, scratch: Optional[Path] = None, from_key: str = "") -> Optional[int]:
    """The train stage's answer to "may this run continue an interrupted attempt made under another key?" (same
    model, data, optimizer, precision, seed and steps; other code or layout): the step of that attempt's newest
    complete checkpoint (None: none, or train.resume=false). With `scratch`, that checkpoint is linked into this
    attempt's checkpoints (hard links: no copy; DCP reshards it into this layout when loaded) with the metrics up
    to it, and recorded in adopted.json."""
    if not cfg.train.resume:
        return None
    # looking (the plan): checksums, so that the plan's note holds; linking: sizes (the restore verifies checksums)
    found = ckpt.latest(earlier / "checkpoints", checksums=scratch is None)
    if found is None or found[1] is None:
        return None
    step, path, _ = found
    if scratch is not None:
        # a crash mid-linking leaves a folder that sweep_partials removes
        partial = scratch / "checkpoints" / f".step_{step:07d}.adopting.partial"
        remove_tree(partial)
        link_tree(path, partial)
        partial.rename(ckpt.step_dir(scratch / "checkpoints", step))
        if (earlier / "metrics.jsonl").is_file():  # the steps before it (the run truncates to its step)
            (scratch / "metrics.jsonl").write_bytes((earlier / "metrics.jsonl").read_bytes())
        atomic_write_json(scratch / ADOPTED, {"step": step, "from": str(path), "from_key": from_key})
    return step


class Resumes(str):
    """progress_hint's words, and the step the train stage starts from (`step`: what the plan's times count from)."""

    def __new__(cls, text: str, step: int):
        said = super().__new__(cls, text)
        said.step = step
        return said


def progress_hint(scratch: Path) -> Optional[Resumes]:
    """What the train stage will do with this key's checkpoints (the same verification it runs)."""
    found = ckpt.latest(scratch / "checkpoints")
    if found is None:
        return None
    step, path, damaged = found
    if path is None:
        return Resumes(f"restarts from step 0: its {len(damaged)} checkpoint(s) are damaged", 0)
    return Resumes(f"resumes from step {step}" + (f", {len(damaged)} damaged checkpoint(s) set aside" if damaged
                                                  else ""), step)


def pacing_advice(step_before: int, began: float, step: int, asked: float, done: float,
                  tolerated: float = 0.1, floor_s: float = 0.5) -> Optional[str]:
    """When a background save (of step_before, begun at `began`) was still being written when the next (of `step`,
    asked for at `asked`) came, and training waited for it (until `done`) more than `tolerated` of the steps' time
    and more than floor_s: what a write takes here against the steps between saves, and the train.checkpoint_every
    that keeps writes out of the steps' way; else None."""
    waited, steps_s = done - asked, asked - began
    if waited <= max(tolerated * steps_s, floor_s) or step <= step_before:
        return None
    per_step, write = steps_s / (step - step_before), done - began
    return (f"the checkpoint of step {step} waited {waited:.1f} s for step {step_before}'s, still being written: a "
            f"save takes about {write:.1f} s here and the {step - step_before} steps between saves {steps_s:.1f} s, so "
            f"training waits at every save; "
            f"train.checkpoint_every={math.ceil(write / per_step)} or more keeps the writes out of the steps' way")


def load_reference(layout, cfg, vocab_rows: int) -> str:
    """The reference model of a preference objective into a layout built without adapters: train.init_from's
    weights (a Hugging Face folder's, or a checkpoint's model state), with peft=lora the base its adapters apply to
    (the adapters off), else the layout's own initialisation (train.seed's, as train's step 0). Returns what it
    loaded, for the log."""
    base = adapters.reference_of(cfg)
    parts = [(part, None) for part in layout.parts]
    if hf.folder_of(base):
        ckpt.load_full_weights(parts, hf.load_state(hf.folder_of(base), vocab_rows), layout.aliases)
        return f"the Hugging Face weights in {hf.folder_of(base)}"
    if base:
        ckpt.load(Path(base), parts, layout.aliases)
        return f"the weights of the checkpoint {base}"
    return f"the initialisation of train.seed={cfg.train.seed}"
