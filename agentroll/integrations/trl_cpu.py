"""Run TRL 1.16's ``AsyncGRPOTrainer`` on a CPU-only torch (tests, examples, laptops).

Invariants: only two CUDA assumptions of TRL's module are replaced, inside ``cpu_training``
and restored at its end: the MFU peak-FLOPs lookup (reports unknown) and the FA3 tree
attention (the same attention in plain torch, one packed segment at a time).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from agentroll.errors import ConfigError
from agentroll.integrations.trl_async import check_trl_contract

__all__ = ["cpu_training"]


def _torch_tree_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    *,
    tree_kv_index: torch.Tensor,
    tree_cu_seqlens_q: torch.Tensor,
    tree_cu_seqlens_k: torch.Tensor,
    tree_max_seqlen_q: int,
    tree_max_seqlen_k: int,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """TRL's tree attention in plain torch: each packed segment attends causally to the
    K/V rows of its root-to-segment path (``tree_kv_index``), the segment being the path's
    tail.  The same function as TRL's FA3 kernel call, one segment at a time."""
    if sliding_window or softcap:
        raise ConfigError("the CPU tree attention does not support sliding windows or softcap")
    q, k, v = (x.transpose(1, 2)[0] for x in (query, key, value))  # (tokens, heads, dim)
    k, v = k.index_select(0, tree_kv_index), v.index_select(0, tree_kv_index)
    groups = q.shape[1] // k.shape[1]  # grouped-query attention: K/V heads are shared
    out = torch.empty_like(q)
    cq, ck = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    for s in range(len(cq) - 1):
        qs = q[cq[s] : cq[s + 1]].transpose(0, 1)
        ks = k[ck[s] : ck[s + 1]].transpose(0, 1).repeat_interleave(groups, 0)
        vs = v[ck[s] : ck[s + 1]].transpose(0, 1).repeat_interleave(groups, 0)
        nq, nk = qs.shape[1], ks.shape[1]
        causal = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
        attn = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=causal, scale=scaling
        )
        out[cq[s] : cq[s + 1]] = attn.transpose(0, 1)
    return out.unsqueeze(0), None


@contextlib.contextmanager
def cpu_training() -> Iterator[None]:
    """Run TRL 1.16's ``AsyncGRPOTrainer`` on a CPU-only torch, inside the block.

    It assumes CUDA in two places: the peak-FLOPs lookup for its MFU metric
    (``torch.cuda.get_device_name``; here it reports unknown peak FLOPs, so MFU is not
    logged) and its tree attention, an FA3 kernel fetched from the Hugging Face Hub (here the
    same attention in plain torch).  Construct and ``train()`` the trainer inside the block;
    both are restored at its end."""
    check_trl_contract()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from trl.experimental.async_grpo import async_grpo_trainer as trainer_mod

    def register() -> None:
        AttentionInterface.register(trainer_mod.TREE_ATTENTION, _torch_tree_attention)
        AttentionMaskInterface.register(trainer_mod.TREE_ATTENTION, lambda **kwargs: None)

    saved = (trainer_mod.register_tree_attention, trainer_mod.get_peak_flops_per_device)
    trainer_mod.register_tree_attention = register
    trainer_mod.get_peak_flops_per_device = lambda *args, **kwargs: None
    register()
    try:
        yield
    finally:
        trainer_mod.register_tree_attention, trainer_mod.get_peak_flops_per_device = saved
        saved[0]()
