"""``agentroll bench engine``: built-in engine tokens/s against transformers and vLLM.

The engine (A) and its baselines (B: ``transformers`` as one padded batch, then vLLM when
installed) alternate in ``--pairs`` pairs on the same requests.  ``ratio_vs_hf_batch``, the
main ratio, is the median of the per-pair ratios (``ratio_min``/``ratio_max``: its range),
``ratio_vs_vllm`` likewise; the other figures are unpaired (see ``main_engine``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import random
import resource
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch

from agentroll.backends.base import GenerationRequest, SamplingParams
from agentroll.bench.pairs import (
    DEFAULT_PAIRS,
    PairedRatio,
    alternate_async,
    check_pairs,
    median_side,
    paired_ratio,
)
from agentroll.bench.roofline import (
    Floor,
    StepCosts,
    decode_floor,
    peak_flops,
    read_bandwidth,
    step_costs,
)
from agentroll.engine.engine import default_threads
from agentroll.engine.models.decoder import read_config
from agentroll.errors import ConfigError
from agentroll.model.shapes import SHAPES, ensure_shape_model, get_shape, num_params
from agentroll.model.tiny import ensure_tiny_model
from agentroll.validate.common import sample_prompts

DEFAULT_PROMPT_LEN = 256  # tokens: a multi-turn tool episode's context after a few turns
REPEATS = 5  # timed repeats of the figures no ratio is taken of (after a warm-up): medians


def _log(msg: str) -> None:
    print(f"[bench engine] {msg}", flush=True)


def steady_window(arrivals: Sequence[Sequence[tuple[float, int]]]) -> tuple[int, float]:
    """The tokens and seconds of a streamed batch's steady state: from the moment the last
    request got its first token to the moment the first request got its last, when every
    request is decoding.  ``arrivals`` holds each request's deliveries as (time, tokens);
    tokens delivered after the window opens and up to its close count.  (0, 0.0) when the
    window is empty (a request finished before another started)."""
    if not arrivals or any(not a for a in arrivals):
        return 0, 0.0
    opens = max(a[0][0] for a in arrivals)
    closes = min(a[-1][0] for a in arrivals)
    if closes <= opens:
        return 0, 0.0
    tokens = sum(n for a in arrivals for t, n in a if opens < t <= closes)
    return tokens, closes - opens


@dataclass(frozen=True, slots=True)
class Phases:
    """One system's timings on one pair's prompts: a prefill-only batch (each request's
    first token) and a full batch of ``max_tokens`` per request on other prompts of the same
    count and length (so neither hits a prefix cache the other filled).  ``steady_tokens``
    and ``steady_s``: the full batch's steady state (``steady_window``), for a system that
    streams; 0 for one that does not (its decode runs every row in lock-step anyway)."""

    requests: int
    prompt_tokens: int  # of the prefill-only batch
    prefill_s: float
    generated: int  # tokens of the full batch
    full_s: float
    steady_tokens: int = 0
    steady_s: float = 0.0

    @staticmethod
    def of(
        pre: list[list[int]],
        prefill_s: float,
        full: list[list[int]],
        full_s: float,
        outs: list[list[int]],
        steady: tuple[int, float] = (0, 0.0),
    ) -> Phases:
        return Phases(
            len(full), sum(map(len, pre)), prefill_s, sum(map(len, outs)), full_s, *steady
        )

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens per second of the prefill-only batch."""
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else math.nan

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of the full batch, prefill included."""
        return self.generated / self.full_s if self.full_s > 0 else math.nan

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode tokens/s with every request decoding: the steady state where measured,
        else the tokens after each request's first over the full batch's time less the
        prefill-only batch's (``nan`` when nothing is left of either)."""
        if self.steady_s > 0 and self.steady_tokens > 0:
            return self.steady_tokens / self.steady_s
        return self.whole_decode_tokens_per_s

    @property
    def whole_decode_tokens_per_s(self) -> float:
        """The tokens after each request's first over the full batch's time less the
        prefill-only batch's: decode with its ramp-up and tail, where some requests are
        still in prefill or already done (``nan`` when nothing is left of either)."""
        decode_s, tokens = self.full_s - self.prefill_s, self.generated - self.requests
        return tokens / decode_s if decode_s > 0 and tokens > 0 else math.nan


class _Ours:
    """The built-in engine on ``prompts``, opened with ``async with``: ``rate`` times one
    batch of every prompt (after a warm-up batch), ``prefix_hit_rate`` a second turn."""

    def __init__(
        self,
        model: Path,
        prompts: list[list[int]],
        max_tokens: int,
        batch_invariant: bool,
        cpu_kernels: bool = True,
        threads: int | None = None,
        kv_cache_mb: int = 256,
        dtype: str = "float32",
    ) -> None:
        from agentroll.backends.torch import TorchBackend

        self.prompts = prompts
        self.params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
        self.backend = TorchBackend(
            model,
            batch_invariant=batch_invariant,
            max_num_seqs=max(64, len(prompts)),
            cpu_kernels=cpu_kernels,
            num_threads=threads,
            kv_cache_mb=kv_cache_mb,
            dtype=dtype,
        )
        self.last: list[list[int]] = []  # the replies of the last timed batch
        # each request's deliveries in the last batch: (time, tokens)
        self.arrivals: dict[str, list[tuple[float, int]]] = {}

    async def __aenter__(self) -> _Ours:
        await self.backend.__aenter__()
        await self._batch("w", self.prompts)  # warm-up
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.backend.__aexit__(*exc)

    async def _one(
        self, rid: str, prompt: list[int], seed: int, max_tokens: int | None = None
    ) -> list[int]:
        sampling = msgspec.structs.replace(
            self.params, seed=seed, max_tokens=max_tokens or self.params.max_tokens
        )
        req = GenerationRequest(request_id=rid, prompt_ids=prompt, sampling=sampling)
        out: list[int] = []
        arrived = self.arrivals.setdefault(rid, [])
        async for chunk in self.backend.generate(req):
            out += chunk.token_ids
            arrived.append((time.perf_counter(), len(chunk.token_ids)))
        return out

    async def _batch(
        self, tag: str, prompts: list[list[int]], max_tokens: int | None = None
    ) -> list[list[int]]:
        self.arrivals = {}
        return await asyncio.gather(
            *(self._one(f"{tag}-{i}", p, i, max_tokens) for i, p in enumerate(prompts))
        )

    async def phases(self, rep: int, pre: list[list[int]], full: list[list[int]]) -> Phases:
        """A prefill-only batch (``max_tokens=1``) of ``pre``, then a full batch of ``full``."""
        start = time.perf_counter()
        await self._batch(f"p{rep}", pre, 1)
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        outs = await self._batch(f"f{rep}", full)
        full_s = time.perf_counter() - start
        steady = steady_window(list(self.arrivals.values()))
        return Phases.of(pre, prefill_s, full, full_s, outs, steady)

    async def rate(self, rep: int) -> float:
        """Tokens/s of one timed batch of every prompt."""
        start = time.perf_counter()
        self.last = await self._batch(f"r{rep}", self.prompts)
        return sum(len(o) for o in self.last) / (time.perf_counter() - start)

    async def prefix_hit_rate(self) -> float:
        """The prefix-cache hit rate of each episode's second turn: prompt + the last
        batch's reply + a new user message."""
        bm = self.backend.engine.scheduler.block_manager
        q0, h0 = bm.num_prefix_queries, bm.num_prefix_hits
        tail = self.backend.tokenizer.encode(
            "<|im_end|>\n<|im_start|>user\nand then?<|im_end|>\n<|im_start|>assistant\n"
        )
        turn2 = [p + o + tail for p, o in zip(self.prompts, self.last, strict=True)]
        await self._batch("s", turn2)
        queries, hits = bm.num_prefix_queries - q0, bm.num_prefix_hits - h0
        return hits / queries if queries else math.nan


async def _ours(
    model: Path,
    prompts: list[list[int]],
    max_tokens: int,
    batch_invariant: bool,
    cpu_kernels: bool = True,
    threads: int | None = None,
) -> float:
    """Median tokens/s over ``REPEATS`` timed batches of the built-in engine (a figure no
    ratio is taken of, so it is not paired)."""
    async with _Ours(model, prompts, max_tokens, batch_invariant, cpu_kernels, threads) as ours:
        return statistics.median([await ours.rate(rep) for rep in range(REPEATS)])


class _HF:
    """``transformers`` on the same prompts, loaded and warmed up once; ``rate`` times one
    pass (one padded batch, or one request at a time with a KV cache)."""

    def __init__(self, model: Path, prompts: list[list[int]], max_tokens: int) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
        pad = self.hf.config.pad_token_id if self.hf.config.pad_token_id is not None else 0
        self.kwargs: dict[str, Any] = dict(
            max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=True, pad_token_id=pad
        )
        self.prompts = prompts
        self.width = max(len(p) for p in prompts)
        self.ids = torch.tensor([[pad] * (self.width - len(p)) + p for p in prompts])
        self.mask = torch.tensor([[0] * (self.width - len(p)) + [1] * len(p) for p in prompts])
        torch.manual_seed(0)
        with torch.no_grad():  # warm-up
            self.hf.generate(
                self.ids[:2], attention_mask=self.mask[:2], max_new_tokens=4, pad_token_id=pad
            )

    def phases(self, rep: int, pre: list[list[int]], full: list[list[int]]) -> Phases:
        """``generate`` of ``pre`` for one token, then of ``full`` (one batch each; the
        prompts of each batch have one length, so no padding)."""
        with torch.no_grad():
            start = time.perf_counter()
            ids = torch.tensor(pre)
            self.hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                **{**self.kwargs, "max_new_tokens": 1, "min_new_tokens": 1},
            )
            prefill_s = time.perf_counter() - start
            start = time.perf_counter()
            ids = torch.tensor(full)
            out = self.hf.generate(ids, attention_mask=torch.ones_like(ids), **self.kwargs)
            full_s = time.perf_counter() - start
        gen = [row.tolist() for row in out[:, len(full[0]) :]]
        return Phases.of(pre, prefill_s, full, full_s, gen)

    def rate(self, batched: bool) -> float:
        """Tokens/s of one pass over every prompt."""
        with torch.no_grad():
            start = time.perf_counter()
            if batched:
                out = self.hf.generate(self.ids, attention_mask=self.mask, **self.kwargs)
                tokens = int(out.shape[1] - self.width) * len(self.prompts)
            else:
                tokens = sum(
                    int(self.hf.generate(torch.tensor([p]), **self.kwargs).shape[1]) - len(p)
                    for p in self.prompts
                )
            return tokens / (time.perf_counter() - start)


def _best_of(fn: Any, calls: int = 200) -> float:
    """Seconds per call of ``fn``: the best of three runs of ``calls`` calls."""
    best = math.inf
    with torch.inference_mode():
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - start) / calls)
    return best


def _matmul_floor(model: Path, rows: int, steps: int = 200) -> float:
    """Tokens/s of decode steps made of the model's matmuls alone (see the module doc)."""
    from agentroll.engine.models.decoder import load_model

    m = load_model(model)
    # the products of a step: each linear layer on its own, and q/k/v and gate/up also as one
    # product over their weights side by side (the engine's fused layout)
    named = m.named_weights()

    def pair(name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        return named[f"{name}.weight"], named.get(f"{name}.bias")

    groups: list[list[tuple[torch.Tensor, torch.Tensor | None]]] = []
    for i in range(m.config.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        groups.append([pair(attn + f"{x}_proj") for x in "qkv"])
        groups.append([pair(attn + "o_proj")])
        groups.append([pair(mlp + "gate_proj"), pair(mlp + "up_proj")])
        groups.append([pair(mlp + "down_proj")])
    groups.append([(m.lm_head_weight, None)])
    # each product the fastest of the ways available here: torch on the weight as stored, torch
    # on a transposed copy, the engine kernels' blocked products on that copy (what the engine
    # runs), and, for a group, the fastest of these over the fused weight
    from agentroll.engine import kernels

    ext = kernels.get()

    def ways(weight: torch.Tensor, bias: torch.Tensor | None) -> list[Any]:
        x, wt = torch.randn(rows, weight.shape[1]), weight.detach().t().contiguous()
        out = [
            lambda: torch.nn.functional.linear(x, weight, bias),
            lambda: torch.mm(x, wt) if bias is None else torch.addmm(bias, x, wt),
        ]
        if ext is not None:
            out.append(lambda: ext.linear(x, wt, bias, 0))
        return out

    products: list[Any] = []
    with torch.inference_mode():
        for group in groups:
            apart = [min(ways(w, b), key=_best_of) for w, b in group]
            if len(group) > 1:
                biases = [b for _, b in group]
                bias = (
                    None if biases[0] is None else torch.cat([b for b in biases if b is not None])
                )
                fused = min(ways(torch.cat([w for w, _ in group]), bias), key=_best_of)
                if _best_of(fused) < sum(_best_of(p) for p in apart):
                    apart = [fused]
            products += apart

    def step() -> None:
        for product in products:
            product()

    rates = []
    with torch.inference_mode():
        for _ in range(20):
            step()  # warm-up
        for _ in range(REPEATS):
            start = time.perf_counter()
            for _ in range(steps):
                step()
            rates.append(rows * steps / (time.perf_counter() - start))
    return statistics.median(rates)


class _VLLM:
    """vLLM's offline ``LLM`` on the same prompts, started and warmed up once; ``rate``
    times one ``generate`` of every prompt."""

    def __init__(
        self,
        model: Path,
        prompts: list[list[int]],
        max_tokens: int,
        threads: int | None = None,
        kv_gib: int = 1,
        max_model_len: int | None = None,
    ) -> None:
        import vllm

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_gib))  # GiB
        if threads is not None:
            # vLLM's CPU worker takes its OpenMP threads from this core list (its default,
            # "auto", keeps one core per NUMA node for its scheduler: 1 thread on 2 cores) and
            # then ignores torch.set_num_threads; a list of `threads` cores pins it like the rest
            cpus = sorted(os.sched_getaffinity(0))[:threads]
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
        kwargs: dict[str, Any] = {}
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if not torch.cuda.is_available():
            # on the CPU this reserves a fraction of host memory at startup and refuses to
            # start when that much is not free (this process holds the other systems already)
            kwargs["gpu_memory_utilization"] = 0.3
        self.llm = vllm.LLM(model=str(model), dtype="float32", enforce_eager=True, **kwargs)
        # no detokenisation: a shape's vocabulary is larger than the project tokenizer's.  No
        # per-request seed: vLLM 0.32's CPU worker dies ("CPU Generator does not use offset")
        # when a seeded request's prefill is split into chunks, as 32 prompts of 256 are
        self.sp = vllm.SamplingParams(
            temperature=1.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
        )
        self.sp1 = vllm.SamplingParams(
            temperature=1.0, max_tokens=1, ignore_eos=True, detokenize=False
        )
        self.inputs: Any = [{"prompt_token_ids": p} for p in prompts]
        self.llm.generate(self.inputs, self.sp)  # warm-up

    @staticmethod
    def start(
        model: Path, prompts: list[list[int]], max_tokens: int, **kwargs: Any
    ) -> _VLLM | None:
        """The started system, or None when vLLM is not installed."""
        try:
            import vllm  # noqa: F401
        except ImportError:
            return None
        return _VLLM(model, prompts, max_tokens, **kwargs)

    def phases(self, rep: int, pre: list[list[int]], full: list[list[int]]) -> Phases:
        """One ``generate`` of ``pre`` for one token, then one of ``full``."""
        start = time.perf_counter()
        self.llm.generate([{"prompt_token_ids": p} for p in pre], self.sp1, use_tqdm=False)
        prefill_s = time.perf_counter() - start
        full_s, gen, arrivals = self._streamed(f"bench-{rep}", full)
        return Phases.of(pre, prefill_s, full, full_s, gen, steady_window(arrivals))

    def _streamed(
        self, tag: str, prompts: list[list[int]]
    ) -> tuple[float, list[list[int]], list[list[tuple[float, int]]]]:
        """``generate``'s loop with each step's new tokens timed as they come back: the
        seconds, each request's tokens and its deliveries (time, tokens)."""
        from vllm.sampling_params import RequestOutputKind

        sp = self.sp.clone()
        sp.output_kind = RequestOutputKind.DELTA
        engine = self.llm.llm_engine
        ids = [f"{tag}-{i}" for i in range(len(prompts))]
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        arrivals: dict[str, list[tuple[float, int]]] = {rid: [] for rid in ids}
        start = time.perf_counter()
        for rid, prompt in zip(ids, prompts, strict=True):
            engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
        while engine.has_unfinished_requests():
            for out in engine.step():
                new = list(out.outputs[0].token_ids)
                if new:  # out.request_id: the id given to add_request
                    tokens[out.request_id] += new
                    arrivals[out.request_id].append((time.perf_counter(), len(new)))
        full_s = time.perf_counter() - start
        return full_s, [tokens[rid] for rid in ids], [arrivals[rid] for rid in ids]

    def rate(self) -> float:
        start = time.perf_counter()
        outs = self.llm.generate(self.inputs, self.sp)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return tokens / (time.perf_counter() - start)


def phase_prompts(ids: list[int], n: int, length: int, seed: str) -> list[list[int]]:
    """``n`` prompts of ``length`` ids drawn from ``ids`` by a generator seeded with ``seed``
    (random token strings share no prefix, so no prefix cache shortens a prefill)."""
    rng = random.Random(seed)
    return [[rng.choice(ids) for _ in range(length)] for _ in range(n)]


@dataclass(frozen=True, slots=True)
class _Roofline:
    """The decode floor and the rates it was computed from, measured in this run."""

    costs: StepCosts
    floor: Floor
    read_bytes_per_s: float
    fp32_flops: float
    bf16_flops: float


def _roofline(model: Path, batch: int, dtype: str = "float32") -> _Roofline:
    """Read bandwidth and peak fp32/bf16 gemm rates on the current torch threads, and the
    decode floor of ``model`` at ``batch`` rows with ``dtype`` weights (float32 or
    bfloat16: that dtype's bytes and gemm peak) from them."""
    bandwidth = read_bandwidth()
    fp32, bf16 = peak_flops(torch.float32), peak_flops(torch.bfloat16)
    costs = step_costs(read_config(model), batch, dtype)
    peak = bf16 if dtype == "bfloat16" else fp32
    return _Roofline(costs, decode_floor(costs, batch, bandwidth, peak), bandwidth, fp32, bf16)


def roofline_fields(
    decodes: Sequence[float], roofs: Sequence[_Roofline], prefix: str = ""
) -> dict[str, str]:
    """A result line's floor keys from each pair's decode tokens/s and the roofline measured
    beside it: the fraction is the median of each pair's decode over its own pair's floor
    (with its range), the floor and read bandwidth are medians over the pairs and the bound
    is the most pairs'.  ``prefix`` names the floor ("bf16_")."""
    of_floor = paired_ratio(
        [(d, r.floor.tokens_per_s) for d, r in zip(decodes, roofs, strict=True)]
    )
    read = [r.read_bytes_per_s / 1e9 for r in roofs]
    return {
        f"{prefix}floor_tokens_per_s": f"{median_side([r.floor.tokens_per_s for r in roofs]):.1f}",
        "bound": Counter(r.floor.bound for r in roofs).most_common(1)[0][0],
        f"{prefix}floor_fraction": f"{of_floor.ratio:.3f}",
        f"{prefix}floor_fraction_min": f"{of_floor.ratio_min:.3f}",
        f"{prefix}floor_fraction_max": f"{of_floor.ratio_max:.3f}",
        "read_gbps": f"{median_side(read):.2f}",
        "read_gbps_min": f"{min(read):.2f}",
        "read_gbps_max": f"{max(read):.2f}",
    }


@dataclass(frozen=True, slots=True)
class _Phased:
    """Prefill and decode of every system per pair, and the roofline measured beside each
    pair's engine side (this VM's bandwidth moves by 2x within the hour, so a floor measured
    once would set every pair against one moment's rate)."""

    ours: list[Phases]
    hf: list[Phases | None]
    vllm: list[Phases | None]
    roofs: list[_Roofline]

    @staticmethod
    def median(runs: Sequence[Phases | None], figure: str) -> float:
        return median_side([getattr(r, figure) for r in runs if r is not None])

    def ratio(self, figure: str, baseline: str) -> PairedRatio:
        """The per-pair ratio of the engine's ``figure`` over ``baseline``'s (nan without)."""
        other: Sequence[Phases | None] = self.hf if baseline == "hf" else self.vllm
        return paired_ratio(
            [
                (getattr(a, figure), getattr(b, figure) if b is not None else math.nan)
                for a, b in zip(self.ours, other, strict=True)
            ]
        )


async def _phased(
    model: Path,
    ids: list[int],
    requests: int,
    prompt_len: int,
    max_tokens: int,
    pairs: int,
    threads: int,
    hf: bool = True,
) -> _Phased:
    """The engine (A) and its baselines (B: transformers batched unless ``hf`` is false,
    then vLLM) in ``pairs`` alternating pairs of prefill-only and full batches, every pair on
    new prompts (the same for every system in the pair); every system loaded and warmed up
    before the first.  Right after the engine's side of each pair, with every system idle,
    the roofline's rates are measured on the same threads."""
    cfg = read_config(model)
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    context = prompt_len + max_tokens + 16  # a block of slack per request
    kv_bytes = requests * context * kv_per_token
    warm = phase_prompts(ids, requests, prompt_len, "warm-up")
    ours = _Ours(
        model,
        warm,
        max_tokens,
        batch_invariant=False,
        threads=threads,
        kv_cache_mb=max(256, math.ceil(1.25 * kv_bytes / 2**20)),
    )
    async with ours:
        hf_batch = _HF(model, warm, max_tokens) if hf else None
        llm = _VLLM.start(
            model,
            warm,
            max_tokens,
            threads=threads,
            kv_gib=math.ceil(1.25 * kv_bytes / 2**30),
            max_model_len=context,
        )

        def prompts(i: int, phase: str) -> list[list[int]]:
            return phase_prompts(ids, requests, prompt_len, f"{i}-{phase}")

        seen: list[Phases] = []
        roofs: list[_Roofline] = []

        async def engine(i: int) -> Phases:
            seen.append(await ours.phases(i, prompts(i, "pre"), prompts(i, "full")))
            roofs.append(_roofline(model, requests))
            return seen[-1]

        async def baselines(i: int) -> tuple[Phases | None, Phases | None]:
            pre, full = prompts(i, "pre"), prompts(i, "full")
            h = hf_batch.phases(i, pre, full) if hf_batch is not None else None
            v = llm.phases(i, pre, full) if llm is not None else None
            nan = math.nan
            _log(
                f"pair {i + 1}/{pairs} (prefill / decode tokens/s): built-in engine "
                f"{seen[-1].prefill_tokens_per_s:.1f} / {seen[-1].decode_tokens_per_s:.1f} "
                f"(floor {roofs[-1].floor.tokens_per_s:.1f}: "
                f"{roofs[-1].read_bytes_per_s / 1e9:.1f} GB/s, "
                f"{roofs[-1].fp32_flops / 1e9:.0f} GFLOP/s), "
                f"transformers batched {h.prefill_tokens_per_s if h else nan:.1f} / "
                f"{h.decode_tokens_per_s if h else nan:.1f}, vllm "
                f"{v.prefill_tokens_per_s if v else nan:.1f} / "
                f"{v.decode_tokens_per_s if v else nan:.1f}"
            )
            return h, v

        measured = await alternate_async(engine, baselines, pairs)
    return _Phased(
        ours=[a for a, _ in measured],
        hf=[h for _, (h, _) in measured],
        vllm=[v for _, (_, v) in measured],
        roofs=roofs,
    )


def phase_fields(ph: _Phased) -> dict[str, Any]:
    """The result line's prefill/decode and roofline keys (see ``main_engine``)."""
    decode = _Phased.median(ph.ours, "decode_tokens_per_s")
    vs_vllm = ph.ratio("decode_tokens_per_s", "vllm")
    return {
        "prefill_tokens_per_s": f"{_Phased.median(ph.ours, 'prefill_tokens_per_s'):.1f}",
        "decode_tokens_per_s": f"{decode:.1f}",
        "hf_batch_prefill_tokens_per_s": f"{_Phased.median(ph.hf, 'prefill_tokens_per_s'):.1f}",
        "hf_batch_decode_tokens_per_s": f"{_Phased.median(ph.hf, 'decode_tokens_per_s'):.1f}",
        "vllm_prefill_tokens_per_s": f"{_Phased.median(ph.vllm, 'prefill_tokens_per_s'):.1f}",
        "vllm_decode_tokens_per_s": f"{_Phased.median(ph.vllm, 'decode_tokens_per_s'):.1f}",
        "decode_ratio_vs_hf_batch": f"{ph.ratio('decode_tokens_per_s', 'hf').ratio:.2f}",
        "decode_ratio_vs_vllm": f"{vs_vllm.ratio:.2f}",
        "decode_ratio_vs_vllm_min": f"{vs_vllm.ratio_min:.2f}",
        "decode_ratio_vs_vllm_max": f"{vs_vllm.ratio_max:.2f}",
        # decode with its ramp-up and tail (the full batch less the prefill-only batch)
        "whole_decode_tokens_per_s": f"{_Phased.median(ph.ours, 'whole_decode_tokens_per_s'):.1f}",
        "vllm_whole_decode_tokens_per_s": (
            f"{_Phased.median(ph.vllm, 'whole_decode_tokens_per_s'):.1f}"
        ),
        "whole_decode_ratio_vs_vllm": f"{ph.ratio('whole_decode_tokens_per_s', 'vllm').ratio:.2f}",
        **roofline_fields([a.decode_tokens_per_s for a in ph.ours], ph.roofs),
        "weight_mb": f"{ph.roofs[0].costs.weight_bytes / 1e6:.1f}",
        "peak_gflops": f"{median_side([r.fp32_flops / 1e9 for r in ph.roofs]):.1f}",
        "peak_bf16_gflops": f"{median_side([r.bf16_flops / 1e9 for r in ph.roofs]):.1f}",
    }


def _line(fields: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in fields.items())


def _valid_ids(model: Path) -> list[int]:
    """Prompt ids: the tokenizer's ordinary tokens (a shape's vocabulary may be larger)."""
    from agentroll.model.tokenizer import SPECIAL_TOKENS, TAG_TOKENS

    tok = json.loads((model / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    special = set(SPECIAL_TOKENS) | set(TAG_TOKENS)
    return sorted(i for t, i in vocab.items() if t not in special)


@dataclass(frozen=True, slots=True)
class _Paired:
    """The paired figures: the engine against transformers batched (the main ratio) and
    against vLLM, each side the median over the pairs."""

    ours: float
    hf_batch: float
    vllm: float
    vs_hf_batch: PairedRatio
    vs_vllm: PairedRatio
    prefix_hit_rate: float


async def _paired(
    model: Path,
    prompts: list[list[int]],
    max_tokens: int,
    pairs: int,
    threads: int | None = None,
) -> _Paired:
    """The engine (A) and its baselines (B: transformers batched, then vLLM when installed)
    in ``pairs`` alternating pairs, every system loaded and warmed up before the first."""
    async with _Ours(model, prompts, max_tokens, batch_invariant=False, threads=threads) as ours:
        hf = _HF(model, prompts, max_tokens)
        llm = _VLLM.start(model, prompts, max_tokens, threads=threads)

        seen: list[float] = []  # the engine's rates, for the progress line

        async def engine(i: int) -> float:
            seen.append(await ours.rate(i))
            return seen[-1]

        async def baselines(i: int) -> tuple[float, float]:
            hf_rate = hf.rate(batched=True)
            vllm_rate = llm.rate() if llm is not None else math.nan
            _log(
                f"pair {i + 1}/{pairs}: built-in engine {seen[-1]:.1f}, transformers batched "
                f"{hf_rate:.1f}, vllm {vllm_rate:.1f} tokens/s"
            )
            return hf_rate, vllm_rate

        measured = await alternate_async(engine, baselines, pairs)
        hit_rate = await ours.prefix_hit_rate()
    return _Paired(
        ours=median_side([a for a, _ in measured]),
        hf_batch=median_side([b for _, (b, _) in measured]),
        vllm=median_side([v for _, (_, v) in measured]),
        vs_hf_batch=paired_ratio([(a, b) for a, (b, _) in measured]),
        vs_vllm=paired_ratio([(a, v) for a, (_, v) in measured]),
        prefix_hit_rate=hit_rate,
    )


def main_engine(
    concurrency: int,
    max_tokens: int,
    model_dir: str | None = None,
    threads: int | None = None,
    pairs: int = DEFAULT_PAIRS,
    shape: str = "tiny",
    prompt_len: int = DEFAULT_PROMPT_LEN,
    hf: bool = True,
) -> None:
    """Run the bench and print progress lines, then one ``key=value`` result line.

    Every system generates exactly ``max_tokens`` tokens per request (end-of-sequence
    ignored), so tokens/s compare like with like, on ``threads`` torch threads (vLLM's
    OpenMP threads pinned to as many cores; default: the engine's own choice).

    ``--shape tiny`` (the default) keeps the tiny model's figures: ``tokens_per_s``,
    ``hf_batch_tokens_per_s`` and ``vllm_tokens_per_s`` (``nan`` without vLLM, and then
    ``ratio_vs_vllm`` too) are each side's median over the pairs on short chat prompts
    repeated batch after batch (prefix cache warm), every system loaded and warmed up before
    the first pair.  Unpaired, as no ratio is taken of them: the engine in the
    batch-invariant mode the parity checks run in and with its C++ CPU kernels off
    (``torch_ops_tokens_per_s``; ``cpu_kernels=0`` says they could not be built here, and
    then every engine figure is on torch ops), medians of ``REPEATS`` runs; ``transformers``
    one request at a time with a KV cache, one pass.  ``matmul_floor_tokens_per_s``: the
    tokens/s of a step doing nothing but the model's matrix products, weights warm in cache.

    Every shape then runs the prefill/decode pairs: per pair, new random prompts of
    ``prompt_len`` valid token ids; each system times a prefill-only batch (``max_tokens=1``:
    ``prefill_tokens_per_s`` = prompt tokens / its time) and a full batch on other prompts of
    the same size.  ``decode_tokens_per_s`` is the full batch's steady state, where every
    request decodes (``steady_window``: the tokens streamed between the last request's first
    token and the first request's last, over that time; vLLM's is streamed from its engine's
    own step loop), the state the floor describes; transformers decodes its padded batch in
    lock-step, so its decode is the tokens after each request's first / (full time -
    prefill-only time).  ``whole_decode_tokens_per_s`` (and vLLM's) is that whole-batch
    figure for the streaming systems too: decode with its ramp-up and tail, where some
    requests are still in prefill or already done.  For real shapes ``tokens_per_s`` and the
    ``ratio_vs_*`` keys come from the full batches (generated tokens / wall time, prefill
    included).  The floor is measured in every pair, right after the engine's side, on the
    same threads with every system idle: ``concurrency / max(weight_mb / read_gbps, 2 * matmul
    params * concurrency / peak_gflops)`` (fp32 weights read once, the LM head included, the
    embedding gather and attention excluded).  ``floor_fraction`` is the median over the pairs
    of the engine's decode over its own pair's floor (``_min``/``_max`` their range);
    ``floor_tokens_per_s``, ``read_gbps`` (with its range) and ``peak_gflops`` are medians
    over the pairs, ``bound`` the side that sets most pairs' floors.  ``hf=False``
    (``--no-hf``) leaves transformers out, for a shape whose three copies of the weights do
    not fit in memory together; its keys are then ``nan``.
    """
    model = (
        ensure_tiny_model(model_dir)
        if shape == "tiny"
        else Path(model_dir)
        if model_dir
        else ensure_shape_model(shape, progress=_log)
    )
    cfg = read_config(model)
    threads = threads or default_threads(cfg)
    torch.set_num_threads(threads)
    from agentroll.chat import ChatTokenizer
    from agentroll.engine import kernels

    ids = _valid_ids(model)
    _log(
        f"shape={shape} model={model} params={num_params(cfg)} requests={concurrency} "
        f"prompt_len={prompt_len} max_tokens={max_tokens} torch_threads={threads} pairs={pairs}"
    )
    fields: dict[str, Any] = {}
    if shape == "tiny":
        prompts = sample_prompts(ChatTokenizer.from_pretrained(model), concurrency)
        p = asyncio.run(_paired(model, prompts, max_tokens, pairs, threads))
        _log(f"built-in engine (default mode): {p.ours:.1f} tokens/s")
        _log(f"transformers batched: {p.hf_batch:.1f} tokens/s; vllm: {p.vllm:.1f} tokens/s")
        gc.collect()  # the paired systems' models and caches go before the next ones load
        invariant = asyncio.run(_ours(model, prompts, max_tokens, True, True, threads))
        _log(f"built-in engine (batch-invariant mode): {invariant:.1f} tokens/s")
        have_kernels = kernels.get() is not None
        torch_ops = asyncio.run(_ours(model, prompts, max_tokens, False, False, threads))
        _log(f"built-in engine on plain torch ops (no C++ kernels): {torch_ops:.1f} tokens/s")
        hf_seq = _HF(model, prompts, max_tokens).rate(batched=False)  # one pass: slow, steady
        _log(f"transformers one at a time: {hf_seq:.1f} tokens/s")
        floor = _matmul_floor(model, concurrency)
        _log(f"the model's matmuls alone (an upper bound for any engine): {floor:.1f} tokens/s")
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        r = p.vs_hf_batch
        fields = {
            "tokens_per_s": f"{p.ours:.1f}",
            "hf_seq_tokens_per_s": f"{hf_seq:.1f}",
            "hf_batch_tokens_per_s": f"{p.hf_batch:.1f}",
            "ratio_vs_hf_batch": f"{r.ratio:.2f}",
            "vllm_tokens_per_s": f"{p.vllm:.1f}",
            "ratio_vs_vllm": f"{p.vs_vllm.ratio:.2f}",
            "batch_invariant_tokens_per_s": f"{invariant:.1f}",
            "torch_ops_tokens_per_s": f"{torch_ops:.1f}",
            "cpu_kernels": int(have_kernels),
            "prefix_hit_rate": f"{p.prefix_hit_rate:.3f}",
            "peak_rss_mb": f"{rss:.1f}",
            "matmul_floor_tokens_per_s": f"{floor:.1f}",
            "floor_ratio_vs_hf_batch": f"{floor / p.hf_batch:.2f}",
            "pairs": r.pairs,
            "ratio_min": f"{r.ratio_min:.2f}",
            "ratio_max": f"{r.ratio_max:.2f}",
            "ratio_vs_vllm_min": f"{p.vs_vllm.ratio_min:.2f}",
            "ratio_vs_vllm_max": f"{p.vs_vllm.ratio_max:.2f}",
        }
        gc.collect()
    ph = asyncio.run(
        _phased(model, ids, concurrency, prompt_len, max_tokens, pairs, threads, hf=hf)
    )
    if shape != "tiny":
        vs_hf, vs_vllm = ph.ratio("tokens_per_s", "hf"), ph.ratio("tokens_per_s", "vllm")
        fields = {
            "tokens_per_s": f"{_Phased.median(ph.ours, 'tokens_per_s'):.1f}",
            "hf_batch_tokens_per_s": f"{_Phased.median(ph.hf, 'tokens_per_s'):.1f}",
            "ratio_vs_hf_batch": f"{vs_hf.ratio:.2f}",
            "vllm_tokens_per_s": f"{_Phased.median(ph.vllm, 'tokens_per_s'):.1f}",
            "ratio_vs_vllm": f"{vs_vllm.ratio:.2f}",
            "cpu_kernels": int(kernels.get() is not None),
            "peak_rss_mb": f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f}",
            "pairs": vs_vllm.pairs,
            "ratio_min": f"{vs_hf.ratio_min:.2f}",
            "ratio_max": f"{vs_hf.ratio_max:.2f}",
            "ratio_vs_vllm_min": f"{vs_vllm.ratio_min:.2f}",
            "ratio_vs_vllm_max": f"{vs_vllm.ratio_max:.2f}",
        }
    roof = ph.roofs[len(ph.roofs) // 2]
    _log(
        f"floor of pair {len(ph.roofs) // 2 + 1}: {roof.floor.tokens_per_s:.1f} tokens/s "
        f"({roof.floor.bound}-bound: weights {roof.floor.memory_s * 1e3:.2f} ms, matmuls "
        f"{roof.floor.compute_s * 1e3:.2f} ms a step)"
    )
    fields |= {
        "shape": shape,
        "params": num_params(cfg),
        "threads": threads,
        "concurrency": concurrency,
        "prompt_len": prompt_len,
        "max_tokens": max_tokens,
        **phase_fields(ph),
    }
    print(_line(fields))


def row_name(args: argparse.Namespace) -> str:
    """The results-table row of a run: ``engine`` for the tiny shape, ``engine:SHAPE``
    otherwise, and ``engine:SHAPE:cN`` at a concurrency other than 32, so each shape and
    batch size keeps its own current row."""
    if args.shape == "tiny":
        return "engine"
    concurrency = getattr(args, "concurrency", 32)
    return f"engine:{args.shape}" + (f":c{concurrency}" if concurrency != 32 else "")


# -- command line --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineBenchConfig:
    """The options of ``agentroll bench engine``; requests, tokens and threads are >= 1."""

    concurrency: int
    max_tokens: int
    model: str | None
    threads: int | None  # None: the engine's own choice for the model
    pairs: int = DEFAULT_PAIRS
    shape: str = "tiny"
    prompt_len: int = DEFAULT_PROMPT_LEN
    hf: bool = True  # transformers measured too

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.max_tokens < 1:
            raise ConfigError(
                f"--concurrency and --max-tokens must be >= 1 (got {self.concurrency} and "
                f"{self.max_tokens}); pass positive counts"
            )
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1 (got {self.threads})")
        if self.prompt_len < 1:
            raise ConfigError(f"--prompt-len must be >= 1 (got {self.prompt_len})")
        get_shape(self.shape)
        check_pairs(self.pairs)
        if not self.hf and self.shape == "tiny":
            raise ConfigError("--no-hf is for real shapes; drop it for --shape tiny")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--model", default=None, help="checkpoint dir (default: the --shape's, created if missing)"
    )
    parser.add_argument(
        "--shape",
        default="tiny",
        choices=sorted(SHAPES),
        help="model shape: seeded random weights, created once and cached (default: tiny)",
    )
    parser.add_argument(
        "--prompt-len",
        type=int,
        default=DEFAULT_PROMPT_LEN,
        help="prompt tokens per request of the prefill/decode pairs",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads for every system measured, vLLM's pinned too (default: the engine's "
        "choice: 1 below 64 MiB of weights, every core above)",
    )
    parser.add_argument(
        "--pairs",
        type=int,
        default=DEFAULT_PAIRS,
        help="alternating timed runs (engine, baselines), at least 5; ratios are their medians",
    )
    parser.add_argument(
        "--no-hf",
        dest="hf",
        action="store_false",
        help="leave transformers out (its own copy of the weights): for a shape whose three "
        "copies do not fit in memory together; its keys are then nan",
    )


def main(args: argparse.Namespace) -> int:
    """CLI entry: run the bench (progress lines first) and print its result line."""
    config = EngineBenchConfig(
        args.concurrency,
        args.max_tokens,
        args.model,
        args.threads,
        args.pairs,
        args.shape,
        args.prompt_len,
        args.hf,
    )
    main_engine(
        config.concurrency,
        config.max_tokens,
        config.model,
        config.threads,
        config.pairs,
        config.shape,
        config.prompt_len,
        config.hf,
    )
    return 0
