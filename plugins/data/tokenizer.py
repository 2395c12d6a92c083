"""Byte-level tokenizer: one token per byte (0..255), then <eos> and <pad>. Lossless for any text."""
from __future__ import annotations

import numpy as np

EOS = 256
PAD = 257
VOCAB_SIZE = 258


def encode(text: bytes) -> np.ndarray:
    return np.frombuffer(text, dtype=np.uint8).astype(np.int64)


def encode_documents(docs: list[bytes]) -> list[np.ndarray]:
    """Each document's bytes followed by <eos>."""
    return [np.append(encode(d), EOS) for d in docs]


def decode(tokens) -> bytes:
    return bytes(int(t) for t in tokens if int(t) < 256)
