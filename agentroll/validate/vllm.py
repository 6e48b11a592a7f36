"""Learning-semantics checks of the ``vllm`` backend (``agentroll validate --backend vllm``).

The checks of the built-in engine that apply to vLLM, on one ``VLLMBackend`` over the
project-made tiny model: ``token_parity_pause``, ``recompute_rescore``, ``provenance``,
``cross_backend_parity`` and ``served_weights``.  Invariant: each compares against a
reference computed in the same run, never against stored numbers.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import tempfile
from pathlib import Path
from typing import Any

from agentroll.backends.base import GenerationRequest, SamplingParams
from agentroll.validate.common import CheckResult, collect_stream

__all__ = ["run_vllm_checks"]

_TOLERANCE = 1e-3


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1, 990) for _ in range(5 + i % 9)] for i in range(n)]


def _request(tag: str, i: int, prompt: list[int], max_tokens: int) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"{tag}-{i}",
        prompt_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, seed=1000 + i, ignore_eos=True),
    )


async def check_token_parity_pause(backend: Any, n: int = 16, max_tokens: int = 40) -> CheckResult:
    """Concurrent seeded requests paused (``keep``, no update) at random token boundaries.

    ``n`` requests, paused several times each, equal uninterrupted generation: identical token
    ids and bit-identical logprobs.
    """
    prompts = _prompts(n)
    reference = await asyncio.gather(
        *(collect_stream(backend, _request("ref", i, p, max_tokens)) for i, p in enumerate(prompts))
    )
    rng = random.Random(1)
    pauses = 0
    lock = asyncio.Lock()

    async def maybe_pause(num_tokens: int) -> None:
        nonlocal pauses
        if rng.random() < 0.05 and not lock.locked():
            async with lock:
                await backend.pause("keep")
                pauses += 1
                try:
                    await asyncio.sleep(0.005)
                finally:
                    await backend.resume()

    paused = await asyncio.gather(
        *(
            collect_stream(backend, _request("paused", i, p, max_tokens), maybe_pause)
            for i, p in enumerate(prompts)
        )
    )
    same = all(a[0] == b[0] for a, b in zip(reference, paused, strict=True))
    diff = max(
        abs(x - y)
        for a, b in zip(reference, paused, strict=True)
        for x, y in zip(a[1], b[1], strict=False)
    )
    return CheckResult(
        "token_parity_pause",
        same and diff == 0.0 and pauses >= 4,
        {"requests": n, "pauses": pauses, "tokens_equal": same, "max_abs_logprob_diff": diff},
    )


async def _with_update(
    backend: Any, trainer: Any, tag: str, policy: str, n: int, max_tokens: int, at: int
) -> list[tuple[list[int], list[float], list[tuple[int, int]], list[int]]]:
    """``n`` concurrent requests; when the first reaches ``at`` tokens, pause with
    ``policy``, apply the trainer's next update, resume."""
    prompts = _prompts(n)
    fired = False

    async def trigger(num_tokens: int) -> None:
        nonlocal fired
        if not fired and num_tokens >= at:
            fired = True
            await backend.pause(policy)
            try:
                await backend.apply(trainer.step())
            finally:
                await backend.resume()

    runs = await asyncio.gather(
        *(
            collect_stream(backend, _request(tag, i, p, max_tokens), trigger)
            for i, p in enumerate(prompts)
        )
    )
    return [(ids, lps, vers, p) for (ids, lps, vers), p in zip(runs, prompts, strict=True)]


async def check_recompute_rescore(
    backend: Any, trainer: Any, n: int = 8, max_tokens: int = 32
) -> CheckResult:
    """A delta update applied mid-generation with ``recompute``.

    Every token after the cut carries the new version on both counts and its logprob equals
    vLLM's fresh rescoring of the whole sequence under the new weights.
    """
    v0 = backend.policy_version
    runs = await _with_update(backend, trainer, "recompute", "recompute", n, max_tokens, 10)
    v1 = backend.policy_version
    checked = 0
    diff = 0.0
    bad_versions = 0
    for ids, lps, vers, prompt in runs:
        cut = next((k for k, v in enumerate(vers) if v != (v0, v0)), len(vers))
        if any(v != (v1, v1) for v in vers[cut:]):
            bad_versions += 1
        if cut == len(vers):
            continue
        rescored = (await backend.prompt_logprobs(prompt + ids))[len(prompt) - 1 :]
        for k in range(cut, len(ids)):
            diff = max(diff, abs(rescored[k] - lps[k]))
            checked += 1
    ok = v1 != v0 and bad_versions == 0 and checked > 0 and diff <= 1e-4
    return CheckResult(
        "recompute_rescore",
        ok,
        {
            "requests": n,
            "tokens_checked": checked,
            "bad_versions": bad_versions,
            "max_abs_diff": diff,
        },
    )


async def check_provenance(
    backend: Any, trainer: Any, n: int = 8, max_tokens: int = 32
) -> CheckResult:
    """An update with ``keep``, then one with ``recompute``, across concurrent requests.

    Versions never go back, ``kv_version <= policy_version``, tokens after a ``keep`` resume
    keep the old kv version, and vLLM's own version spans agree with ours.
    """
    mismatches_before = backend.stats["version_mismatch"]
    wrong = 0
    spanning = 0
    tokens = 0
    for policy in ("keep", "recompute"):
        v0 = backend.policy_version
        runs = await _with_update(backend, trainer, f"prov-{policy}", policy, n, max_tokens, 12)
        v1 = backend.policy_version
        for _, _, vers, _ in runs:
            tokens += len(vers)
            if any(kv > pv for pv, kv in vers) or any(b < a for a, b in itertools.pairwise(vers)):
                wrong += 1
                continue
            after = [v for v in vers if v[0] == v1]
            before = [v for v in vers if v[0] == v0]
            if after and before:
                spanning += 1
                expected_kv = v0 if policy == "keep" else v1
                if any(kv != expected_kv for _, kv in after):
                    wrong += 1
    mismatches = backend.stats["version_mismatch"] - mismatches_before
    return CheckResult(
        "provenance",
        wrong == 0 and mismatches == 0 and spanning > 0,
        {
            "requests": 2 * n,
            "tokens_checked": tokens,
            "turns_across_a_sync": spanning,
            "wrong": wrong,
            "vllm_span_mismatches": mismatches,
        },
    )


async def check_cross_backend_parity(backend: Any, max_tokens: int = 24) -> CheckResult:
    """The built-in engine against vLLM on the weights vLLM serves (its verified host copy).

    vLLM's logprobs of a sequence equal the built-in engine's within ``1e-3`` and greedy tokens
    match.
    """
    from safetensors.torch import save_file

    from agentroll.engine.engine import EngineConfig, LLMEngine

    prompt = _prompts(1)[0]
    req = GenerationRequest(
        request_id="cross-greedy",
        prompt_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    greedy, _, _ = await collect_stream(backend, req)
    ids = prompt + greedy
    theirs = await backend.prompt_logprobs(ids)
    state = backend._host_store().tensors  # the verified copy of what vLLM serves

    def ours() -> tuple[list[float], list[int]]:
        with tempfile.TemporaryDirectory(prefix="agentroll-cross-") as tmp:
            root = Path(tmp)
            save_file(
                {k: v.contiguous() for k, v in state.items()}, str(root / "model.safetensors")
            )
            for item in Path(backend.model_dir).iterdir():
                if item.is_file() and not item.name.endswith(".safetensors"):
                    (root / item.name).write_bytes(item.read_bytes())
            engine = LLMEngine(EngineConfig(model=str(root), num_blocks=128))
            scored = engine.score(ids)
            engine.add_request(
                "g",
                list(prompt),
                SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            )
            out: list[int] = []
            while len(out) < max_tokens:
                out += [o.token_id for o in engine.step() if o.token_id is not None]
            return scored, out

    scored, engine_greedy = await asyncio.get_running_loop().run_in_executor(None, ours)
    diff = max(abs(a - b) for a, b in zip(scored, theirs, strict=True))
    same = engine_greedy == greedy
    return CheckResult(
        "cross_backend_parity",
        diff <= _TOLERANCE and same,
        {
            "tokens": len(ids) - 1,
            "max_abs_logprob_diff": diff,
            "tolerance": _TOLERANCE,
            "greedy_equal": same,
        },
    )


async def check_served_weights(backend: Any, trainer: Any) -> CheckResult:
    """After an update: vLLM's digests of what it serves equal the verified host tensors
    (where vLLM can report them) and the rescoring probe agrees with our model code."""
    probes = backend.check.probes
    await backend.pause("keep")
    try:
        await backend.apply(trainer.step())
    finally:
        await backend.resume()  # runs the probe
    verified = backend.check.last_verified
    diff = backend.check.last_probe_diff
    checked = verified.checked if verified is not None else 0
    ok = checked > 0 and backend.check.probes == probes + 1 and diff is not None
    ok = ok and diff <= backend.check.tolerance
    return CheckResult(
        "served_weights",
        ok,
        {
            "params_compared": checked,
            "params_unverifiable": len(verified.unverifiable) if verified is not None else -1,
            "probe_tokens": backend.check.probe_tokens,
            "probe_max_abs_diff": diff,
            "tolerance": backend.check.tolerance,
        },
    )


async def run_vllm_checks(model: Path, backend: Any = None) -> list[CheckResult]:
    """All vLLM checks on ``model`` (or on an already started ``backend``)."""
    from agentroll.backends.vllm import VLLMBackend
    from agentroll.testing import SyntheticTrainer

    async def checks(b: Any) -> list[CheckResult]:
        from agentroll.weights.exporter import WeightExporter

        trainer = SyntheticTrainer(b.model_dir, fraction=0.05, seed=11)
        # start from what b serves now (a backend may come with updates applied)
        trainer.state = {k: v.clone() for k, v in b._host_store().tensors.items()}
        trainer.exporter = WeightExporter(lambda: trainer.state, version=b.policy_version)
        return [
            await check_token_parity_pause(b),
            await check_recompute_rescore(b, trainer),
            await check_provenance(b, trainer),
            await check_served_weights(b, trainer),
            await check_cross_backend_parity(b),
        ]

    if backend is not None:
        return await checks(backend)
    async with VLLMBackend(model, max_model_len=512, max_num_seqs=32) as started:
        return await checks(started)
