"""``agentroll bench engine``: built-in engine throughput vs Hugging Face and vLLM.

All figures come from the same run on the same requests: the built-in engine (default
mode, and the batch-invariant mode the parity checks run in), ``transformers`` one request
at a time with a KV cache and as one padded batch, and vLLM when it is installed (``nan``
otherwise, and then ``ratio_vs_vllm`` is ``nan`` too).  Every
system generates exactly ``max_tokens`` tokens per request (end-of-sequence ignored), so
tokens/s compare like with like; figures are medians of ``REPEATS`` timed runs after a
warm-up.  Prints one ``key=value`` result line.

``matmul_floor_tokens_per_s`` is an upper bound, measured in the same run: the tokens/s of a
decode step that did nothing but the model's matrix products (every linear layer and the LM
head, on ``concurrency`` rows, in fp32 on the same threads, each the fastest of torch on
either weight layout and the engine kernels' blocked products, with the weights warm in
cache).  No engine running this model in fp32 here,
ours or another, can exceed it; ``matmul_floor / hf_batch`` is the most any of them could
gain over ``transformers`` batched.  ``torch_ops_tokens_per_s`` is the built-in engine with
its C++ CPU kernels off (``cpu_kernels=0`` says they could not be built here, and then every
engine figure is on torch ops).
"""

from __future__ import annotations

import asyncio
import math
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

from agentroll.backends.base import GenerationRequest, SamplingParams
from agentroll.model.tiny import ensure_tiny_model
from agentroll.validate.common import sample_prompts

REPEATS = 5  # timed repeats per system (after a warm-up); figures are medians


def _log(msg: str) -> None:
    print(f"[bench engine] {msg}", flush=True)


async def _ours(
    model: Path,
    prompts: list[list[int]],
    max_tokens: int,
    batch_invariant: bool,
    cpu_kernels: bool = True,
) -> tuple[float, float]:
    """(tokens/s, prefix hit rate of a second turn) of the built-in engine."""
    from agentroll.backends.torch import TorchBackend

    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)

    async def one(rid: str, prompt: list[int], seed: int) -> list[int]:
        req = GenerationRequest(
            request_id=rid, prompt_ids=prompt, sampling=msgspec.structs.replace(params, seed=seed)
        )
        out: list[int] = []
        async for chunk in backend.generate(req):
            out += chunk.token_ids
        return out

    async with TorchBackend(
        model,
        batch_invariant=batch_invariant,
        max_num_seqs=max(64, len(prompts)),
        cpu_kernels=cpu_kernels,
    ) as backend:
        await asyncio.gather(*(one(f"w{i}", p, i) for i, p in enumerate(prompts)))  # warm-up
        rates = []
        for rep in range(REPEATS):
            start = time.perf_counter()
            outs = await asyncio.gather(*(one(f"r{rep}-{i}", p, i) for i, p in enumerate(prompts)))
            rates.append(sum(len(o) for o in outs) / (time.perf_counter() - start))
        # second turn of each episode: prompt + reply + a new user message
        bm = backend.engine.scheduler.block_manager
        q0, h0 = bm.num_prefix_queries, bm.num_prefix_hits
        tail = backend.tokenizer.encode(
            "<|im_end|>\n<|im_start|>user\nand then?<|im_end|>\n<|im_start|>assistant\n"
        )
        turn2 = [p + o + tail for p, o in zip(prompts, outs, strict=True)]
        await asyncio.gather(*(one(f"s{i}", p, i) for i, p in enumerate(turn2)))
        queries, hits = bm.num_prefix_queries - q0, bm.num_prefix_hits - h0
    return statistics.median(rates), hits / queries if queries else math.nan


def _hf(model: Path, prompts: list[list[int]], max_tokens: int, batched: bool) -> float:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    kwargs: dict[str, Any] = dict(
        max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=True, pad_token_id=pad
    )
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run() -> int:
        if batched:
            out = hf.generate(ids, attention_mask=mask, **kwargs)
            return int(out.shape[1] - width) * len(prompts)
        return sum(int(hf.generate(torch.tensor([p]), **kwargs).shape[1]) - len(p) for p in prompts)

    torch.manual_seed(0)
    rates = []
    with torch.no_grad():
        hf.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, pad_token_id=pad)  # warm-up
        for _ in range(REPEATS if batched else 1):  # one at a time is slow and steady
            start = time.perf_counter()
            tokens = run()
            rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates)


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


def _vllm(model: Path, prompts: list[list[int]], max_tokens: int) -> float:
    try:
        import vllm
    except ImportError:
        return math.nan
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the tiny model needs little
    kwargs: dict[str, Any] = {}
    if not torch.cuda.is_available():
        # on the CPU this reserves a fraction of host memory at startup and refuses to start
        # when that much is not free (this process holds transformers' models already)
        kwargs["gpu_memory_utilization"] = 0.3
    llm = vllm.LLM(model=str(model), dtype="float32", enforce_eager=True, **kwargs)
    sp = vllm.SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=0)
    inputs: Any = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs, sp)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(inputs, sp)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / (time.perf_counter() - start)


def main_engine(
    concurrency: int, max_tokens: int, model_dir: str | None = None, threads: int = 1
) -> None:
    # every system runs with the same torch thread count (the engine would pick 1 itself
    # for this model size; transformers gets the same, so the comparison is like for like)
    torch.set_num_threads(threads)
    model = ensure_tiny_model(model_dir)
    from agentroll.chat import ChatTokenizer

    prompts = sample_prompts(ChatTokenizer.from_pretrained(model), concurrency)
    _log(f"model={model} requests={concurrency} max_tokens={max_tokens} torch_threads={threads}")
    ours, hit_rate = asyncio.run(_ours(model, prompts, max_tokens, batch_invariant=False))
    _log(f"built-in engine (default mode): {ours:.1f} tokens/s")
    invariant, _ = asyncio.run(_ours(model, prompts, max_tokens, batch_invariant=True))
    _log(f"built-in engine (batch-invariant mode): {invariant:.1f} tokens/s")
    from agentroll.engine import kernels

    have_kernels = kernels.get() is not None
    torch_ops, _ = asyncio.run(_ours(model, prompts, max_tokens, False, cpu_kernels=False))
    _log(f"built-in engine on plain torch ops (no C++ kernels): {torch_ops:.1f} tokens/s")
    hf_seq = _hf(model, prompts, max_tokens, batched=False)
    _log(f"transformers one at a time: {hf_seq:.1f} tokens/s")
    hf_batch = _hf(model, prompts, max_tokens, batched=True)
    _log(f"transformers batched: {hf_batch:.1f} tokens/s")
    vllm_tps = _vllm(model, prompts, max_tokens)
    _log(f"vllm: {vllm_tps:.1f} tokens/s")
    floor = _matmul_floor(model, concurrency)
    _log(f"the model's matmuls alone (an upper bound for any engine): {floor:.1f} tokens/s")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"tokens_per_s={ours:.1f} hf_seq_tokens_per_s={hf_seq:.1f} hf_batch_tokens_per_s={hf_batch:.1f} "
        f"ratio_vs_hf_batch={ours / hf_batch:.2f} vllm_tokens_per_s={vllm_tps:.1f} "
        f"ratio_vs_vllm={ours / vllm_tps:.2f} "
        f"batch_invariant_tokens_per_s={invariant:.1f} torch_ops_tokens_per_s={torch_ops:.1f} "
        f"cpu_kernels={int(have_kernels)} prefix_hit_rate={hit_rate:.3f} peak_rss_mb={rss:.1f} "
        f"matmul_floor_tokens_per_s={floor:.1f} floor_ratio_vs_hf_batch={floor / hf_batch:.2f}"
    )
