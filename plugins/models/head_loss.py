"""Label sparsity: the vocabulary head and the cross-entropy only where a label enters the loss.

In a prompt/completion or chat batch most labels are -100, and projecting those positions onto the whole vocabulary
(in fp32, the step's largest activation) serves nothing (ONNX Runtime's label sparsity; TRL's chunked NLL). Here the
final hidden states of the labelled positions are gathered first, then the head and the cross-entropy run over them
`chunk` positions at a time. Each chunk's softmax gives the gradients of its positions at once (softmax minus the
one-hot target, times the head: Liger's fused linear cross-entropy), so no full-vocabulary logits outlive their
chunk, in the forward or in the backward, and nothing is recomputed: the backward only scales the gradients the
forward kept (the gathered positions' hidden-state gradient and one head-sized fp32 buffer).

Under tensor parallelism the head is vocabulary-sharded (a DTensor split by rows) and every rank holds the same
positions: each computes its columns' logits, and the softmax's max, sum and the target logit are all-reduced over
hp (Megatron's vocab-parallel cross-entropy), the hidden states' gradient summed over hp. The sum is the dense
path's to fp32 rounding (tests/test_head_loss.py), in every layout: the head runs inside the model's forward, so
FSDP's gathered weights and a pipeline's last stage see it as any other layer.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

IGNORED = -100  # the label of a position outside the loss (PyTorch's and Hugging Face's ignore_index)


def head_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab: int,
              chunk: int, count: Optional[int] = None) -> torch.Tensor:
    """Summed next-token cross-entropy of the positions whose label is not IGNORED, as the dense
    cross_entropy(hidden @ weight.T [:, :vocab], labels, reduction="sum") gives it. hidden (..., d): the final
    norm's output (a DTensor under sequence parallelism: gathered whole); weight (rows, d): the head, rows >= vocab
    (Megatron's padding) never count; labels (...). count: how many labels are not IGNORED, where the host knows it
    (the train step counts them before the batch goes to the device): the positions are then found without the
    device telling their number, so on a GPU nothing here waits for it (a wait in the forward leaves the GPU idle
    while the host queues the whole backward and the optimizer step: 0.64x the hand loop's tokens/s on an H200).
    Without it (evaluation, pipeline stages) `nonzero` asks the device once."""
    h, y, weight, first, group = _labelled(hidden, weight, labels, _kept(labels, count))
    grads = torch.is_grad_enabled()
    return _ChunkedHeadLoss.apply(h, weight, y, vocab, first, max(1, chunk), group,
                                  grads and h.requires_grad, grads and weight.requires_grad)


def row_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab: int,
                 chunk: int) -> torch.Tensor:
    """Each row's summed log-probability of its labels that are not IGNORED, and their count: (rows, 2), column 0
    differentiable (what a preference objective compares: plugins/objectives). The same gathered positions and
    chunked head as head_loss; the gradient of a row's sum depends on the whole batch's sums (the objective's
    weight of each pair), so it cannot be folded into the forward as head_loss's is: the backward computes each
    chunk's logits again (one more head matmul) rather than keep them."""
    keep = _kept(labels, None)
    h, y, weight, first, group = _labelled(hidden, weight, labels, keep)
    token = _ChunkedHeadLogProbs.apply(h, weight, y, vocab, first, max(1, chunk), group)
    per_row = labels.reshape(-1, labels.shape[-1])
    sums = torch.zeros(per_row.shape[0], dtype=token.dtype, device=token.device).index_add(
        0, keep // labels.shape[-1], token)
    return torch.stack([sums, (per_row != IGNORED).sum(1).to(token.dtype)], dim=1)


def _kept(labels: torch.Tensor, count: Optional[int]) -> torch.Tensor:
    """The flat indices of the labels that count, in order."""
    flat = labels.reshape(-1)
    if count is None:
        return (flat != IGNORED).nonzero().squeeze(1)
    # the labelled positions first, in order (a stable sort), then the first `count` of them
    return torch.argsort((flat == IGNORED).to(torch.uint8), stable=True)[:count]


def _labelled(hidden, weight, labels, keep: torch.Tensor) -> tuple:
    """(the labelled positions' hidden states (n, d), their labels (n,), this rank's head rows, the first row's
    vocabulary id, the hp group or None) for the chunked head."""
    from torch.distributed.tensor import DTensor

    if isinstance(hidden, DTensor):
        hidden = hidden.full_tensor()
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep)
    y = labels.reshape(-1).index_select(0, keep)
    group, first = None, 0
    if isinstance(weight, DTensor):  # vocabulary-sharded over hp (the layout's 1-D hp mesh)
        mesh = weight.device_mesh
        group, local = mesh.get_group(), weight.to_local()
        first = mesh.get_local_rank() * local.shape[0]
        weight = local
    return h, y, weight, first, group


def _chunk_logits(hc, w, yc, vocab: int, first: int, group) -> tuple:
    """One chunk's logits over this rank's rows, less their row maximum (over hp), and (exp'd in place: the softmax's
    numerators) with the target logit, the softmax's sum, whether the target is in this shard and its column."""
    rows = w.shape[0]
    logits = (hc @ w.t()).float()  # (c, rows): the only full-width tensor, one chunk's
    if first + rows > vocab:  # this shard holds padding rows (known on the host: nothing waits for the GPU)
        logits.masked_fill_(torch.arange(first, first + rows, device=w.device) >= vocab, float("-inf"))
    top = logits.max(dim=1).values
    _all_reduce(top, dist.ReduceOp.MAX, group)
    logits.sub_(top[:, None])
    mine = (yc >= first) & (yc < first + rows)  # the target's column is in this rank's shard
    at = (yc - first).clamp(0, rows - 1)
    target = torch.where(mine, logits.gather(1, at[:, None]).squeeze(1), 0.0)
    _all_reduce(target, dist.ReduceOp.SUM, group)
    probs = logits.exp_()
    norm = probs.sum(dim=1)
    _all_reduce(norm, dist.ReduceOp.SUM, group)
    return probs, target, norm, mine, at


def _softmax_less_target(probs, norm, mine, at) -> torch.Tensor:
    """_chunk_logits' softmax numerators made, in place, the softmax less the one-hot target (its column in this
    shard): the gradient of a position's cross-entropy with respect to its logits."""
    probs.div_(norm[:, None])
    return probs.scatter_add_(1, at[:, None], mine[:, None].to(probs.dtype).neg())  # -1 where mine, -0 else


class _ChunkedHeadLoss(torch.autograd.Function):
    """(h (n, d), w (local rows, d), y (n,)) -> summed cross-entropy; gradients computed in the forward."""

    @staticmethod
    def forward(ctx, h, w, y, vocab: int, first: int, chunk: int, group, need_h: bool, need_w: bool):
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.zeros_like(h) if need_h else None
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
        for s in range(0, h.shape[0], chunk):
            hc, yc = h[s:s + chunk], y[s:s + chunk]
            probs, target, norm, mine, at = _chunk_logits(hc, w, yc, vocab, first, group)
            total += (norm.log() - target).sum()
            if need_h or need_w:  # d(loss)/d(logits) = softmax - one_hot(target)
                g = _softmax_less_target(probs, norm, mine, at).to(w.dtype)
                if need_h:
                    grad_h[s:s + chunk] = g @ w
                if need_w:
                    grad_w += (g.t() @ hc).float()
        if need_h:
            _all_reduce(grad_h, dist.ReduceOp.SUM, group)  # each rank's columns' share of every position's gradient
        ctx.grads, ctx.w_dtype = (grad_h, grad_w), w.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_h, grad_w = ctx.grads
        return (None if grad_h is None else grad_h * grad_total.to(grad_h.dtype),
                None if grad_w is None else (grad_w * grad_total).to(ctx.w_dtype),
                None, None, None, None, None, None, None)


class _ChunkedHeadLogProbs(torch.autograd.Function):
    """(h (n, d), w (local rows, d), y (n,)) -> each position's log-probability of its label (n,), fp32."""

    @staticmethod
    def forward(ctx, h, w, y, vocab: int, first: int, chunk: int, group):
        out = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        for s in range(0, h.shape[0], chunk):
            _, target, norm, _, _ = _chunk_logits(h[s:s + chunk], w, y[s:s + chunk], vocab, first, group)
            out[s:s + chunk] = target - norm.log()
        ctx.save_for_backward(h, w, y)
        ctx.settings = (vocab, first, chunk, group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        h, w, y = ctx.saved_tensors
        vocab, first, chunk, group = ctx.settings
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(h) if need_h else None
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
        for s in range(0, h.shape[0], chunk):
            hc = h[s:s + chunk]
            probs, _, norm, mine, at = _chunk_logits(hc, w, y[s:s + chunk], vocab, first, group)
            # d(log p_target)/d(logits) = one_hot(target) - softmax, times each position's incoming gradient
            g = (_softmax_less_target(probs, norm, mine, at) * -grad_out[s:s + chunk, None].float()).to(w.dtype)
            if need_h:
                grad_h[s:s + chunk] = g @ w
            if need_w:
                grad_w += (g.t() @ hc).float()
        if need_h:
            _all_reduce(grad_h, dist.ReduceOp.SUM, group)
        return (grad_h, None if grad_w is None else grad_w.to(w.dtype), None, None, None, None, None)


def _all_reduce(t: torch.Tensor, op, group: Optional[object]) -> None:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
