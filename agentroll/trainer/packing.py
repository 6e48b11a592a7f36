"""The trainer's dense forward over packed sequences: ops with per-sequence causal attention,
a prefix shared by a micro-batch computed once, and the grouping into micro-batches.

Invariants: a sequence after a shared prefix attends exactly as if the prefix were repeated
in front of it, so packing and prefix sharing never change a logprob beyond fp32 rounding;
micro-batches keep the rows in order and skip empty ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from agentroll.engine.models.decoder import apply_rope, rms_norm
from agentroll.trainer.batch import Batch


class _TrainOps:
    """Dense kernels for training: the engine's linear / SiLU / RMSNorm, and causal attention
    over each packed sequence on its own (GQA by repeating the KV heads).  With ``prefix`` >
    0 the stream starts with a prefix shared by every sequence, computed once: each
    sequence after it (``lengths``) attends to the prefix and causally to itself, exactly as
    if the prefix were repeated in front of it."""

    def __init__(self, lengths: Sequence[int], prefix: int = 0) -> None:
        self.lengths = list(lengths)
        self.prefix = prefix

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return F.linear(x, weight, bias)

    def silu_mul(self, gate: Tensor, up: Tensor) -> Tensor:
        return F.silu(gate) * up

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return rms_norm(x, weight, eps)

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return apply_rope(x, cos, sin)  # torch ops: training needs their gradients

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        p = self.prefix
        outs, at = [], p
        if p:
            outs.append(_causal(q[:p], k[:p], v[:p]))
        for n in self.lengths:
            if n == 0:
                continue
            if not p:
                outs.append(_causal(q[at : at + n], k[at : at + n], v[at : at + n]))
            else:
                keys = torch.cat((k[:p], k[at : at + n]))
                values = torch.cat((v[:p], v[at : at + n]))
                # row a of this sequence sees the whole prefix and its own tokens 0..a
                mask = torch.ones(n, p + n, dtype=torch.bool, device=q.device)
                mask[:, p:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
                o = F.scaled_dot_product_attention(
                    q[at : at + n].transpose(0, 1),
                    keys.transpose(0, 1),
                    values.transpose(0, 1),
                    attn_mask=mask,
                )
                outs.append(o.transpose(0, 1))
            at += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def _causal(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return o.transpose(0, 1)


#: shortest common prefix worth computing once for a micro-batch (tokens)
MIN_SHARED_PREFIX = 16


def common_prefix(batch: Batch, rows: Sequence[int]) -> int:
    """Length of the token prefix that every row of ``rows`` shares (0 for fewer than 2)."""
    if len(rows) < 2:
        return 0
    lengths = [int(batch.lengths[r]) for r in rows]
    n = min(lengths)
    first = batch.input_ids[rows[0], :n]
    same = (batch.input_ids[list(rows), :n] == first).all(0)
    diff = torch.nonzero(~same)
    return int(diff[0]) if len(diff) else n


def _micro_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Rows (in order, empty rows skipped) grouped so each group's tokens fit ``budget``; a
    longer row is a group on its own."""
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for row, n in enumerate(lengths):
        if n == 0:
            continue
        if current and used + n > budget:
            groups.append(current)
            current, used = [], 0
        current.append(row)
        used += n
    if current:
        groups.append(current)
    return groups
