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
import math
import os
import resource
import statistics
import time
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
from agentroll.errors import ConfigError
from agentroll.model.tiny import ensure_tiny_model
from agentroll.validate.common import sample_prompts

REPEATS = 5  # timed repeats of the figures no ratio is taken of (after a warm-up): medians


def _log(msg: str) -> None:
    print(f"[bench engine] {msg}", flush=True)


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
    ) -> None:
        from agentroll.backends.torch import TorchBackend

        self.prompts = prompts
        self.params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
        self.backend = TorchBackend(
            model,
            batch_invariant=batch_invariant,
            max_num_seqs=max(64, len(prompts)),
            cpu_kernels=cpu_kernels,
        )
        self.last: list[list[int]] = []  # the replies of the last timed batch

    async def __aenter__(self) -> _Ours:
        await self.backend.__aenter__()
        await self._batch("w", self.prompts)  # warm-up
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.backend.__aexit__(*exc)

    async def _one(self, rid: str, prompt: list[int], seed: int) -> list[int]:
        sampling = msgspec.structs.replace(self.params, seed=seed)
        req = GenerationRequest(request_id=rid, prompt_ids=prompt, sampling=sampling)
        out: list[int] = []
        async for chunk in self.backend.generate(req):
            out += chunk.token_ids
        return out

    async def _batch(self, tag: str, prompts: list[list[int]]) -> list[list[int]]:
        return await asyncio.gather(*(self._one(f"{tag}-{i}", p, i) for i, p in enumerate(prompts)))

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
) -> float:
    """Median tokens/s over ``REPEATS`` timed batches of the built-in engine (a figure no
    ratio is taken of, so it is not paired)."""
    async with _Ours(model, prompts, max_tokens, batch_invariant, cpu_kernels) as ours:
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

    def __init__(self, model: Path, prompts: list[list[int]], max_tokens: int) -> None:
        import vllm

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the tiny model needs little
        kwargs: dict[str, Any] = {}
        if not torch.cuda.is_available():
            # on the CPU this reserves a fraction of host memory at startup and refuses to
            # start when that much is not free (this process holds the other systems already)
            kwargs["gpu_memory_utilization"] = 0.3
        self.llm = vllm.LLM(model=str(model), dtype="float32", enforce_eager=True, **kwargs)
        self.sp = vllm.SamplingParams(
            temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=0
        )
        self.inputs: Any = [{"prompt_token_ids": p} for p in prompts]
        self.llm.generate(self.inputs, self.sp)  # warm-up

    @staticmethod
    def start(model: Path, prompts: list[list[int]], max_tokens: int) -> _VLLM | None:
        """The started system, or None when vLLM is not installed."""
        try:
            import vllm  # noqa: F401
        except ImportError:
            return None
        return _VLLM(model, prompts, max_tokens)

    def rate(self) -> float:
        start = time.perf_counter()
        outs = self.llm.generate(self.inputs, self.sp)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return tokens / (time.perf_counter() - start)


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


async def _paired(model: Path, prompts: list[list[int]], max_tokens: int, pairs: int) -> _Paired:
    """The engine (A) and its baselines (B: transformers batched, then vLLM when installed)
    in ``pairs`` alternating pairs, every system loaded and warmed up before the first."""
    async with _Ours(model, prompts, max_tokens, batch_invariant=False) as ours:
        hf = _HF(model, prompts, max_tokens)
        llm = _VLLM.start(model, prompts, max_tokens)

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
    threads: int = 1,
    pairs: int = DEFAULT_PAIRS,
) -> None:
    """Run the bench and print progress lines, then one ``key=value`` result line.

    Every system generates exactly ``max_tokens`` tokens per request (end-of-sequence
    ignored), so tokens/s compare like with like.  ``tokens_per_s``, ``hf_batch_tokens_per_s``
    and ``vllm_tokens_per_s`` (``nan`` without vLLM, and then ``ratio_vs_vllm`` too) are each
    side's median over the pairs, every system loaded and warmed up before the first pair.
    Unpaired, as no ratio is taken of them: the engine in the batch-invariant mode the parity
    checks run in and with its C++ CPU kernels off (``torch_ops_tokens_per_s``;
    ``cpu_kernels=0`` says they could not be built here, and then every engine figure is on
    torch ops), medians of ``REPEATS`` runs; ``transformers`` one request at a time with a
    KV cache, one pass.  ``matmul_floor_tokens_per_s`` is an upper bound: the tokens/s of a
    decode step that did nothing but the model's matrix products (every linear layer and
    the LM head on ``concurrency`` rows, in fp32 on the same threads, each the fastest of
    torch on either weight layout and the engine kernels' blocked products, with the
    weights warm in cache); no engine running this model in fp32 here can exceed it, and
    ``floor_ratio_vs_hf_batch`` is the most any could gain over ``transformers`` batched.
    """
    # every system runs with the same torch thread count (the engine would pick 1 itself
    # for this model size; transformers gets the same, so the comparison is like for like)
    torch.set_num_threads(threads)
    model = ensure_tiny_model(model_dir)
    from agentroll.chat import ChatTokenizer
    from agentroll.engine import kernels

    prompts = sample_prompts(ChatTokenizer.from_pretrained(model), concurrency)
    _log(
        f"model={model} requests={concurrency} max_tokens={max_tokens} torch_threads={threads} "
        f"pairs={pairs}"
    )
    p = asyncio.run(_paired(model, prompts, max_tokens, pairs))
    _log(f"built-in engine (default mode): {p.ours:.1f} tokens/s")
    _log(f"transformers batched: {p.hf_batch:.1f} tokens/s; vllm: {p.vllm:.1f} tokens/s")
    gc.collect()  # the paired systems' models and caches go before the next ones load
    invariant = asyncio.run(_ours(model, prompts, max_tokens, batch_invariant=True))
    _log(f"built-in engine (batch-invariant mode): {invariant:.1f} tokens/s")
    have_kernels = kernels.get() is not None
    torch_ops = asyncio.run(_ours(model, prompts, max_tokens, False, cpu_kernels=False))
    _log(f"built-in engine on plain torch ops (no C++ kernels): {torch_ops:.1f} tokens/s")
    hf_seq = _HF(model, prompts, max_tokens).rate(batched=False)  # one pass: slow and steady
    _log(f"transformers one at a time: {hf_seq:.1f} tokens/s")
    floor = _matmul_floor(model, concurrency)
    _log(f"the model's matmuls alone (an upper bound for any engine): {floor:.1f} tokens/s")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    r = p.vs_hf_batch
    print(
        f"tokens_per_s={p.ours:.1f} hf_seq_tokens_per_s={hf_seq:.1f} "
        f"hf_batch_tokens_per_s={p.hf_batch:.1f} ratio_vs_hf_batch={r.ratio:.2f} "
        f"vllm_tokens_per_s={p.vllm:.1f} ratio_vs_vllm={p.vs_vllm.ratio:.2f} "
        f"batch_invariant_tokens_per_s={invariant:.1f} torch_ops_tokens_per_s={torch_ops:.1f} "
        f"cpu_kernels={int(have_kernels)} prefix_hit_rate={p.prefix_hit_rate:.3f} "
        f"peak_rss_mb={rss:.1f} matmul_floor_tokens_per_s={floor:.1f} "
        f"floor_ratio_vs_hf_batch={floor / p.hf_batch:.2f} pairs={r.pairs} "
        f"ratio_min={r.ratio_min:.2f} ratio_max={r.ratio_max:.2f}"
    )


# -- command line --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineBenchConfig:
    """The options of ``agentroll bench engine``; requests, tokens and threads are >= 1."""

    concurrency: int
    max_tokens: int
    model: str | None
    threads: int
    pairs: int = DEFAULT_PAIRS

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.max_tokens < 1:
            raise ConfigError(
                f"--concurrency and --max-tokens must be >= 1 (got {self.concurrency} and "
                f"{self.max_tokens}); pass positive counts"
            )
        if self.threads < 1:
            raise ConfigError(f"--threads must be >= 1 (got {self.threads})")
        check_pairs(self.pairs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--model", default=None, help="checkpoint dir (default: the tiny model, created if missing)"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads for every system measured"
    )
    parser.add_argument(
        "--pairs",
        type=int,
        default=DEFAULT_PAIRS,
        help="alternating timed runs (engine, baselines), at least 5; ratios are their medians",
    )


def main(args: argparse.Namespace) -> int:
    """CLI entry: run the bench (progress lines first) and print its result line."""
    config = EngineBenchConfig(
        args.concurrency, args.max_tokens, args.model, args.threads, args.pairs
    )
    main_engine(config.concurrency, config.max_tokens, config.model, config.threads, config.pairs)
    return 0
