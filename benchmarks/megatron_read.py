"""What a Megatron corpus saves: the same text tokenized by the tokenize stage's code (data=text, one task, a
byte-level BPE as tokenizer.json), against its tokens as a Megatron indexed dataset read by data=megatron (the
index, the .bin's largest id, the index.json that points at it), then the first training batch from each.

    python benchmarks/megatron_read.py [mb=1024] [folder=/tmp/megatron_read]

The text is generated (lines of words, a document every 40 lines) and kept in `folder` between runs; the .bin is
written from the data=text shards' tokens, so both sides hold the same documents.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.support.cli import arguments  # noqa: E402

from orchestrator.config.compose import compose_config  # noqa: E402
from plugins.data import build_batcher, shards  # noqa: E402
from plugins.data.corpus import TOKENS_DIR, tokenize_into  # noqa: E402
from plugins.data.indexed_dataset import write_index  # noqa: E402

WORDS = "the of and to in is was for on that with as by at from his her an it were which are this be".split()


def corpus(folder: Path, mb: int) -> Path:
    text = folder / f"corpus_{mb}mb"
    if text.is_dir():
        return text
    text.mkdir(parents=True)
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(WORDS, 12)) + "\n" for _ in range(4000)]
    block = "".join(lines[i] + ("\n" if i % 40 == 39 else "") for i in range(len(lines))).encode()
    for i in range(0, mb << 20, 64 << 20):
        with open(text / f"part{i >> 26:04d}.txt", "wb") as f:
            f.write(block * ((min(64 << 20, (mb << 20) - i)) // len(block)))
    return text


def tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = folder / "tokenizer"
    if (out / "tokenizer.json").is_file():
        return out
    out.mkdir(parents=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([" ".join(WORDS)] * 100, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return out


def first_batch(cfg, out: Path) -> float:
    t0 = time.perf_counter()
    build_batcher(cfg, out / TOKENS_DIR).train_batch(0)
    return time.perf_counter() - t0


def main(argv: list[str]) -> int:
    args = arguments(argv, __doc__)
    mb, folder = int(args.get("mb", 1024)), Path(args.get("folder", "/tmp/megatron_read"))
    text, tok = corpus(folder, mb), tokenizer(folder)
    common = [f"data.tokenizer=hf:{tok}", "model.vocab_size=640", "cluster=debug"]
    cfg = compose_config("data=text", f"data.paths=[{text}]", "data.max_bytes=0", *common)
    t0 = time.perf_counter()
    index = tokenize_into(cfg, folder / "text_out")
    tokenized = time.perf_counter() - t0
    text_batch = first_batch(cfg, folder / "text_out")
    train = shards.read(folder / "text_out" / TOKENS_DIR, packed=False)
    prefix = folder / "corpus_text_document"
    with open(f"{prefix}.bin", "wb") as f:  # the same documents, as Megatron's preprocess_data.py writes them
        for split in (train.train, train.val):
            for doc in split:
                f.write(np.asarray(doc, dtype=np.uint16).tobytes())
    write_index(str(prefix), np.uint16, [len(d) for d in train.train] + [len(d) for d in train.val])
    mcfg = compose_config("data=megatron", f"data.paths=[{prefix}]", *common)
    t0 = time.perf_counter()
    mindex = tokenize_into(mcfg, folder / "megatron_out")
    read = time.perf_counter() - t0
    megatron_batch = first_batch(mcfg, folder / "megatron_out")
    tokens = index["train"]["tokens"] + index["val"]["tokens"]
    assert tokens == mindex["train"]["tokens"] + mindex["val"]["tokens"]
    print(f"{mb:,} MB of text, {tokens:,} tokens ({Path(f'{prefix}.bin').stat().st_size / 2**30:.2f} GB .bin)")
    print(f"{'':24} {'tokenize':>10} {'first batch':>12}")
    print(f"{'data=text (1 task)':24} {tokenized:>9.1f}s {text_batch * 1e3:>10.1f}ms")
    print(f"{'data=megatron':24} {read:>9.2f}s {megatron_batch * 1e3:>10.1f}ms")
    print(f"ratio: {tokenized / read:,.0f}x less time before the first step")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
