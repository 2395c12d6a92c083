"""Epochs: which example a training row draws, without replacement, as a pure function of (seed, row).

The training split's examples (its records, its preference pairs, its rows of whole documents, or its packed stream's
windows of train.seq_len tokens) are drawn in epochs: epoch e is a permutation of them seeded by (seed, e), and the
g-th row drawn since the start (step * batch + its row) takes position g mod n of epoch g // n. Every example is
drawn once an epoch, none twice, and a batch is still a function of (seed, step) alone: any layout, any resume, any
data-parallel rank computes the same rows with no loader state to save (Megatron's GPTDataset shuffles its samples
per epoch the same way, but writes the permutation to disk).

The permutation is never held: a Feistel network over the next power of four above n, walked until it lands below n
(cycle walking keeps it a bijection of [0, n)), gives any position's example in a few integer operations, so an
epoch of a billion windows costs what an epoch of ten does.
"""
from __future__ import annotations

import numpy as np

ROUNDS = 6  # Feistel rounds: 4 make a pseudo-random permutation (Luby-Rackoff); 6 mix small domains well too
_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _round(half: np.ndarray, key: np.uint64) -> np.ndarray:
    """splitmix64's finaliser of (half + key): every bit of the output depends on every bit of the input."""
    with np.errstate(over="ignore"):
        z = (half + key) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def permuted(positions: np.ndarray, n: int, seed: int, epoch: int, stream: int = 0) -> np.ndarray:
    """The examples (0..n-1) at `positions` (0..n-1) of epoch `epoch`'s permutation of n examples; `stream` tells
    apart orders that must not be the same one (the held-out split's)."""
    positions = np.asarray(positions, dtype=np.uint64)
    if n <= 1:
        return np.zeros(positions.shape, dtype=np.int64)
    bits = -(-max(int(n - 1).bit_length(), 2) // 2)  # each half's bits: the domain 4**bits >= n
    mask = np.uint64((1 << bits) - 1)
    keys = [np.uint64(k) for k in np.random.default_rng((seed, stream, epoch)).integers(0, 2**63, size=ROUNDS)]
    out = positions.copy()
    todo = np.ones(out.shape, dtype=bool)
    while todo.any():
        x = out[todo]
        left, right = x >> np.uint64(bits), x & mask
        for key in keys:
            left, right = right, left ^ (_round(right, key) & mask)
        out[todo] = (left << np.uint64(bits)) | right
        todo = out >= np.uint64(n)
    return out.astype(np.int64)


def drawn(rows: np.ndarray, n: int, seed: int, stream: int = 0) -> np.ndarray:
    """The examples that `rows` (their numbers among all rows drawn since the start) take: each row's epoch
    (row // n) and its position in it (row % n)."""
    rows = np.asarray(rows, dtype=np.int64)
    epochs, at = rows // n, rows % n
    out = np.empty(rows.shape, dtype=np.int64)
    for epoch in np.unique(epochs).tolist():
        here = epochs == epoch
        out[here] = permuted(at[here], n, seed, epoch, stream)
    return out
