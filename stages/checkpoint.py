"""checkpoint: the trained state as a verified, self-describing sharded (DCP) checkpoint.

The train stage's ranks write the shards (only they hold the state); this stage checks every file against
the manifest (sizes and sha256), and publishes the checkpoint as its own artifact: the folder any layout
can load (`parallel=...` may differ) and the input of aggregation.
"""
from __future__ import annotations

from storage import checkpoint as ckpt
from storage.fsio import link_tree
from stages.base import Stage, StageContext


def checkpoint(ctx: StageContext) -> None:
    source = ctx.inputs["train"] / "checkpoint"
    problems = ckpt.verify(source, checksums=False)  # the manifest is there and every file has its size
    if problems:
        raise RuntimeError(f"the train stage's checkpoint {source} is damaged: " + "; ".join(problems))
    link_tree(source, ctx.out)
    # one pass over the bytes: the checkpoint (hard links, or copies across filesystems) checked against its
    # manifest, those hashes the cache entry's table (ctx.hashes)
    problems = ckpt.verify(ctx.out, checksums=True, digest=ctx.hashes.sha256)
    if problems:
        raise RuntimeError(f"the train stage's checkpoint {source} is damaged (checked as linked or copied to "
                           f"{ctx.out}): " + "; ".join(problems))
    manifest = ckpt.read_manifest(ctx.out)
    summary = {"step": manifest["step"], "trainer": manifest["trainer"],
               "files": len(manifest["files"]), "bytes": sum(f["bytes"] for f in manifest["files"].values())}
    ctx.tracker.log_params({"checkpoint.step": summary["step"]})
    ctx.tracker.log_metrics({"checkpoint_bytes": summary["bytes"], "checkpoint_files": summary["files"]})
    ctx.tracker.log_artifact(ctx.out / ckpt.MANIFEST)
    ctx.log.info("checkpoint of step %d verified: %d files, %.1f MB", summary["step"], summary["files"],
                 summary["bytes"] / 1e6)


def _summary(out) -> str:
    m = ckpt.read_manifest(out)
    return f"step {m['step']}, {len(m['files'])} files, {sum(f['bytes'] for f in m['files'].values()) / 1e6:.1f} MB"


STAGE = Stage(
    name="checkpoint",
    run=checkpoint,
    after=("train",),
    summary=_summary,
)
