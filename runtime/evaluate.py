"""Held-out loss: the same batches every time, so two evaluations of the same weights agree exactly; each held-out
example scored once (the batcher's eval_batches: as many batches as the split fills, at most train.eval_batches)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import nn


def eval_loss(layout, batcher, n_batches: int, stop: Callable[[], Optional[str]] = lambda: None,
              measures: Optional[dict] = None) -> Optional[float]:
    """Mean next-token loss over the held-out batches, at most n_batches (an objective of rows: its mean loss over
    what it counts, a preference objective's pairs), computed in the layout (every rank calls it: the sums are
    reduced over ranks). The aggregate's check of a model too big to hold is eval_loss_by_piece. stop: asked before
    each batch (by every rank, a collective when several run); when it says why, the evaluation is abandoned and
    None returned, so that a signal is acted on within a batch, not after the whole evaluation. measures: filled
    with the objective's own means (held-out rewards and accuracies), where it has them."""
    layout.train(False)
    total, count = torch.zeros((), dtype=torch.float64), 0
    objective = layout.runner.objective
    try:
        for i in range(batcher.eval_batches(n_batches)):
            if stop():
                return None
            batch = batcher.eval_batch(i)
            count += objective.count(batch, policy_scores(layout)) if objective is not None else batch.n_labels
            #        (first: it may keep totals, or score rows besides the batch's)
            total += layout.runner.eval_sum(layout.local_batch(batch.inputs), layout.local_batch(batch.labels),
                                            layout.local_batch(batch.documents),
                                            layout.local_batch(batch.row_inputs)).cpu()
    finally:
        layout.train(True)
        found = layout.objective_metrics(max(count, 1))  # taken when stopped too: the next step's are its own
    if found is not None and measures is not None:
        measures.update(found[0](layout.reduce(found[1].cpu().double()).tolist()))
    return layout.reduce(total).item() / max(count, 1)


HIDDEN_BYTES = 2**30  # the eval batches' hidden states held at once by the piece-by-piece evaluation (a batch at least)
LOGITS_BYTES = 2**28  # the logits (and their log-softmax) of the tokens its head scores at once


def piece_budgets(d_model: int, vocab_rows: int) -> tuple[int, int]:
    """(tokens_per_chunk, tokens_per_head) of eval_loss_by_piece for a model of this width and vocabulary."""
    return HIDDEN_BYTES // (4 * d_model), max(1, LOGITS_BYTES // (8 * vocab_rows))


@dataclass
class Stream:
    """Inputs a piece-by-piece forward carries through the parts: under their own autocast, and with a `head`
    (i, last part, its input i) that applies the last part itself (a few tokens at a time) instead of keeping its
    outputs. documents: each input's (Batch.documents), or None."""
    inputs: list[torch.Tensor]
    autocast: Callable = contextlib.nullcontext
    head: Optional[Callable[[int, nn.Module, torch.Tensor], None]] = None
    documents: Optional[list] = None


@torch.no_grad()
def forward_streams(pieces: Iterable[Callable[[], nn.Module]], streams: list[Stream]) -> list[list[torch.Tensor]]:
    """A model's outputs for several streams of inputs, computed one part at a time: `pieces` make its parts in
    order (the embedding, each block, the head), each with its weights, and each is dropped before the next is made,
    once for all the streams. The same operations in the same order as the whole model's forward, so the same
    numbers, with one part's weights and the inputs' hidden states in memory."""
    makers = list(pieces)
    hidden = [list(s.inputs) for s in streams]
    for i, make in enumerate(makers):
        piece = make().eval()
        for k, s in enumerate(streams):
            with s.autocast():
                if s.head is not None and i == len(makers) - 1:
                    for j, h in enumerate(hidden[k]):
                        s.head(j, piece, h)
                    hidden[k] = []
                else:
                    documents = s.documents or [None] * len(hidden[k])
                    hidden[k] = [piece(h) if d is None else piece(h, documents=d)
                                 for h, d in zip(hidden[k], documents)]
        del piece
    return hidden


def eval_loss_by_piece(pieces: Iterable[Callable[[], nn.Module]], loss_fn, batcher, n_batches: int,
                       autocast=contextlib.nullcontext, tokens_per_chunk: int = 2**16,
                       tokens_per_head: int = 2**12, beside: Optional[list[torch.Tensor]] = None
                       ) -> tuple[float, list[torch.Tensor]]:
    """eval_loss's number for a model too big to hold (forward_streams), the batches' hidden states in chunks of
    at most tokens_per_chunk tokens (at least one batch; over several chunks the parts are made again for each), and
    the head's logits for at most tokens_per_head tokens at a time (the head is position-wise: its logits do not
    depend on how the tokens are grouped, and the summed loss adds up over groups). beside: inputs whose outputs
    (in fp32, without autocast) are made in the first chunk's pass: the aggregate's ONNX check's reference, made
    while the parts are made for the eval anyway. Returns (the loss, those outputs)."""
    batches = [batcher.eval_batch(i) for i in range(batcher.eval_batches(n_batches))]
    makers = list(pieces)
    total, count, outputs = 0.0, 0, []
    for n, chunk in enumerate(_chunks(batches, tokens_per_chunk)):
        def loss(j: int, head: nn.Module, h: torch.Tensor, chunk=chunk) -> None:
            nonlocal total, count
            flat, labels = h.reshape(1, -1, h.shape[-1]), chunk[j].labels.reshape(1, -1)
            for t in range(0, flat.shape[1], tokens_per_head):
                total += loss_fn(head(flat[:, t:t + tokens_per_head]), labels[:, t:t + tokens_per_head]).item()
            count += chunk[j].n_labels

        streams = [Stream([b.inputs for b in chunk], autocast, loss, [b.documents for b in chunk])]
        if beside and n == 0:
            streams.append(Stream(list(beside)))
        done = forward_streams(makers, streams)
        if beside and n == 0:
            outputs = done[1]
    return total / max(count, 1), outputs


def _chunks(batches: list, tokens: int) -> list[list]:
    """Consecutive batches grouped to at most `tokens` tokens a group (a larger batch alone)."""
    chunks: list[list] = [[]]
    used = 0
    for b in batches:
        if chunks[-1] and used + b.inputs.numel() > tokens:
            chunks.append([])
            used = 0
        chunks[-1].append(b)
        used += b.inputs.numel()
    return chunks


class RowRecorder:
    """An objective that records rows instead of a loss: no loss (zero), each row's summed log-probability and its
    learned tokens kept, in the order the runner computes its microbatches (the reference pass, stages/reference.py;
    the train step's online reference; rows an objective scores besides its batch; the held-out next-token pass of
    a rows objective). A pipeline's first-step shape inference does not happen in a forward-only pass."""

    names = ()

    def __init__(self):
        self.rows: list = []

    def __call__(self, rows: torch.Tensor, row_inputs=None) -> torch.Tensor:
        self.rows.append(rows.detach().double().cpu())
        return rows[:, 0].sum() * 0

    def keep_last(self, calls: int) -> None:
        del self.rows[:-calls]

    def take(self) -> torch.Tensor:
        """(rows, 2): the rows' log-probabilities and learned tokens since the last take (none where this rank holds
        no head)."""
        rows, self.rows = self.rows, []
        return torch.cat(rows) if rows else torch.zeros((0, 2), dtype=torch.float64)


@torch.no_grad()
def row_sums(layout, batch, width_multiple: int = 0) -> torch.Tensor:
    """(rows, 2) float64, the same on every rank: each row's summed log-probability of its learned tokens under the
    layout's model, and their count: a forward of the rank's rows through its runner, whose objective keeps them
    (RowRecorder: the reference model's log-probabilities of each row); the ranks
    that hold a head and count the loss (one a data-parallel replica) place theirs at their replica's rows, and a sum
    over ranks gathers them. width_multiple (the step's repack_to; 0: rows keep their shape): the rank's rows cut
    after their longest real run, as the train step cuts them (Layout.rank_inputs)."""
    inputs, labels, _, _ = layout.rank_inputs(batch, width_multiple, rows_kept=True)
    training = any(part.training for part in layout.parts)
    layout.train(False)
    try:
        layout.runner.eval_sum(inputs, labels)
    finally:
        layout.train(training)
    mine = layout.runner.objective.take()
    gathered = torch.zeros((batch.inputs.shape[0], 2), dtype=torch.float64)
    if layout.loss_rank and len(mine):
        at = layout.coords.dp * len(mine)
        gathered[at:at + len(mine)] = mine
    return layout.reduce(gathered)


def row_logps(layout, batch, width_multiple: int = 0) -> torch.Tensor:
    """(rows,) float64: each row's summed log-probability (row_sums')."""
    return row_sums(layout, batch, width_multiple)[:, 0]


def policy_scores(layout, width_multiple: int = 0) -> Callable:
    """rows (a Batch) -> (rows,) float64, each row's summed log-probability under the layout's own weights, no
    gradient, the same on every rank (an objective's count scoring rows besides its batch: KTO's mismatched rows;
    computed without dropout)."""
    def score(rows) -> torch.Tensor:
        with objective_set(layout, RowRecorder()):
            return row_logps(layout, rows, width_multiple)
    return score


@contextlib.contextmanager
def objective_set(layout, objective) -> Iterator[None]:
    """The layout's runner computes `objective` inside the block (a preference layout's rows recorded instead of its
    loss: ReferenceRows), its own after it."""
    runner = layout.runner
    kept, runner.objective = runner.objective, objective
    try:
        yield
    finally:
        runner.objective = kept


def held_out_nll(layout, batcher, n_batches: int, rows_objective, width_multiple: int = 0) -> float:
    """The next-token loss of the held-out batches' learned tokens (at most n_batches), for a layout built for a
    preference objective (its runner's objective set to `rows_objective`, ReferenceRows, for the pass): what the
    aggregate stage's check of the whole model computes of the same batches."""
    with objective_set(layout, rows_objective):
        sums = sum(row_sums(layout, batcher.eval_batch(i, with_inputs=False), width_multiple).sum(0)
                   for i in range(batcher.eval_batches(n_batches)))
    return float(-sums[0] / max(float(sums[1]), 1.0))
