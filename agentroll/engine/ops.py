"""The op sets one forward step of the decoder runs on: ``_FastOps`` for throughput and
``_InvariantOps`` whose per-row results do not depend on the batch.

Invariants: with ``_InvariantOps`` a token's logits and K/V depend only on its own
sequence's tokens and cache, not on the other sequences of the step nor on how its prefill
was chunked: matmuls run on fixed-shape tiles and every other op computes each row alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from agentroll.engine.models.decoder import apply_rope, rms_norm

if TYPE_CHECKING:
    from agentroll.engine.model_runner import ModelRunner, _Plan


_ELEMENTWISE_GRAIN = 32768  # torch's CPU grain: smaller elementwise calls run on one thread
_VECTOR_ALIGN = 64  # elements; keeps every activation in the vectorised body, not the scalar tail


def _long(values: Sequence[int] | Sequence[Sequence[int]], device: torch.device) -> Tensor:
    """An int64 tensor of a (nested, rectangular) list: through numpy, 5-30x faster than
    ``torch.tensor`` on the small lists of one step (measured: 7.5 vs 1.5 us for 32 ints)."""
    t = torch.from_numpy(np.array(values, dtype=np.int64))
    return t if device.type == "cpu" else t.to(device)


def _padded(tables: Sequence[Sequence[int]], width: int, device: torch.device) -> Tensor:
    """Block tables as one int64 [len(tables), width] tensor (cut or zero-padded to width)."""
    out = np.zeros((len(tables), width), dtype=np.int64)
    for i, t in enumerate(tables):
        row = t[:width]
        out[i, : len(row)] = row
    return torch.from_numpy(out).to(device)


class _FastOps:
    """Kernels for throughput: whole-batch matmuls; decodes attend in one call (the C++ kernel
    reading the paged cache in place, or one padded SDPA over gathered K/V without it),
    prefills with SDPA each."""

    def __init__(self, runner: ModelRunner, plan: _Plan) -> None:
        self.runner, self.plan, self.kernels = runner, plan, runner.kernels
        dev, bs = runner.device, runner.block_size
        decodes = [i for i, it in enumerate(plan.items) if len(it.token_ids) == 1]
        # (row offset, new tokens, block ids, keys to attend, mask or None: causal from 0)
        self.prefills: list[tuple[int, int, Tensor, int, Tensor | None]] = []
        for i, it in enumerate(plan.items):
            if len(it.token_ids) > 1:
                n, start = len(it.token_ids), it.start_pos
                ids = runner._table(it.block_table, start + n)
                mask = None
                if start:
                    keys = torch.arange(start + n, device=dev)
                    mask = keys[None, :] <= torch.arange(start, start + n, device=dev)[:, None]
                self.prefills.append((plan.offsets[i], n, ids, start + n, mask))
        self.decode_rows: Tensor | None = None
        self.all_decodes = len(decodes) == len(plan.items)  # rows are the decodes, in order
        if decodes:
            lengths = [plan.items[i].start_pos + 1 for i in decodes]
            nb = -(-max(lengths) // bs)
            blocks = _padded([plan.items[i].block_table for i in decodes], nb, dev)
            self.decode_rows = _long([plan.offsets[i] for i in decodes], dev)
            if self.kernels is not None:
                self.decode_tables = blocks
                self.decode_index = torch.arange(len(decodes), device=dev)
                self.decode_lens = _long(lengths, dev)
            else:
                # One padded call for all decodes; keys past a sequence's end are masked out.
                self.decode_gather = blocks
                keys = torch.arange(nb * bs, device=dev)
                lens = _long(lengths, dev)
                self.decode_mask = (keys[None, :] < lens[:, None])[:, None, None, :]

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if self.runner.packed and x.dim() == 2:
            packed, n = self.runner.weight_packed(weight)
            assert self.kernels is not None  # packed copies come with the kernels
            return self.kernels.linear_packed(x.contiguous(), packed, n, bias, 0)
        return F.linear(x, weight, bias)

    def silu_mul(self, gate: Tensor, up: Tensor) -> Tensor:
        if self.kernels is not None:
            return self.kernels.silu_mul(gate.contiguous(), up.contiguous())
        return F.silu(gate) * up

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if self.kernels is not None:
            return self.kernels.rms_norm(x.contiguous(), weight, eps)
        return rms_norm(x, weight, eps)

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if self.kernels is not None:
            return self.kernels.rope_(x.contiguous(), cos.squeeze(1), sin.squeeze(1))
        return apply_rope(x, cos, sin)

    def _store(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        kc, vc = self.runner.k_cache[layer], self.runner.v_cache[layer]
        if self.kernels is not None:
            self.kernels.store_kv(k.contiguous(), v.contiguous(), kc, vc, self.plan.slots)
        else:
            self.runner.store_kv(kc, vc, self.plan.slots, k, v)
        return kc, vc

    def _paged(
        self, q: Tensor, kc: Tensor, vc: Tensor, tables: Tensor, rows: Tensor, lens: Tensor
    ) -> Tensor:
        """The C++ kernel: query row i attends to keys 0..lens[i]-1 of table row rows[i]."""
        assert self.kernels is not None
        return self.kernels.paged_attention(
            q.contiguous(), kc, vc, tables, rows, lens, self.runner.scale
        )

    def _decode_attention(self, q: Tensor, kc: Tensor, vc: Tensor) -> Tensor:
        if self.kernels is not None:
            return self._paged(q, kc, vc, self.decode_tables, self.decode_index, self.decode_lens)
        keys, values = self.runner.gather_kv(kc, vc, self.decode_gather)
        return F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=self.decode_mask, enable_gqa=True
        ).squeeze(2)

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        kc, vc = self._store(layer, k, v)
        if self.decode_rows is not None:
            if self.all_decodes:
                return self._decode_attention(q, kc, vc)
            o = self._decode_attention(q.index_select(0, self.decode_rows), kc, vc)
            out = torch.empty_like(q)
            out.index_copy_(0, self.decode_rows, o)
        else:
            out = torch.empty_like(q)
        for off, n, blocks, length, mask in self.prefills:
            keys, values = self.runner.gather_kv(kc, vc, blocks, length)
            o = F.scaled_dot_product_attention(
                q[off : off + n].transpose(0, 1).unsqueeze(0),
                keys.unsqueeze(0),
                values.unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                enable_gqa=True,
            )
            out[off : off + n] = o[0].transpose(0, 1)
        return out


class _InvariantOps(_FastOps):
    """Kernels whose per-row results do not depend on the batch.

    Measured on this CPU (MKL sgemm): a row of ``x @ W.T`` rounds differently for M=1, M in
    {2, 3} and M >= 4, and elementwise transcendental ops round differently in the scalar tail
    than in the vector body.  So matmuls run on fixed tiles of ``invariant_tile`` rows
    (zero-padded), and each query row attends over exactly its own prefix, like a decode step
    would; norms run on the same tiles as matmuls, SiLU on fixed single-threaded chunks padded
    to the vector width, and attention is one SDPA call per query row.  (With the C++ kernels
    the batch-invariant mode runs ``decoder_forward`` instead, invariant by construction.)
    """

    def __init__(self, runner: ModelRunner, plan: _Plan) -> None:
        self.runner, self.plan, self.tile = runner, plan, runner.invariant_tile
        self.kernels = None  # see the class doc
        self.gathers = [
            runner._table(it.block_table, it.start_pos + len(it.token_ids)) for it in plan.items
        ]

    def _tiled(self, fn: Callable[[Tensor], Tensor], x: Tensor, rows: int) -> Tensor:
        m = x.shape[0]
        pad = -m % rows
        x = torch.cat((x, x.new_zeros(pad, *x.shape[1:]))) if pad else x.contiguous()
        parts = [fn(x[i : i + rows]) for i in range(0, m + pad, rows)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out[:m] if pad else out

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return self._tiled(
            lambda t: super(_InvariantOps, self).linear(t, weight, bias), x, self.tile
        )

    def silu_mul(self, gate: Tensor, up: Tensor) -> Tensor:
        width = gate.shape[1]
        pad = -width % _VECTOR_ALIGN
        rows = max(1, _ELEMENTWISE_GRAIN // (width + pad))
        act = (lambda t: F.silu(F.pad(t, (0, pad)))[:, :width]) if pad else F.silu
        return self._tiled(act, gate, rows) * up

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        return self._tiled(lambda t: rms_norm(t, weight, eps), flat, self.tile).view(x.shape)

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        kc, vc = self._store(layer, k, v)
        queries = q.unsqueeze(2)  # [T, heads, 1, hd]: one query row per call
        out: list[Tensor] = []
        for off, item, blocks in zip(self.plan.offsets, self.plan.items, self.gathers, strict=True):
            length = item.start_pos + len(item.token_ids)
            keys, values = self.runner.gather_kv(kc, vc, blocks, length)
            keys, values = keys.unsqueeze(0), values.unsqueeze(0)
            for r in range(len(item.token_ids)):
                end = item.start_pos + r + 1
                out.append(
                    F.scaled_dot_product_attention(
                        queries[off + r : off + r + 1],
                        keys[:, :, :end],
                        values[:, :, :end],
                        enable_gqa=True,
                    )
                )
        return torch.cat(out).squeeze(2)
