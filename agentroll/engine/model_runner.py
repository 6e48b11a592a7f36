"""Model runner: the built-in engine's forward step over a paged KV cache it owns; with
``ops``, the only code of the engine that touches torch kernels.

Invariants: K/V of position p live in block ``block_table[p // block_size]`` at slot
``p % block_size``; logits are fp32; the fused packed weight copies are rebuilt when a
weight changed (``weights_changed``, and the tensors' version counters at every step).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from agentroll.engine import kernels
from agentroll.engine.models.decoder import (
    DecoderModel,
    load_model,
    read_tensors,
)
from agentroll.engine.ops import _FastOps, _InvariantOps, _long, _padded
from agentroll.errors import ConfigError

INVARIANT_TILE = 32  # rows per matmul in batch-invariant mode (fp32 MKL differs for M=1, 2-3, >=4)
_ROPE_CHUNK = 1024  # RoPE tables are computed in fixed chunks so values never depend on history


# With the CPU kernels, linear layers multiply by packed copies of the weights (panels of
# PACK_COLS columns of [in, out], q/k/v and gate/up side by side): a decode step streams each
# panel in one sequential run (csrc/cpu_kernels.cpp, gemm_packed).  The copies double the
# weights' memory, so they are made up to a quarter of the machine's memory (or
# AGENTROLL_PACKED_MAX_MB); bigger models run torch's products.
def packed_max_bytes() -> int:
    """The largest model (bytes of weights) that gets packed copies."""
    env = os.environ.get("AGENTROLL_PACKED_MAX_MB")
    if env is not None:
        try:
            return int(float(env) * 2**20)
        except ValueError:
            raise ConfigError(
                f"AGENTROLL_PACKED_MAX_MB={env!r} is not a number of MiB; unset it or give "
                "one (0 turns the packed copies off)"
            ) from None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (OSError, ValueError):
        return 1 << 30


PACK_COLS = 32  # the kernels' kPackCols: packed weights are panels of this many columns
# Outside the batch-invariant mode a step runs in decoder_forward when its prefill chunks are
# short: their rows attend row by row there, about 11 ns a key per row here, against SDPA's
# matrix products on the layer-by-layer path.  A step of 31 decodes and a 40-token chunk at
# position 300 (12.8k keys) took 712 us that way against 958 layer by layer; at this bound a
# layer's prefill attention stays under about 0.7 ms.
_FUSED_PREFILL_KEYS = 65536


def _as_rows(k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Views of K and V blocks in the cache's layout ([..., kv_heads, head_dim, block_size]
    and [..., kv_heads, block_size, head_dim]) as position-major rows [..., block_size,
    kv_heads, head_dim]: the layout of SDPA's gathers and of read_blocks/write_blocks."""
    return k.movedim(-1, -3), v.transpose(-3, -2)


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs 4x (one per decode)
class ForwardItem:
    """One sequence in a step: the new tokens occupy positions start_pos .. start_pos+len-1."""

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    want_logits: bool = True  # logits of the last new token
    want_all_logits: bool = False  # logits of every new token (prompt logprobs, rescoring)


@dataclass(slots=True)
class ForwardOutput:
    """fp32 logits keyed by item index: [vocab] for the last token, [n_new, vocab] for all.

    ``logits`` holds every computed row; ``last_rows`` maps an item wanting its last token's
    logits to that row, so a caller taking many of them reads one matrix (:meth:`last`)."""

    all_logits: dict[int, Tensor] = field(default_factory=dict)
    logits: Tensor | None = None
    last_rows: dict[int, int] = field(default_factory=dict)

    @property
    def last_logits(self) -> dict[int, Tensor]:
        """Item -> [vocab] logits of its last token (views into ``logits``)."""
        logits = self.logits
        return {} if logits is None else {i: logits[r] for i, r in self.last_rows.items()}

    def last(self, items: Sequence[int]) -> Tensor:
        """[len(items), vocab]: the last-token logits of these items, in this order."""
        assert self.logits is not None
        rows = [self.last_rows[i] for i in items]
        if rows == list(range(self.logits.shape[0])):
            return self.logits
        return self.logits.index_select(0, _long(rows, self.logits.device))


@dataclass(slots=True)
class _Plan:
    token_ids: Tensor
    positions: Tensor
    slots: Tensor
    offsets: list[int]
    items: Sequence[ForwardItem]
    all_decodes: bool  # every item computes one token
    tables: Tensor | None = None  # [items, blocks] block tables (decode plans build it)
    # keys the rows of multi-token items attend to, summed: their attention's size
    prefill_keys: int = 0


def _logit_rows(plan: _Plan) -> tuple[list[int], dict[int, tuple[int, int]]]:
    """The rows whose logits the items want, in item order, and for each such item its span
    in them: (first row, number of rows) -- all its rows, or just its last."""
    rows: list[int] = []
    spans: dict[int, tuple[int, int]] = {}
    for i, item in enumerate(plan.items):
        if item.want_all_logits or item.want_logits:
            end = plan.offsets[i] + len(item.token_ids)
            first = plan.offsets[i] if item.want_all_logits else end - 1
            spans[i] = (len(rows), end - first)
            rows.extend(range(first, end))
    return rows, spans


def _output(
    items: Sequence[ForwardItem], logits: Tensor, spans: dict[int, tuple[int, int]]
) -> ForwardOutput:
    """``logits`` (the rows of ``_logit_rows``) as the items asked for them."""
    out = ForwardOutput(logits=logits)
    for i, (at, n) in spans.items():
        if items[i].want_all_logits:
            out.all_logits[i] = logits[at : at + n]
        if items[i].want_logits:
            out.last_rows[i] = at + n - 1
    return out


def _packed_views(fused: Tensor, weights: list[Tensor], pack: Any) -> dict[int, tuple[Tensor, int]]:
    """Each of ``weights`` (side by side, in order, in the packed ``fused``) as a packed weight:
    a slice of ``fused`` where its columns are whole panels (it starts on a panel boundary and
    ends on one or at the end), else packed on its own."""
    k, total = weights[0].shape[1], sum(w.shape[0] for w in weights)
    views, col = {}, 0
    for weight in weights:
        n = weight.shape[0]
        if col % PACK_COLS == 0 and ((col + n) % PACK_COLS == 0 or col + n == total):
            views[id(weight)] = (fused[col * k : (col + n) * k], n)
        else:
            views[id(weight)] = (pack(weight.detach().t()), n)
        col += n
    return views


class ModelRunner:
    """A decoder plus its paged KV cache; ``forward`` runs one continuous-batching step.

    Not thread-safe: one step at a time.  ``num_blocks * block_size`` bounds the cached tokens.

    The KV cache holds, per layer, K of shape [num_blocks, kv_heads, head_dim, block_size]
    (a block's keys of one head transposed: the C++ attention scores 16 keys per vector from
    it) and V of shape [num_blocks, kv_heads, block_size, head_dim]; a step takes sequences
    as plain records: new tokens, the number already cached and a block table of ints.  On the CPU it uses the engine's C++ kernels
    (``kernels.py``) for fp32: a step of decodes and short prefill chunks, and every step in
    the batch-invariant mode, is one call of their ``decoder_forward`` (the whole model in
    C++, over fused QKV and gate/up weights packed once, products by oneDNN's brgemm
    micro-kernels); steps with long prefills run the model layer by layer with the kernels'
    norms, SiLU, RoPE, K/V writes, paged attention and products on views of the same
    packed copies, and SDPA for the prefills.  bf16 weights run every step in
    ``decoder_forward`` with bf16 products and a bf16 KV cache (activations and attention's
    arithmetic in fp32) where the CPU has them.  Everywhere else (other dtypes, CUDA, no
    compiler) it runs torch ops.  With ``batch_invariant=True`` a token's logits and K/V
    depend only on its own sequence's tokens and cache (``decoder_forward`` by
    construction; on torch ops, ``ops._InvariantOps``).
    """

    def __init__(
        self,
        model_dir_or_model: str | Path | DecoderModel,
        *,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        batch_invariant: bool = False,
        invariant_tile: int = INVARIANT_TILE,
        use_kernels: bool = True,
    ) -> None:
        if num_blocks < 1 or block_size < 1 or invariant_tile < 1:
            raise ConfigError("num_blocks, block_size and invariant_tile must be >= 1")
        self.device = torch.device(device)
        self.dtype = dtype
        if isinstance(model_dir_or_model, DecoderModel):
            self.model = model_dir_or_model.to(device=self.device, dtype=dtype).eval()
        else:
            self.model = load_model(model_dir_or_model, dtype=dtype, device=self.device)
        self.config = cfg = self.model.config
        self.num_blocks, self.block_size = num_blocks, block_size
        self.batch_invariant, self.invariant_tile = batch_invariant, invariant_tile
        # the C++ kernels (kernels.py) when they apply: on the CPU and buildable here, for
        # fp32, or for bf16 where the CPU runs bf16 products and the packed copies are made
        # (bf16 steps run only in decoder_forward: activations fp32, K/V cached in bf16)
        ext = kernels.get() if use_kernels and self.device.type == "cpu" else None
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        packed = ext is not None and weight_bytes <= packed_max_bytes()
        bf16_ok = packed and ext is not None and ext.bf16_products()
        if dtype != torch.float32 and not (dtype == torch.bfloat16 and bf16_ok):
            ext = None
        self.kernels = ext
        self.packed = packed and ext is not None
        self.k_cache: list[Tensor] = []
        self.v_cache: list[Tensor] = []
        self.allocate_kv()
        dim = cfg.head_dim
        self._inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
        )
        self._cos = torch.empty(0, dim, device=self.device)
        self._sin = torch.empty(0, dim, device=self.device)
        self.scale = dim**-0.5
        # decoder_forward's weights and the version counters they were built at, and
        # id(weight) -> (its packed slice of them, its outputs) (weight_packed)
        self._fused: tuple[tuple[int, ...], list[Tensor]] | None = None
        self._views: dict[int, tuple[Tensor, int]] = {}
        self._params = list(self.model.parameters())
        self._released: dict[str, tuple[int, ...]] | None = None  # shapes while released
        self._range = torch.arange(64, device=self.device)
        # set to float64 [len(kernels.decoder_regions())] to have decoder_forward add each
        # region's seconds to it (bench engine-profile); empty: no clock reads
        self.step_timings = torch.empty(0, dtype=torch.float64)

    @property
    def block_bytes(self) -> int:
        """Bytes of K and V that one block holds over all layers."""
        cfg = self.config
        per_layer = self.block_size * cfg.num_kv_heads * cfg.head_dim
        return 2 * cfg.num_layers * per_layer * self.dtype.itemsize

    # -- memory (sleep / wake) -------------------------------------------------------------

    @property
    def kv_bytes(self) -> int:
        """Bytes of the KV cache as allocated now (0 after ``release_kv``)."""
        return sum(c.numel() * c.element_size() for c in self.k_cache + self.v_cache)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the live weights and of the fused copies derived from them (each storage
        once: the fused list also holds the norms and the embedding themselves)."""
        fused = self._fused[1] if self._fused is not None else []
        storages = {}
        for t in [*self._params, *fused]:
            if t.numel():
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def allocate_kv(self) -> None:
        """(Re)allocate the KV cache, zeroed: one buffer, so that freeing it hands every page
        back to the system at once (one allocation past the allocator's mmap threshold; with
        the CPU kernels, a mapping advised for 2 MB pages, see ``huge_zeros``)."""
        cfg = self.config
        nb, bs, kvh, hd = self.num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim
        shape = (2, cfg.num_layers, nb * kvh * hd * bs)
        if self.kernels is not None and self.device.type == "cpu":
            kv = self.kernels.huge_zeros(list(shape), self.dtype)
        else:
            kv = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.k_cache = list(kv[0].view(cfg.num_layers, nb, kvh, hd, bs).unbind(0))
        self.v_cache = list(kv[1].view(cfg.num_layers, nb, kvh, bs, hd).unbind(0))

    def release_kv(self) -> int:
        """Free the KV cache (every block's contents are lost); returns the bytes freed.  No
        step may run until ``allocate_kv``."""
        freed = self.kv_bytes
        self.k_cache, self.v_cache = [], []
        return freed

    def release_weights(self) -> int:
        """Free the live weights and their fused copies (the parameters keep their names,
        empty); returns the bytes freed.  No step may run until ``install_weights``."""
        freed = self.weight_bytes
        self.weights_changed()
        params = self.model.named_weights()
        if self._released is None:
            self._released = {name: tuple(p.shape) for name, p in params.items()}
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for p in params.values():
            p.data = empty
        return freed

    @property
    def weights_released(self) -> bool:
        return self._released is not None

    def install_weights(self, tensors: Mapping[str, Tensor]) -> None:
        """Give the released parameters their storage back: ``tensors`` (the names of
        ``state_dict``, on this device, in the runner's dtype) become the live weights
        without a copy.  Raises ConfigError, changing nothing, on a missing or odd tensor."""
        params = self.model.named_weights()
        shapes = self._released or {name: tuple(p.shape) for name, p in params.items()}
        for name in params:
            t = tensors.get(name)
            want = shapes[name]
            if t is None or tuple(t.shape) != want or t.dtype != self.dtype:
                got = "missing" if t is None else f"{t.dtype}{list(t.shape)}"
                raise ConfigError(
                    f"install_weights: tensor {name!r} is {got}, the model needs "
                    f"{self.dtype}{list(want)}"
                )
        for name, p in params.items():
            p.data = tensors[name].to(self.device)
        self._released = None
        self.weights_changed()

    # -- forward ---------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, items: Sequence[ForwardItem]) -> ForwardOutput:
        """Compute the new tokens of every item, store their K/V, return requested logits.

        Raises ValueError naming the item when a token id, position or block table is invalid;
        nothing is written to the cache then.
        """
        out = ForwardOutput()
        if not items:
            return out
        # rebuilt if a weight changed; weight_packed (the layer-by-layer path) reads its views
        weights = self._fused_weights() if self.packed else None
        plan = self._decode_plan(items) if self.packed else None
        if plan is None:
            plan = self._plan(items)
        if weights is not None and (
            self.batch_invariant
            or plan.prefill_keys <= _FUSED_PREFILL_KEYS
            or self.dtype != torch.float32  # bf16 products run only there
        ):
            return self._forward_fused(plan, weights)
        ops: _FastOps = (_InvariantOps if self.batch_invariant else _FastOps)(self, plan)
        cos, sin = self._rope(plan.positions)
        hidden = self.model(plan.token_ids, cos, sin, ops)
        rows, spans = _logit_rows(plan)
        if not rows:
            return out
        if len(rows) < hidden.shape[0]:
            hidden = hidden.index_select(0, _long(rows, self.device))
        return _output(items, self.model.logits(hidden, ops).float(), spans)

    def _forward_fused(self, plan: _Plan, weights: list[Tensor]) -> ForwardOutput:
        """The step as one call of the kernels' ``decoder_forward``: the whole model in C++
        over fused QKV and gate/up weights, every query row attending over the paged cache by
        its own length.  Used for fp32 on the CPU in the batch-invariant mode (where products
        run on fixed tiles) and, otherwise, for steps whose prefill chunks are short
        (``_FUSED_PREFILL_KEYS``; long prefills take the SDPA path, faster there than
        attending row by row)."""
        assert self.kernels is not None
        items, bs, n = plan.items, self.block_size, len(plan.items)
        positions = plan.positions.numpy()
        lens = positions + 1
        spans: dict[int, tuple[int, int]] | None = None  # None: every row's logits, in order
        if plan.all_decodes:
            rows = self._arange(n)
        else:
            counts = [len(it.token_ids) for it in items]
            rows = torch.from_numpy(np.repeat(np.arange(n, dtype=np.int64), counts))
        if plan.all_decodes and all(it.want_logits and not it.want_all_logits for it in items):
            logit_rows = rows
        else:
            wanted, spans = _logit_rows(plan)
            logit_rows = _long(wanted, self.device)
        tables = plan.tables
        if tables is None:
            tables = _padded(
                [it.block_table for it in items], -(-int(lens.max()) // bs), self.device
            )
        self._ensure_rope(int(lens.max()))
        cfg = self.config
        logits = self.kernels.decoder_forward(
            plan.token_ids,
            plan.positions,
            plan.slots,
            tables,
            rows,
            torch.from_numpy(lens),
            logit_rows,
            self._cos,
            self._sin,
            weights,
            self.k_cache,
            self.v_cache,
            cfg.num_heads,
            cfg.num_kv_heads,
            bs,
            cfg.rms_norm_eps,
            self.scale,
            self.invariant_tile if self.batch_invariant else 0,
            self.step_timings,
        )
        if spans is None:  # the common decode step: row i is item i's
            return ForwardOutput(logits=logits, last_rows={i: i for i in range(n)})
        return _output(items, logits, spans) if spans else ForwardOutput()

    def _arange(self, n: int) -> Tensor:
        """0 .. n-1 as int64 (a view of a cached range)."""
        if self._range.shape[0] < n:
            self._range = torch.arange(max(n, 2 * self._range.shape[0]), device=self.device)
        return self._range[:n]

    def _fused_weights(self) -> list[Tensor]:
        """The weights in ``decoder_forward``'s order, with q/k/v and gate/up fused and every
        product's matrix packed (panels of its transpose); rebuilt when a weight changed
        (version counters, or :meth:`weights_changed`)."""
        model = self.model
        versions = tuple(p._version for p in self._params)
        if self._fused is not None and self._fused[0] == versions:
            return self._fused[1]
        # norms and biases in fp32 whatever the weights' dtype (a bf16 model's are converted)
        none = torch.empty(0, dtype=torch.float32, device=self.device)
        params = model.named_weights()
        named = {name: t.detach() for name, t in params.items()}

        def opt(name: str) -> Tensor:
            return named.get(name, none).float()

        assert self.kernels is not None  # fused weights come with the kernels
        bf16 = self.dtype == torch.bfloat16
        pack = self.kernels.pack_weight_bf16 if bf16 else self.kernels.pack_weight

        def cat_packed(*names: str) -> Tensor:
            return pack(torch.cat([named[n] for n in names]).t())

        def packed(weight: Tensor) -> Tensor:
            return pack(weight.t())

        out = [
            named["model.embed_tokens.weight"],
            named["model.norm.weight"].float(),
            packed(model.lm_head_weight.detach()),
        ]
        views: dict[int, tuple[Tensor, int]] = {
            id(model.lm_head_weight): (out[2], model.lm_head_weight.shape[0])
        }
        cfg = self.config
        for i in range(cfg.num_layers):
            pre = f"model.layers.{i}."
            attn, mlp = pre + "self_attn.", pre + "mlp."
            qkv = [attn + f"{x}_proj" for x in "qkv"]
            first = len(out)
            out += [
                named[pre + "input_layernorm.weight"].float(),
                cat_packed(*(x + ".weight" for x in qkv)),
                torch.cat([opt(x + ".bias") for x in qkv]) if qkv[0] + ".bias" in named else none,
                opt(attn + "q_norm.weight"),
                opt(attn + "k_norm.weight"),
                packed(named[attn + "o_proj.weight"]),
                opt(attn + "o_proj.bias"),
                named[pre + "post_attention_layernorm.weight"].float(),
                cat_packed(mlp + "gate_proj.weight", mlp + "up_proj.weight"),
                packed(named[mlp + "down_proj.weight"]),
            ]
            for fused, names in (
                (out[first + 1], qkv),
                (out[first + 8], [mlp + "gate_proj", mlp + "up_proj"]),
            ):
                views.update(_packed_views(fused, [params[n + ".weight"] for n in names], pack))
            for j, name in ((5, attn + "o_proj"), (9, mlp + "down_proj")):
                weight = params[name + ".weight"]
                views[id(weight)] = (out[first + j], weight.shape[0])
        self._fused = (versions, out)
        self._views = views
        return out

    def log_softmax(self, logits: Tensor) -> Tensor:
        """fp32 log_softmax over the last dim of [n, vocab], by the sampler's arithmetic (the
        kernels' own with them), so a rescored token's logprob equals the sampled one."""
        logits = logits.float()
        if self.kernels is not None and logits.device.type == "cpu":
            return self.kernels.log_softmax(logits.contiguous())
        return torch.log_softmax(logits, dim=-1)

    def _decode_plan(self, items: Sequence[ForwardItem]) -> _Plan | None:
        """The plan of a step made only of one-token decodes, built with a few list and numpy
        operations instead of a loop per item; None for any other step, or when a check
        fails (``_plan`` then raises the error that names the item)."""
        ids = [it.token_ids for it in items]
        if not ids or any(len(x) != 1 for x in ids):
            return None
        tokens = [x[0] for x in ids]
        starts = [it.start_pos for it in items]
        bs = self.block_size
        if (
            min(tokens) < 0
            or max(tokens) >= self.config.vocab_size
            or min(starts) < 0
            or max(starts) >= self.config.max_position
        ):
            return None
        width = max(starts) // bs + 1  # blocks the longest sequence attends over
        flat: list[int] = []
        for it, start in zip(items, starts, strict=True):
            table = it.block_table
            if len(table) * bs <= start:
                return None
            flat += table[:width]
            if len(table) < width:
                flat += [0] * (width - len(table))
        n = len(items)
        tables = np.fromiter(flat, dtype=np.int64, count=n * width).reshape(n, width)
        if tables.min() < 0 or tables.max() >= self.num_blocks:
            return None
        positions = np.array(starts, dtype=np.int64)
        slots = tables[np.arange(n), positions // bs] * bs + positions % bs
        if len(set(slots.tolist())) != n:
            return None
        return _Plan(
            token_ids=torch.from_numpy(np.array(tokens, dtype=np.int64)),
            positions=torch.from_numpy(positions),
            slots=torch.from_numpy(slots),
            offsets=list(range(n)),
            items=items,
            all_decodes=True,
            tables=torch.from_numpy(tables),
        )

    def _plan(self, items: Sequence[ForwardItem]) -> _Plan:
        bs, vocab, limit = self.block_size, self.config.vocab_size, self.config.max_position
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        offsets: list[int] = []
        prefill_keys = 0
        for i, item in enumerate(items):
            ids, start, table = item.token_ids, item.start_pos, item.block_table
            end = start + len(ids)
            if not ids or start < 0:
                raise ValueError(f"item {i}: needs >= 1 new token and start_pos >= 0")
            if min(ids) < 0 or max(ids) >= vocab:
                raise ValueError(f"item {i}: token id outside [0, {vocab})")
            if end > limit:
                raise ValueError(f"item {i}: position {end - 1} exceeds the model context {limit}")
            if len(table) * bs < end:
                raise ValueError(f"item {i}: block table too short for {end} positions")
            if min(table) < 0 or max(table) >= self.num_blocks:
                raise ValueError(f"item {i}: block id outside [0, {self.num_blocks})")
            offsets.append(len(tokens))
            if len(ids) > 1:
                prefill_keys += len(ids) * (start + (len(ids) + 1) // 2)
            tokens.extend(ids)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        if len(set(slots)) != len(slots):
            raise ValueError("two new tokens of this step map to the same KV slot")
        dev = self.device
        return _Plan(
            token_ids=_long(tokens, dev),
            positions=_long(positions, dev),
            slots=_long(slots, dev),
            offsets=offsets,
            items=items,
            all_decodes=len(tokens) == len(items),
            prefill_keys=prefill_keys,
        )

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        self._ensure_rope(int(positions.max()) + 1)
        cos = self._cos.index_select(0, positions).to(self.dtype).unsqueeze(1)
        return cos, self._sin.index_select(0, positions).to(self.dtype).unsqueeze(1)

    def _ensure_rope(self, need: int) -> None:
        """Extend the cos/sin tables to at least ``need`` positions."""
        while self._cos.shape[0] < need:
            start = self._cos.shape[0]
            pos = torch.arange(start, start + _ROPE_CHUNK, dtype=torch.float)
            freqs = pos[:, None] * self._inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1).to(self.device)
            self._cos = torch.cat((self._cos, emb.cos()))
            self._sin = torch.cat((self._sin, emb.sin()))

    def _table(self, table: Sequence[int], length: int) -> Tensor:
        """The ids of the blocks that hold positions 0..length-1 of one sequence."""
        return _long(table[: -(-length // self.block_size)], self.device)

    @staticmethod
    def gather_kv(
        k_cache: Tensor, v_cache: Tensor, blocks: Tensor, length: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """K and V of a layer's blocks ``blocks`` (int64 [..., nb]) in position order, cut to
        ``length`` positions: each [..., kv_heads, positions, head_dim] for SDPA, a view of
        contiguous position-major rows [..., positions, kv_heads, head_dim] (SDPA's CPU
        kernels round by the strides they get: every caller gets the same ones)."""
        rows_k, rows_v = _as_rows(k_cache, v_cache)
        # one gather each, straight into position-major rows [..., nb * block_size, kvh, hd]
        k, v = rows_k[blocks].flatten(-4, -3), rows_v[blocks].flatten(-4, -3)
        if length is not None:
            k, v = k[..., :length, :, :], v[..., :length, :, :]
        return k.contiguous().transpose(-3, -2), v.contiguous().transpose(-3, -2)

    @staticmethod
    def store_kv(k_cache: Tensor, v_cache: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Slot ``slots[t]`` of a layer's caches gets ``k[t]`` and ``v[t]`` ([T, kv_heads,
        head_dim]); the torch ops' way of the kernels' ``store_kv``."""
        bs = k_cache.shape[-1]
        rows_k, rows_v = _as_rows(k_cache, v_cache)
        rows_k[slots // bs, slots % bs] = k
        rows_v[slots // bs, slots % bs] = v

    # -- KV snapshots and weights ----------------------------------------------------------

    def _block_index(self, block_ids: Sequence[int]) -> Tensor:
        ids = list(block_ids)
        if any(b < 0 or b >= self.num_blocks for b in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"block ids must be distinct and in [0, {self.num_blocks})")
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def _rows_shape(self, n: int) -> tuple[int, ...]:
        """The shape of n blocks' K (or V) as read_blocks gives them."""
        cfg = self.config
        return (cfg.num_layers, n, self.block_size, cfg.num_kv_heads, cfg.head_dim)

    def read_blocks(self, block_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
        """Host copies of K and V of these blocks: each [layers, n, block_size, kv_heads, hd]
        (position-major, whatever the cache's own layout: snapshots keep this format)."""
        idx = self._block_index(block_ids)
        shape = self._rows_shape(len(idx))
        # gathered straight into the result (index_select then stack copied twice)
        k, v = torch.empty(shape, dtype=self.dtype), torch.empty(shape, dtype=self.dtype)
        for layer, caches in enumerate(zip(self.k_cache, self.v_cache, strict=True)):
            for t, rows in zip((k, v), _as_rows(*caches), strict=True):
                if rows.device.type == "cpu":
                    torch.index_select(rows, 0, idx, out=t[layer])
                else:  # one gather on the device, one copy to the host
                    t[layer].copy_(rows.index_select(0, idx))
        return k, v

    def write_blocks(self, block_ids: Sequence[int], k: Tensor, v: Tensor) -> None:
        """Restore blocks from :meth:`read_blocks` output, bit-exactly (dtype must match)."""
        idx = self._block_index(block_ids)
        want = self._rows_shape(len(idx))
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != want or t.dtype != self.dtype:
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)} {t.dtype}; expected {want} {self.dtype}"
                )
        for layer, (kc, vc) in enumerate(zip(self.k_cache, self.v_cache, strict=True)):
            rows_k, rows_v = _as_rows(kc, vc)
            rows_k.index_copy_(0, idx, k[layer].to(self.device))
            rows_v.index_copy_(0, idx, v[layer].to(self.device))

    def weight_packed(self, weight: Tensor) -> tuple[Tensor, int]:
        """``weight`` packed (the kernels' ``pack_weight`` of ``weight.T``) and its number of
        outputs: a slice of the fused packed copies of ``_fused_weights`` (its columns of the
        fused QKV or gate/up matrix), current as of the last check there."""
        return self._views[id(weight)]

    def weights_changed(self) -> None:
        """Drop what was derived from the weights (call after writing them in place)."""
        self._fused = None
        self._views = {}

    def state_dict(self) -> dict[str, Tensor]:
        """The live weights under checkpoint names (aliases, not copies)."""
        return {name: p.detach() for name, p in self.model.named_weights().items()}

    @torch.no_grad()
    def load_weights(
        self, weights: Mapping[str, Tensor] | str | Path, *, strict: bool = False
    ) -> None:
        """Copy tensors into the live parameters in place, all or nothing.

        A mapping must match names, shapes and dtypes exactly (a subset is a partial update
        unless ``strict``); a checkpoint directory is read like at load time and cast to the
        runner's dtype.  Raises ConfigError naming the first offending tensor; on error no
        weight has changed.  Call it between steps (the engine pauses first).
        """
        if isinstance(weights, str | Path):
            weights = read_tensors(weights, dtype=self.dtype)
            if self.model.lm_head is None:  # some tied checkpoints also store the head
                weights.pop("lm_head.weight", None)
        params = self.model.named_weights()
        aliases = (
            {"lm_head.weight": "model.embed_tokens.weight"} if self.model.lm_head is None else {}
        )
        plan: dict[str, tuple[Tensor, Tensor]] = {}
        for name, tensor in weights.items():
            canonical = aliases.get(name, name)
            target = params.get(canonical)
            if target is None or canonical in plan:
                why = "is given twice (tied)" if target is not None else "is unknown to this model"
                raise ConfigError(f"load_weights: tensor {name!r} {why}")
            if tensor.shape != target.shape:
                raise ConfigError(
                    f"load_weights: tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"the model has {tuple(target.shape)}"
                )
            if tensor.dtype != target.dtype:
                raise ConfigError(
                    f"load_weights: tensor {name!r} is {tensor.dtype}, the model runs in "
                    f"{target.dtype}; convert it first (a silent cast would break checksums)"
                )
            plan[canonical] = (target, tensor)
        missing = sorted(set(params) - set(plan))
        if strict and missing:
            raise ConfigError(f"load_weights(strict=True): tensor {missing[0]!r} is missing")
        for target, tensor in plan.values():
            target.copy_(tensor)
        self.weights_changed()
