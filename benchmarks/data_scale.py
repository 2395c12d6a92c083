"""The tokenize stage at corpus scale, side by side in one run:

for each generated corpus (JSON Lines and Parquet, `sizes` in GB, documents cut from the standard library's text)
and each tokenizer (`bytes`, a BPE of `vocab` tokens):
  - the stage as the orchestrator runs it (`orchestrate(...)` until tokenize, `data.tasks=1` and `=2`): the BPE's
    learning (its own process, on every core) and the encoding timed apart, tokens/s of the encoding (the slowest
    task's) and the peak RSS of every tokenize process (each part records its own);
  - `tokenizers`' own `encode_batch` called directly on the same texts and cores (the limit; BPE only: the bytes
    tokenizer is a NumPy view of the bytes);
  - the data checks and fingerprint of the untouched corpus, as a second dry run pays them.

    python benchmarks/data_scale.py [sizes=0.25,0.5,1,2,4] [formats=jsonl,parquet] [tokenizers=bytes,bpe]
                                    [vocab=8192] [folder=/tmp/data_scale] [tasks=1,2]

tasks: a list of task counts; `1t1` is one task whose tokenizer uses one thread (the unit two tasks are 2x of:
one task alone already encodes on every core through the tokenizers library's threads).

Targets (docs/models-and-data.md): peak RSS flat in corpus size (the largest within 1.2x the smallest, under
2 GB); tokens/s >= 0.9x the direct call; 2 tasks >= 1.7x 1 task; checks and fingerprint < 1 s.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.support.cli import arguments  # noqa: E402

from orchestrator.run import orchestrate  # noqa: E402
from plugins.data import data_fingerprint, get_source  # noqa: E402
from plugins.data.corpus import ENCODE_BYTES, corpus_layout, task_documents  # noqa: E402
from plugins.data.tokenizer import load_saved  # noqa: E402
from runtime.threads import usable_cores  # noqa: E402
from orchestrator.config.compose import compose_config  # noqa: E402

GB = 1e9


FILE_BYTES = 250_000_000  # of text per generated file; a corpus of S GB is the first S / 0.25 of them (hard links)


def make_corpus(folder: Path, size_gb: float, fmt: str) -> Path:
    """Files of 0.25 GB of text each (documents of 2-20 KB cut from the standard library's source), deterministic
    and made once; the corpus of size_gb is a folder of hard links to the first of them."""
    files = folder / f"{fmt}-files"
    files.mkdir(parents=True, exist_ok=True)
    count = max(1, round(size_gb * GB / FILE_BYTES))
    import sysconfig

    pool = None
    for n in range(count):
        path = files / f"part{n:04d}.{fmt}"
        if path.exists():
            continue
        if pool is None:
            texts = [p.read_text(errors="replace") for p in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))]
            pool = "\n".join(texts)
        rng = random.Random(n)
        docs, text_bytes = [], 0
        while text_bytes < FILE_BYTES:
            start, length = rng.randrange(len(pool) - 20_000), rng.randrange(2_000, 20_000)
            docs.append(pool[start:start + length])
            text_bytes += len(docs[-1].encode())
        partial = path.with_suffix(".partial")
        if fmt == "jsonl":
            with open(partial, "w") as f:
                for d in docs:
                    f.write(json.dumps({"text": d}) + "\n")
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"text": docs}), partial, row_group_size=1000)
        partial.rename(path)
    out = folder / f"{fmt}-{size_gb:g}GB"
    out.mkdir(exist_ok=True)
    for n in range(count):
        link = out / f"part{n:04d}.{fmt}"
        if not link.exists():
            os.link(files / link.name, link)
    return out


def run_stage(corpus: Path, args: list[str], tasks: int, work: Path, threads: Optional[int] = None) -> dict:
    """The tokenize stage as a user runs it (a fresh cache each time), and what its parts recorded. threads: the
    tokenizers library's threads per task (default: the cores shared out between the tasks)."""
    if threads:
        os.environ["RAYON_NUM_THREADS"] = str(threads)
    cache = work / f"cache-{corpus.name}-{tasks}-{'-'.join(a.split('=')[1] for a in args)}"
    shutil.rmtree(cache, ignore_errors=True)
    overrides = ["data=text", f"data.paths=[{corpus}]", "data.max_bytes=0", f"data.tasks={tasks}", "tracking=none",
                 f"cache_dir={cache}", *args]
    try:
        report = orchestrate(compose_config(*overrides, runs_dir=work / "runs"),
                             work / "runs" / f"run-{time.time_ns()}", overrides, until="tokenize")
    finally:
        os.environ.pop("RAYON_NUM_THREADS", None)
    assert report.results["tokenize"].status == "ran", report.results["tokenize"]
    seconds = report.results["tokenize"].seconds  # the stage, as its table shows it (not the plan before it)
    (entry,) = [p for p in (cache / "tokenize").iterdir() if not p.name.endswith(".work") and p.is_dir()]
    index = json.loads((entry / "tokens" / "index.json").read_text())
    parts = [json.loads((entry / "tokens" / p / "part.json").read_text()) for p in index["parts"]]
    tokens = index["train"]["tokens"] + index["val"]["tokens"]
    encode = max(p["seconds"] for p in parts)  # the slowest task's reading and encoding (after the tokenizer is made)
    learned = json.loads((entry / "bpe_learned.json").read_text()) if (entry / "bpe_learned.json").exists() else None
    return {"seconds": seconds, "tokens": tokens, "encode_s": encode, "tokens_per_s": tokens / encode, "entry": entry,
            "peak_rss": [p["peak_rss"] for p in parts], "learned": learned}


def direct_rate(corpus: Path, entry: Path, args: list[str]) -> float:
    """`tokenizers`' encode_batch on the same texts, read in ENCODE_BYTES batches beforehand, only the calls
    timed: tokens/s on every core of this machine."""
    cfg = compose_config("data=text", f"data.paths=[{corpus}]", "data.max_bytes=0", *args)
    backend = load_saved(entry / "tokenizer").backend
    lay = corpus_layout(cfg)
    seconds = tokens = 0
    batch, held = [], 0

    def encode():
        nonlocal seconds, tokens
        t0 = time.perf_counter()
        tokens += sum(len(e.ids) for e in backend.encode_batch(batch, add_special_tokens=False))
        seconds += time.perf_counter() - t0

    for _, texts, _, _ in task_documents(cfg, lay, 0, 1):
        batch.extend(text.decode("utf-8", errors="replace") for text in texts)
        held += sum(len(text) for text in texts)
        if held >= ENCODE_BYTES:
            encode()
            batch, held = [], 0
    if batch:
        encode()
    return tokens / seconds


def checks_and_fingerprint(corpus: Path, cache: Path) -> float:
    """A second plan's data work on the untouched corpus: the source's checks and the fingerprint."""
    cfg = compose_config("data=text", f"data.paths=[{corpus}]", "data.max_bytes=0", f"cache_dir={cache}")
    source = get_source("text")
    data_fingerprint(cfg)  # the first plan hashes what it has not seen (stamps remembered)
    time.sleep(2.1)        # past the racy window: the stamps of files just written are remembered from now on
    data_fingerprint(cfg)
    t0 = time.perf_counter()
    source.check(cfg)
    data_fingerprint(cfg)
    return time.perf_counter() - t0


def main() -> None:
    a = {"sizes": "0.25,0.5,1,2,4", "formats": "jsonl,parquet", "tokenizers": "bytes,bpe", "vocab": 8192,
         "folder": "/tmp/data_scale", "tasks": "1,2", **arguments(sys.argv[1:], __doc__)}
    folder = Path(a["folder"])
    work = folder / "work"
    print(f"# {usable_cores()} usable cores; ENCODE_BYTES {ENCODE_BYTES >> 20} MiB", flush=True)
    print("| corpus | tokenizer | tasks | tokens | stage s | BPE learned in s (peak GB) | encoding s | tokens/s "
          "encoding | vs direct | vs 1 task | peak RSS per task (GB) | checks+fp s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    for size in [float(s) for s in str(a["sizes"]).split(",")]:
        for fmt in str(a["formats"]).split(","):
            corpus = make_corpus(folder, size, fmt)
            checks = None
            for tok in str(a["tokenizers"]).split(","):
                args = [f"data.tokenizer={tok}"] + ([f"data.vocab_size={a['vocab']}", f"model.vocab_size={a['vocab']}"]
                                                    if tok == "bpe" else [])
                direct = one = None
                for spec in str(a["tasks"]).split(","):  # N tasks, or NtM: N tasks of M tokenizer threads
                    tasks, _, threads = spec.partition("t")
                    tasks = int(tasks)
                    r = run_stage(corpus, args, tasks, work, int(threads) if threads else None)
                    if tok == "bpe" and direct is None:
                        direct = direct_rate(corpus, r["entry"], args)
                    if checks is None:
                        checks = checks_and_fingerprint(corpus, r["entry"].parent.parent)
                    one = one or r["tokens_per_s"]
                    ratio = f"{r['tokens_per_s'] / direct:.2f}x" if direct else "-"
                    rss = ", ".join(f"{x / 2**30:.2f}" for x in r["peak_rss"])
                    learned = r["learned"]
                    learn = f"{learned['seconds']:.1f} ({learned['peak_rss'] / 2**30:.2f})" if learned else "-"
                    print(f"| {fmt} {size:g} GB | {tok} | {spec} | {r['tokens']:,} | {r['seconds']:.1f} | {learn} | "
                          f"{r['encode_s']:.1f} | {r['tokens_per_s']:,.0f} | {ratio} | "
                          f"{r['tokens_per_s'] / one:.2f}x | "
                          f"{rss} | {checks:.3f} |", flush=True)


if __name__ == "__main__":
    main()
