"""Cross-entropy over the vocabulary without materialising [N, V] float32 logits for the batch.

In: hidden [N, H] (the final-normed states), the LM head weight [V, H], labels [N] (-100 = no
loss). Out: the summed token loss (float32 scalar); the caller divides by the token count.

The logits are computed chunk by chunk, and each chunk's gradient (softmax minus one-hot) is
turned into grad_hidden and grad_weight at once, in the forward pass. That is the same three
matmuls a plain fwd+bwd does (two when the weight is frozen, as an EAGLE head's LM head is), but peak memory is one chunk of logits instead of the whole batch
(128k-vocab Llama-3: 32k tokens x 128k x 4 B = 16 GiB otherwise). On CUDA the elementwise part of a
chunk is one compiled kernel that reads the logits once.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100
DEFAULT_CHUNK_ROWS = 8192


def _chunk_loss_and_grad(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, V] (compute dtype), labels [n] -> (summed loss fp32, d loss / d logits [n, V])."""
    logits32 = logits.float()
    valid = labels != IGNORE_INDEX                                  # [n]
    safe = torch.where(valid, labels, 0).unsqueeze(1)               # [n, 1]
    lse = torch.logsumexp(logits32, dim=-1, keepdim=True)           # [n, 1]
    loss = ((lse - logits32.gather(1, safe)).squeeze(1) * valid).sum()
    grad = torch.exp(logits32 - lse)
    grad = grad - torch.zeros_like(grad).scatter_(1, safe, 1.0)
    return loss, (grad * valid.unsqueeze(1)).to(logits.dtype)


_compiled_chunk = None


def _chunk_fn(device: torch.device):
    """The compiled chunk kernel on CUDA (built once); eager on the CPU, where compiling costs
    more than it saves on test-sized batches."""
    global _compiled_chunk
    if device.type != "cuda":
        return _chunk_loss_and_grad
    if _compiled_chunk is None:
        # dynamic=None: a second row count recompiles once with the rows dynamic. A draft head's
        # batches label a different number of rows each step, and dynamic=False recompiled every
        # new count until dynamo's limit (8), seconds each (device log, round 24); a
        # pretraining step's fixed chunks keep their static kernel
        _compiled_chunk = torch.compile(_chunk_loss_and_grad, dynamic=None)
    return _compiled_chunk


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_rows: int,
                compute_dtype: torch.dtype, stats: dict | None) -> torch.Tensor:
        want_h, want_w = ctx.needs_input_grad[:2]     # a frozen LM head (EAGLE's) needs no [V, H] product
        with torch.autocast(hidden.device.type, enabled=False):
            h = hidden.to(compute_dtype)                            # [N, H]
            w = weight.to(compute_dtype)                            # [V, H]
            fn = _chunk_fn(hidden.device)
            loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
            grad_h = torch.empty_like(h) if want_h else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
            correct = torch.zeros((), dtype=torch.long, device=hidden.device)
            for start in range(0, h.shape[0], chunk_rows):
                rows = slice(start, start + chunk_rows)
                logits = h[rows] @ w.t()                                    # [n, V]
                if stats is not None:
                    correct += (logits.argmax(-1) == labels[rows]).sum()
                chunk_loss, grad_logits = fn(logits, labels[rows])
                loss += chunk_loss
                if want_h:
                    grad_h[rows] = grad_logits @ w
                if want_w:
                    grad_w += (grad_logits.t() @ h[rows]).float()
            if stats is not None:
                stats["correct"] = correct
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        return (None if grad_h is None else (grad_h * grad_loss).to(h_dtype),
                None if grad_w is None else (grad_w * grad_loss).to(w_dtype), None, None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         chunk_rows: int = DEFAULT_CHUNK_ROWS, compute_dtype: torch.dtype | None = None,
                         stats: dict | None = None) -> torch.Tensor:
    """Summed cross-entropy of softmax(hidden @ weight^T) against labels. hidden [..., H], labels [...].
    The gradients (computed in the forward, chunk by chunk) are those of the inputs that need one.
    `stats`: a dict that gets "correct", a count of the rows whose argmax is their label, taken
    from the same logits."""
    h = hidden.reshape(-1, hidden.shape[-1])
    if not torch.is_grad_enabled():        # evaluation: the loss alone, one matmul per chunk
        return _loss_only(h, weight, labels.reshape(-1), chunk_rows, compute_dtype or weight.dtype, stats)
    return _LinearCrossEntropy.apply(h, weight, labels.reshape(-1), chunk_rows, compute_dtype or weight.dtype, stats)


def _loss_only(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_rows: int,
               compute_dtype: torch.dtype, stats: dict | None) -> torch.Tensor:
    w = weight.to(compute_dtype)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    correct = torch.zeros((), dtype=torch.long, device=h.device)
    for start in range(0, h.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        logits = (h[rows].to(compute_dtype) @ w.t()).float()                 # [n, V]
        if stats is not None:
            correct += (logits.argmax(-1) == labels[rows]).sum()
        total += torch.nn.functional.cross_entropy(logits, labels[rows], ignore_index=IGNORE_INDEX,
                                                   reduction="sum")
    if stats is not None:
        stats["correct"] = correct
    return total


def reference_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The plain version (full logits), for tests."""
    logits = (hidden.reshape(-1, hidden.shape[-1]) @ weight.t()).float()
    return torch.nn.functional.cross_entropy(logits, labels.reshape(-1), ignore_index=IGNORE_INDEX,
                                             reduction="sum")
