"""What preference tuning's head costs: the label-sparse head's per-row log-probabilities (a DPO step's input: its
backward computes each chunk's logits again) against the SFT loss through the same head (its gradients computed in
the forward), forward and backward over the same labelled positions, alternating in one process (and the process's
peak memory).

    python benchmarks/preference.py [rows=8] [seq_len=512] [learned=0.5] [d_model=768] [vocab=50257] [chunk=1024]
                                    [rounds=5] [threads=0]

The sizes default to gpt2_124m's head and a batch of 8 rows (4 pairs) whose completions are half of each row.
threads=0 keeps torch's own count.
"""
from __future__ import annotations

import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.support.cli import arguments  # noqa: E402


def main(argv: list[str]) -> None:
    import torch

    from plugins.models.head_loss import IGNORED, head_loss, row_logprobs
    from plugins.objectives.dpo import pair_losses

    a = arguments(argv, __doc__)
    rows, seq_len, d, vocab = int(a.get("rows", 8)), int(a.get("seq_len", 512)), int(a.get("d_model", 768)), \
        int(a.get("vocab", 50257))
    chunk, rounds, learned = int(a.get("chunk", 1024)), int(a.get("rounds", 5)), float(a.get("learned", 0.5))
    if int(a.get("threads", 0)):
        torch.set_num_threads(int(a["threads"]))
    if rows % 2:
        sys.exit(f"error: rows={rows}: preference pairs take an even number of rows (chosen, rejected)")
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, seq_len, d, generator=g, requires_grad=True)
    weight = (torch.randn(vocab, d, generator=g) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (rows, seq_len), generator=g)
    labels[:, :int(seq_len * (1 - learned))] = IGNORED  # the prompt: not learned
    reference = -torch.rand(rows, generator=g, dtype=torch.float64) * 100

    def sft() -> None:
        head_loss(hidden, weight, labels, vocab, chunk).backward()

    def dpo() -> None:
        loss, _ = pair_losses(row_logprobs(hidden, weight, labels, vocab, chunk), reference, 0.1, "sigmoid")
        loss.backward()

    times: dict[str, list[float]] = {"sft": [], "dpo": []}
    for _ in range(rounds + 1):  # the first round warms up
        for name, step in (("sft", sft), ("dpo", dpo)):
            hidden.grad = weight.grad = None
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    positions = int((labels != IGNORED).sum())
    sft_s, dpo_s = (statistics.median(times[k][1:]) for k in ("sft", "dpo"))
    print(f"head {vocab} x {d}, {rows} rows x {seq_len}, {positions:,} labelled positions, chunk {chunk}, "
          f"{torch.get_num_threads()} thread(s), median of {rounds}")
    print(f"  sft loss (gradients in the forward)       {sft_s * 1e3:8.1f} ms")
    print(f"  dpo per-row log-probs (backward recomputes) {dpo_s * 1e3:6.1f} ms   {dpo_s / sft_s:.2f}x the sft head")
    print(f"  peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:,.0f} MB "
          f"(weights and their gradient {2 * vocab * d * 4 / 2**20:,.0f} MB)")


if __name__ == "__main__":
    main(sys.argv[1:])
