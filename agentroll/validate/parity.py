"""Learning-semantics checks of a backend (``agentroll validate --backend torch``).

Each check runs real generations on the project-made tiny model and returns a
``CheckResult`` (one ``check=<name> status=pass|fail <figures>`` line).  Invariants: a check
compares against a reference computed in the same run, never against stored numbers; the
checks run the engine in its batch-invariant mode, in which exact parity is promised.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

from agentroll.types import SamplingParams
from agentroll.validate.common import CheckResult, collect_stream, sample_prompts, sample_request


async def check_token_parity_pause(
    model: Path, n: int = 16, max_tokens: int = 48, device: str = "cpu"
) -> CheckResult:
    from agentroll.backends.torch import TorchBackend

    async with TorchBackend(model, batch_invariant=True, device=device) as backend:
        prompts = sample_prompts(backend.tokenizer, n)
        reference = await asyncio.gather(
            *(
                collect_stream(backend, sample_request(i, p, max_tokens))
                for i, p in enumerate(prompts)
            )
        )
        rng = random.Random(1)
        pauses = 0

        def pauser() -> Callable[[int], Awaitable[None]]:
            seen = 0

            async def maybe_pause(num_tokens: int) -> None:
                # pause the whole backend at random token boundaries, many times per
                # request: 8% a token (a chunk brings one token or a run of them)
                nonlocal pauses, seen
                new, seen = max(1, num_tokens - seen), num_tokens
                if rng.random() < 1.0 - 0.92**new:
                    await backend.pause("keep")
                    pauses += 1
                    await asyncio.sleep(0)
                    await backend.resume()

            return maybe_pause

        paused = await asyncio.gather(
            *(
                collect_stream(backend, sample_request(i, p, max_tokens), pauser())
                for i, p in enumerate(prompts)
            )
        )
    same_tokens = all(a[0] == b[0] for a, b in zip(reference, paused, strict=True))
    max_diff = max(
        abs(x - y)
        for a, b in zip(reference, paused, strict=True)
        for x, y in zip(a[1], b[1], strict=False)
    )
    ok = same_tokens and max_diff == 0.0 and pauses >= 4
    return CheckResult(
        "token_parity_pause",
        ok,
        {
            "requests": n,
            "pauses": pauses,
            "tokens_equal": same_tokens,
            "max_abs_logprob_diff": max_diff,
        },
    )


_MIGRATE_SCRIPT = """
import asyncio, sys, msgspec
from agentroll.engine.engine import LLMEngine, EngineConfig
from agentroll.engine.snapshot import RequestSnapshot
from agentroll.backends.base import SamplingParams
mode, model, snap_dir, out, device = sys.argv[1:6]
e = LLMEngine(EngineConfig(model=model, batch_invariant=True, device=device))
ids, lps = [], []
if mode == "first":
    prompt = [int(x) for x in sys.argv[6].split(",")]
    e.add_request("m", prompt, SamplingParams(temperature=1.0, max_tokens=int(sys.argv[7]), seed=7, stop_token_ids=(), ignore_eos=True))
    for _ in range(int(sys.argv[8])):
        for o in e.step():
            ids.append(o.token_id); lps.append(o.logprob)
    e.pause_all()
    e.snapshot("m").save(snap_dir)
else:
    e.restore(RequestSnapshot.load(snap_dir))
    while e.has_work():
        for o in e.step():
            ids.append(o.token_id); lps.append(o.logprob)
open(out, "wb").write(msgspec.msgpack.encode([ids, lps]))
"""


def check_token_parity_migrate(
    model: Path, max_tokens: int = 40, split: int = 17, device: str = "cpu"
) -> CheckResult:
    import msgspec

    from agentroll.engine.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(model), batch_invariant=True, device=device))
    prompt = sample_prompts(engine.tokenizer, 3)[2]
    engine.add_request(
        "m",
        prompt,
        # a trained model may end early: the split must fall inside the generation
        SamplingParams(
            temperature=1.0, max_tokens=max_tokens, seed=7, stop_token_ids=(), ignore_eos=True
        ),
    )
    ref_ids, ref_lps = [], []
    while engine.has_work():
        for o in engine.step():
            ref_ids.append(o.token_id)
            ref_lps.append(o.logprob)
    with tempfile.TemporaryDirectory() as tmp:
        snap, out1, out2 = (str(Path(tmp) / n) for n in ("snap", "a", "b"))
        base = [sys.executable, "-c", _MIGRATE_SCRIPT]
        subprocess.run(
            [
                *base,
                "first",
                str(model),
                snap,
                out1,
                device,
                ",".join(map(str, prompt)),
                str(max_tokens),
                str(split),
            ],
            check=True,
            capture_output=True,
        )
        subprocess.run(
            [*base, "second", str(model), snap, out2, device], check=True, capture_output=True
        )
        a = msgspec.msgpack.decode(Path(out1).read_bytes())
        b = msgspec.msgpack.decode(Path(out2).read_bytes())
    ids, lps = a[0] + b[0], a[1] + b[1]
    ok = ids == ref_ids and lps == ref_lps
    return CheckResult(
        "token_parity_migrate",
        ok,
        {
            "tokens": len(ids),
            "split_at": len(a[0]),
            "tokens_equal": ids == ref_ids,
            "logprobs_equal": lps == ref_lps,
        },
    )


def _perturbed(state: dict[str, torch.Tensor], seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        k: v + 0.01 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in state.items()
    }


async def check_recompute_rescore(
    model: Path, max_tokens: int = 40, pause_after: int = 12, device: str = "cpu"
) -> CheckResult:
    from agentroll.backends.torch import TorchBackend

    results: dict[str, Any] = {}
    for policy in ("recompute", "keep"):
        async with TorchBackend(model, batch_invariant=True, device=device) as backend:
            prompt = sample_prompts(backend.tokenizer, 2)[1]
            request = sample_request(0, prompt, max_tokens)
            new_state = _perturbed(backend.engine.runner.state_dict())
            updated = asyncio.Event()

            async def on_token(
                n: int,
                backend: Any = backend,
                new_state: Any = new_state,
                updated: asyncio.Event = updated,
                policy: Any = policy,
            ) -> None:
                if n >= pause_after and not updated.is_set():
                    updated.set()
                    await backend.pause(policy)
                    await backend.load_weights(new_state)
                    await backend.resume()

            ids, lps, versions = await collect_stream(backend, request, on_token)
            full = list(prompt) + ids
            cut = next(i for i, v in enumerate(versions) if v[0] == 1)
            rescored = (await backend.score(full))[len(prompt) + cut - 1 :]
            diff = max(abs(a - b) for a, b in zip(lps[cut:], rescored, strict=True))
            results[policy] = (diff, versions, cut)
    diff, versions, cut = results["recompute"]
    recompute_ok = diff <= 1e-6 and all(v == (1, 1) for v in versions[cut:])
    _, kversions, kcut = results["keep"]
    keep_ok = all(v == (1, 0) for v in kversions[kcut:]) and all(
        v == (0, 0) for v in kversions[:kcut]
    )
    figures = {
        "max_abs_logprob_diff": f"{diff:.2e}",
        "resumed_at": cut,
        "keep_kv_version": kversions[-1][1],
        "keep_policy_version": kversions[-1][0],
    }
    return CheckResult("recompute_rescore", recompute_ok and keep_ok, figures)


def _generate_alone(
    engine: Any, rid: str, prompt: list[int], params: SamplingParams, seed: int | None = None
) -> tuple[list[int], list[float]]:
    """One request through an idle ``LLMEngine``, stepped to the end: its tokens and their
    logprobs."""
    engine.add_request(rid, prompt, params, seed=seed)
    ids: list[int] = []
    lps: list[float] = []
    while engine.has_work():
        for o in engine.step():
            ids.append(o.token_id)
            lps.append(o.logprob)
    return ids, lps


def check_reference_parity(model: Path, max_tokens: int = 32, device: str = "cpu") -> CheckResult:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    from agentroll.engine.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(model), batch_invariant=True, device=device))
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    max_diff = 0.0
    same_greedy = True
    for i, prompt in enumerate(sample_prompts(engine.tokenizer, 4)):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=())
        ids, lps = _generate_alone(engine, f"g{i}", prompt, params)
        full = torch.tensor([list(prompt) + ids])
        with torch.no_grad():
            logits = hf(full).logits[0].float()
        ref = torch.log_softmax(logits, dim=-1)
        n = len(prompt)
        ref_lps = [float(ref[n - 1 + j, t]) for j, t in enumerate(ids)]
        ref_greedy = [int(ref[n - 1 + j].argmax()) for j in range(len(ids))]
        same_greedy &= ref_greedy == ids
        max_diff = max(max_diff, max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)))
    return CheckResult(
        "reference_parity",
        same_greedy and max_diff <= 1e-4,
        {"max_abs_logprob_diff": f"{max_diff:.2e}", "greedy_equal": same_greedy},
    )


# The largest sampled-token logprob difference, bf16 serving against the fp32 reference, at
# the 99th percentile (nats).  bf16 weights carry 8 bits of mantissa: on the tiny model the
# kernels' bf16 products (fp32 activations and accumulation) differ by about 0.01 on
# average and 0.06 at most, torch's all-bf16 ops by about twice that.
BF16_P99_TOLERANCE = 0.1


def check_bf16_parity(
    model: Path, max_tokens: int = 32, device: str = "cpu", requests: int = 8
) -> CheckResult:
    """bf16 serving (``EngineConfig(dtype="bfloat16")``) against fp32: tokens sampled by the
    bf16 engine, rescored by an fp32 runner on the same sequences; the distribution of
    |logprob difference| per sampled token (a ``distribution``-class check: bf16 changes
    samples, it must not move their logprobs beyond ``BF16_P99_TOLERANCE`` at the p99)."""
    from agentroll.engine.engine import EngineConfig, LLMEngine
    from agentroll.engine.model_runner import ForwardItem, ModelRunner

    engine = LLMEngine(EngineConfig(model=str(model), dtype="bfloat16", device=device))
    path = "kernels" if engine.runner.kernels is not None else "torch"
    reference = ModelRunner(model, num_blocks=64, device=device)
    block = reference.block_size
    diffs: list[float] = []
    for i, prompt in enumerate(sample_prompts(engine.tokenizer, requests)):
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, stop_token_ids=())
        ids, lps = _generate_alone(engine, f"b{i}", prompt, params, seed=i)
        full = list(prompt) + ids
        table = list(range(-(-len(full) // block)))
        out = reference.forward([ForwardItem(full, 0, table, want_all_logits=True)])
        ref = torch.log_softmax(out.all_logits[0].float(), dim=-1)
        n = len(prompt)
        diffs += [
            abs(lp - float(ref[n - 1 + j, t]))
            for j, (t, lp) in enumerate(zip(ids, lps, strict=True))
        ]
    d = torch.tensor(diffs)
    p99 = float(torch.quantile(d, 0.99))
    return CheckResult(
        "bf16_parity",
        p99 <= BF16_P99_TOLERANCE,
        {
            "path": path,
            "tokens": len(diffs),
            "mean_abs_logprob_diff": f"{float(d.mean()):.2e}",
            "p50": f"{float(d.median()):.2e}",
            "p90": f"{float(torch.quantile(d, 0.9)):.2e}",
            "p99": f"{p99:.2e}",
            "max": f"{float(d.max()):.2e}",
            "tolerance_p99": BF16_P99_TOLERANCE,
        },
    )


async def check_batch_invariance(
    model: Path, max_tokens: int = 32, device: str = "cpu"
) -> CheckResult:
    from agentroll.backends.torch import TorchBackend

    async with TorchBackend(model, batch_invariant=True, device=device) as backend:
        prompts = sample_prompts(backend.tokenizer, 32)
        alone = await collect_stream(backend, sample_request(0, prompts[0], max_tokens))
        together = await asyncio.gather(
            *(
                collect_stream(backend, sample_request(i, p, max_tokens))
                for i, p in enumerate(prompts)
            )
        )
    ok = alone[0] == together[0][0] and alone[1] == together[0][1]
    return CheckResult(
        "batch_invariance",
        ok,
        {
            "batch": 32,
            "tokens_equal": alone[0] == together[0][0],
            "logprobs_equal": alone[1] == together[0][1],
        },
    )
