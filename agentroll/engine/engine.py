"""The built-in engine's synchronous core: scheduler + model runner + sampler, one step at
a time, plus pause / snapshot / restore of requests and in-place weight loads.
Invariants: only ``step`` runs the model and nothing else mutates requests meanwhile; a
token's ``policy_version`` computed its logits, its ``kv_version`` is the oldest among the KV
it attended to; with ``batch_invariant`` output depends only on prompt, seed and weights, so
a restored request continues as if never interrupted.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch

from agentroll._fs import read_json_object
from agentroll.chat import ChatTokenizer
from agentroll.engine.model_runner import ForwardItem, ModelRunner
from agentroll.engine.models import read_config
from agentroll.engine.models.decoder import DecoderConfig
from agentroll.engine.sampler import sample
from agentroll.engine.scheduler import Scheduler, SchedulerConfig
from agentroll.engine.sequence import FinishReason, Sequence, SequenceStatus
from agentroll.engine.sleep import ParkedWeights, SleepState
from agentroll.engine.snapshot import KVHold, RequestSnapshot
from agentroll.errors import ConfigError, WeightSyncError
from agentroll.types import ResumePolicy, SamplingParams, SleepReport, WakeReport
from agentroll.weights.apply import StagedUpdate, WeightStore
from agentroll.weights.update import WeightUpdate

TEST_FAULTS = ("", "perturb_logprobs", "drop_last_token")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Static settings of the built-in engine."""

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int | None = None  # None: from kv_cache_mb
    kv_cache_mb: int = 256
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    # Requests with identical prompts (the samples of a group) arriving while one of them is
    # prefilled fork its KV and sample their first token from its logits: one prefill per
    # group.  In batch-invariant mode their tokens are those they would sample alone.
    share_group_prefill: bool = True
    # True: a request's tokens and logprobs do not depend on the rest of the batch (needed
    # for bit-exact pause/resume/migrate parity); costs throughput (see `bench engine`).
    batch_invariant: bool = False
    # torch intra-op threads (process-wide), which the kernels' products and attention
    # split their work over.  None: ``default_threads`` (1 for small models on the CPU,
    # where thread hand-offs cost more than the matmuls they split; torch's default else).
    num_threads: int | None = None
    # The async facade runs up to ``steps_per_call`` steps back to back on the engine thread
    # before the event loop takes their tokens (fewer when a pause, a new request or an abort
    # comes in, or once ``max_call_s`` has passed): one hand-off and one wake-up of each
    # consumer per run instead of per token.  A pause still stops after the step in flight.
    steps_per_call: int = 8
    max_call_s: float = 0.02
    # KV tokens of requests restored with their KV (moved in from another replica) written
    # per hand-off: a batch of moved calls is restored over a few steps, so a pause of this
    # replica does not wait for all of it at once
    restore_tokens_per_call: int = 4096
    # fp32 on the CPU: the C++ kernels of engine/kernels.py (built once per machine); False,
    # or no compiler, runs the same model on plain torch ops.
    cpu_kernels: bool = True
    # A deliberately broken optimisation, for the tests of `agentroll validate`: the backend
    # reports logprobs off by 1e-3 ("perturb_logprobs") or drops each generation's last token
    # ("drop_last_token").  Never set otherwise.
    test_fault: str = ""

    def __post_init__(self) -> None:
        if self.test_fault not in TEST_FAULTS:
            raise ConfigError(f"test_fault {self.test_fault!r}; use one of {TEST_FAULTS}")
        if self.dtype not in _DTYPES:
            raise ConfigError(
                f"dtype {self.dtype!r} is not supported; use one of {sorted(_DTYPES)}"
            )
        if self.kv_cache_mb < 1 or self.block_size < 1 or self.max_num_seqs < 1:
            raise ConfigError("kv_cache_mb, block_size and max_num_seqs must be >= 1")
        if self.restore_tokens_per_call < 1:
            raise ConfigError(f"restore_tokens_per_call={self.restore_tokens_per_call}; use >= 1")
        if self.steps_per_call < 1 or not self.max_call_s > 0:
            raise ConfigError(
                f"steps_per_call={self.steps_per_call}, max_call_s={self.max_call_s}: "
                "use steps_per_call >= 1 and max_call_s > 0"
            )


@dataclass(slots=True)
class StepOutput:
    """One sampled token of one request (or, with ``error``, why the request ended)."""

    request_id: str
    token_id: int | None
    logprob: float
    policy_version: int
    kv_version: int
    finish_reason: str | None = None  # stop | length | abort
    error: str | None = None


@dataclass(slots=True, eq=False)
class Request:
    """Engine-side state of one generation request."""

    seq: Sequence
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    num_prompt_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)


# Weights a decode step reads (bytes of fp32) from which the CPU engine uses every core: a
# step of the tiny model (3 MB) is over before a thread hand-off pays; at 360M parameters
# the products and attention run 1.4-1.9x faster on two cores than on one.
_PARALLEL_FROM_BYTES = 64 << 20


def default_threads(model: DecoderConfig) -> int:
    """The engine's thread count on the CPU (``EngineConfig.num_threads=None``): one thread
    below ``_PARALLEL_FROM_BYTES`` of weights read per decode step, torch's count (every
    core by default) from there."""
    d, hd = model.hidden_size, model.head_dim
    per_layer = d * (model.num_heads + 2 * model.num_kv_heads) * hd
    per_layer += model.num_heads * hd * d + 3 * d * model.intermediate_size
    weights = 4 * (model.num_layers * per_layer + model.vocab_size * d)
    return 1 if weights < _PARALLEL_FROM_BYTES else torch.get_num_threads()


class LLMEngine:
    """Continuous-batching generation over a paged KV cache.  Not thread-safe: call it from
    one thread (the async facade does)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = Path(config.model)
        if not (model_dir / "config.json").exists():
            raise ConfigError(
                f"{model_dir} has no config.json; create one with `agentroll model create-tiny {model_dir}`"
            )
        model_config = read_config(model_dir)  # checked before anything is built from it
        self.tokenizer = ChatTokenizer.from_pretrained(model_dir)
        dtype = _DTYPES[config.dtype]
        self._set_threads(model_config)
        probe = ModelRunner(
            model_dir,
            num_blocks=1,
            block_size=config.block_size,
            dtype=dtype,
            device=config.device,
            use_kernels=False,
        )
        num_blocks = config.num_blocks or max(16, config.kv_cache_mb * 2**20 // probe.block_bytes)
        self.runner = ModelRunner(
            probe.model,
            num_blocks=num_blocks,
            block_size=config.block_size,
            dtype=dtype,
            device=config.device,
            batch_invariant=config.batch_invariant,
            use_kernels=config.cpu_kernels,
        )
        del probe
        mcfg = self.runner.config
        # a sequence can never outgrow the KV pool either
        max_len = min(
            config.max_model_len or mcfg.max_position,
            mcfg.max_position,
            num_blocks * config.block_size,
        )
        self.max_model_len = max_len
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                block_size=config.block_size,
                num_blocks=num_blocks,
                enable_prefix_caching=config.enable_prefix_caching,
                max_model_len=max_len,
                enable_group_sharing=config.share_group_prefill,
            )
        )
        self.requests: dict[str, Request] = {}
        self.eos_ids = self._eos_ids(model_dir)
        self.fingerprint = json.dumps(
            {
                "model": str(model_dir.resolve()),
                "block_size": config.block_size,
                "dtype": config.dtype,
            }
        )
        self.num_steps = 0
        self._store: WeightStore | None = None
        self._sleep: SleepState | None = None

    def _set_threads(self, model: DecoderConfig) -> None:
        threads = self.config.num_threads
        if threads is None and self.config.device == "cpu":
            threads = default_threads(model)
        if threads is not None:
            torch.set_num_threads(threads)

    def _eos_ids(self, model_dir: Path) -> frozenset[int]:
        ids = {self.tokenizer.eot_id}
        gen = model_dir / "generation_config.json"
        if gen.exists():
            eos = read_json_object(gen).get("eos_token_id")
            eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
            vocab = self.runner.config.vocab_size
            bad = [e for e in eos if isinstance(e, bool) or not isinstance(e, int)]
            bad += [e for e in eos if e not in bad and not 0 <= e < vocab]
            if bad:
                raise ConfigError(
                    f"{gen}: eos_token_id {bad[0]!r} is not a token id (0 <= id < {vocab})"
                )
            ids.update(eos)
        return frozenset(ids)

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        ids = frozenset(params.stop_token_ids)
        return ids if params.ignore_eos else ids | self.eos_ids

    @property
    def policy_version(self) -> int:
        return self.scheduler.weights_version

    def has_work(self) -> bool:
        return self._sleep is None and self.scheduler.has_work()

    @property
    def asleep(self) -> int:
        """The sleep level (0: awake)."""
        return 0 if self._sleep is None else self._sleep.level

    # -- requests --------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        seed: int | None = None,
    ) -> None:
        """Queue a request.  A prompt that can never run (too long for the context or the KV
        pool) is reported by the next ``step`` as an output with ``error``; a duplicate id
        raises ``ValueError``."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already running")
        vocab = self.runner.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(
                f"request {request_id!r} has token ids outside the vocabulary [0, {vocab})"
            )
        seed = params.seed if seed is None else seed
        seed = 0 if seed is None else seed
        seq = Sequence(request_id, list(prompt_ids), max_tokens=params.max_tokens)
        req = Request(
            seq=seq,
            params=params,
            seed=seed,
            stop_ids=self._stop_ids(params),
            num_prompt_tokens=len(prompt_ids),
        )
        self.requests[request_id] = req
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Drop a request and free its blocks (no-op if unknown); asleep, drop it from the
        parked requests."""
        if self._sleep is not None:
            self._sleep.snapshots.pop(request_id, None)
        self.requests.pop(request_id, None)
        self.scheduler.abort(request_id)

    def inflight(self) -> dict[str, int]:
        """Tokens generated so far by each unfinished request (parked ones included)."""
        out = {
            rid: req.seq.num_generated
            for rid, req in self.requests.items()
            if not req.seq.is_finished
        }
        if self._sleep is not None:
            for rid, snap in self._sleep.snapshots.items():
                out[rid] = snap.num_generated
        return out

    def release_blocks(self, block_ids: list[int]) -> None:
        """Hand back blocks a ``KVHold`` of ``snapshot_many(hold_kv=...)`` kept."""
        self.scheduler.block_manager.release(block_ids)

    # -- stepping --------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Run one scheduler step; returns the tokens sampled (and requests that ended).
        Asleep, it does nothing (requests added meanwhile wait for ``wake``)."""
        if self._sleep is not None:
            return []
        sched = self.scheduler
        out = sched.schedule()
        outputs: list[StepOutput] = []
        for rej in out.rejected:
            if self.requests.pop(rej.seq.seq_id, None) is not None:
                outputs.append(
                    StepOutput(
                        rej.seq.seq_id, None, math.nan, self.policy_version, -1, "abort", rej.reason
                    )
                )
        if out.is_empty:
            return outputs
        self.num_steps += 1
        scheduled = out.scheduled
        items = [
            ForwardItem(
                s.seq.token_ids[s.start : s.start + s.num_new_tokens],
                s.start,
                s.seq.block_table,
                s.samples,
            )
            for s in scheduled
        ]
        fwd = self.runner.forward(items)
        for fork in out.forks:
            if fork.copy is not None:  # the leader's partial block, written by this forward
                k, v = self.runner.read_blocks([fork.copy[0]])
                self.runner.write_blocks([fork.copy[1]], k, v)
        sampling = [i for i, s in enumerate(scheduled) if s.samples]
        sampled: dict[str, int] = {}
        by_id: dict[str, StepOutput] = {}
        if sampling:
            seqs = [scheduled[i].seq for i in sampling]
            requests = self.requests
            logits = fwd.last(sampling)
            if out.forks:  # a fork samples from its leader's logits row
                row = {seq.seq_id: i for i, seq in enumerate(seqs)}
                logits = logits[list(range(len(seqs))) + [row[f.leader.seq_id] for f in out.forks]]
                seqs += [f.seq for f in out.forks]
            reqs = [requests[seq.seq_id] for seq in seqs]
            # the random number of a token is a function of (seed, step): see sampler.py
            tokens, logprobs = sample(
                logits,
                [r.params for r in reqs],
                [r.seed for r in reqs],
                [len(r.logprobs) for r in reqs],
                self.runner.kernels,
            )
            version = self.policy_version
            for seq, req, token, lp in zip(seqs, reqs, tokens, logprobs, strict=True):
                seq_id = seq.seq_id
                sampled[seq_id] = token
                req.logprobs.append(lp)
                by_id[seq_id] = o = StepOutput(seq_id, token, lp, version, seq.min_kv_version)
                outputs.append(o)
        for seq in sched.postprocess(out, sampled):
            self._end(by_id, seq.seq_id, "length")
        for (seq_id, token), req in zip(sampled.items(), reqs if sampling else (), strict=True):
            live = seq_id in self.requests  # not ended by postprocess
            if live and (token in req.stop_ids or (req.params.stop and self._hit_stop_string(req))):
                sched.finish(seq_id, FinishReason.STOP)
                self._end(by_id, seq_id, "stop")
        return outputs

    def _end(self, by_id: dict[str, StepOutput], seq_id: str, reason: str) -> None:
        self.requests.pop(seq_id, None)
        if seq_id in by_id:
            by_id[seq_id].finish_reason = reason

    def _hit_stop_string(self, req: Request) -> bool:
        stops = req.params.stop
        if not stops:
            return False
        window = max(len(s) for s in stops) + 8  # tokens: at least one char per token
        tail = self.tokenizer.decode(req.seq.generated_token_ids[-window:])
        return any(s in tail for s in stops)

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> list[float]:
        """Log-probabilities (plain softmax, fp32) of ``token_ids[1:]`` under the current
        weights, from a fresh prefill: the reference a ``recompute`` resume must match and
        the prompt logprobs a trainer rescoring needs.  Call between steps."""
        self._awake("scoring")
        seq = Sequence(f"__score__{len(self.requests)}", list(token_ids))
        seq.drop_kv(self.policy_version)
        bm = self.scheduler.block_manager
        if not bm.can_allocate(seq, use_prefix_cache=False):
            raise ValueError(f"not enough free KV blocks to score {len(token_ids)} tokens now")
        bm.allocate(seq, use_prefix_cache=False)
        try:
            item = ForwardItem(
                token_ids=token_ids,
                start_pos=0,
                block_table=seq.block_table,
                want_logits=False,
                want_all_logits=True,
            )
            logits = self.runner.forward([item]).all_logits[0].float()
        finally:
            bm.free(seq)  # never marked computed: nothing enters the prefix cache
        lp = self.runner.log_softmax(logits)  # the sampler's arithmetic: equal logprobs
        targets = torch.tensor(token_ids[1:], dtype=torch.long)
        return lp[:-1].gather(1, targets[:, None])[:, 0].tolist()

    # -- pause / resume ----------------------------------------------------------------------

    def pause_all(self) -> list[str]:
        """Take every request out of scheduling, keeping its KV.  Call between steps."""
        return [s.seq_id for s in self.scheduler.pause_all()]

    def resume_all(
        self, policy: ResumePolicy = "keep", policies: Mapping[str, ResumePolicy] | None = None
    ) -> dict[str, int]:
        """Resume every paused request under ``policy`` (or its entry in ``policies``);
        returns, per request, how many already-delivered tokens it drops (non-zero only for
        ``restart``)."""
        rollback: dict[str, int] = {}
        for seq_id in list(self.scheduler.paused):
            req = self.requests[seq_id]
            if policies:
                policy = policies.get(seq_id, policy)
            if policy == "recompute":
                self.scheduler.recompute(seq_id)
            elif policy == "restart":
                rollback[seq_id] = self._restart(req)
            self.scheduler.resume(seq_id)
        return rollback

    def _restart(self, req: Request) -> int:
        """Drop the generated tokens: the request starts over from its prompt with its
        sampling randomness, a function of the step (so with unchanged weights it reproduces
        the same tokens)."""
        seq = req.seq
        dropped = seq.num_generated
        self.scheduler.recompute(seq.seq_id)
        del seq.token_ids[req.num_prompt_tokens :]
        req.logprobs.clear()
        return dropped

    # -- sleep / wake ----------------------------------------------------------------------

    def sleep(
        self, level: int, *, keep_kv: Collection[str] = (), spill_dir: str | None = None
    ) -> SleepReport:
        """Release the KV cache (level 1) and the weights too (level 2) while every request
        stands paused.  Each paused request is parked as a snapshot: with a host copy of its
        KV if its id is in ``keep_kv``, else without (recomputed at wake).  At level 2 the
        weights are parked (a file on the CPU, host memory for a device) with their
        checksums.  Raises ``ValueError``, changing nothing, when asleep already, when a
        request is not paused, or when KV blocks are held for a request moving away."""
        t0 = time.perf_counter()
        if self._sleep is not None:
            raise ValueError(
                f"the engine is asleep already (level {self._sleep.level}); wake it first"
            )
        if level not in (1, 2):
            raise ValueError(f"sleep level {level} is not 1 (KV cache) or 2 (KV cache and weights)")
        sched = self.scheduler
        if sched.running or sched.waiting:
            raise ValueError("requests are scheduled; pause them before the engine sleeps")
        bm = sched.block_manager
        owned = {b for seq in sched.paused.values() for b in seq.block_table}
        if bm.num_used_blocks > len(owned):
            raise ValueError(
                "KV blocks are held for requests moving to another replica; sleep once "
                "their move has finished"
            )
        ids = [seq.seq_id for seq in sorted(sched.paused.values(), key=lambda q: q.arrival)]
        keep = set(keep_kv)
        kept = self.snapshot_many([r for r in ids if r in keep], with_kv=True)
        dropped = self.snapshot_many([r for r in ids if r not in keep], with_kv=False)
        state = SleepState(level, {rid: kept.get(rid) or dropped[rid] for rid in ids})
        if level == 2:  # parked before anything is freed: a failure here changes nothing
            store = self.weight_store()
            state.weights = ParkedWeights(
                self.runner.state_dict(), store.checksums, spill_dir=spill_dir
            )
        for rid in ids:
            self.abort(rid)
        bm.reset_prefix_cache()  # their contents are gone with the cache
        kv = self.runner.release_kv()
        weights = 0
        if level == 2:
            self._store = None  # it aliases the released tensors
            weights = self.runner.release_weights()
        self._sleep = state
        _release_memory(self.runner.device)
        kept_bytes = sum(
            s.k.numel() * s.k.element_size() * 2 for s in kept.values() if s.k is not None
        )
        return SleepReport(
            level=level,
            version=self.policy_version,
            freed_bytes=kv + weights,
            kv_bytes=kv,
            weight_bytes=weights,
            kept_bytes=kept_bytes,
            parked=len(ids),
            seconds=time.perf_counter() - t0,
        )

    def wake(self, update: WeightUpdate | None = None, *, fallback: bool = False) -> WakeReport:
        """Reallocate what ``sleep`` released, install ``update`` (verified as ``apply_update``
        does) and put the parked requests back, paused, first in line.  At level 2 an update
        is required unless ``fallback``: then the engine serves its last good weights.

        Raises ``ValueError`` when awake or an update is missing, and ``WeightSyncError``
        when the update is refused: the engine then still sleeps, its parked weights and
        requests unchanged, ready for another ``wake``."""
        t0 = time.perf_counter()
        state = self._sleep
        if state is None:
            raise ValueError("the engine is awake; wake() follows sleep()")
        if state.level == 2 and update is None and not fallback:
            raise ValueError(
                "level 2 released the weights: wake(update) installs the next version, or "
                "wake(fallback=True) the last good one"
            )
        runner = self.runner
        if state.weights is not None and runner.weights_released:
            runner.install_weights(state.weights.load())
            self._store = WeightStore(
                runner.state_dict(), version=self.policy_version, checksums=state.weights.checksums
            )
        if update is not None:
            try:
                self.apply_update(update, _waking=True)
            except WeightSyncError:
                if state.weights is not None:  # back to sleep: the parked copy is still there
                    self._store = None
                    runner.release_weights()
                    _release_memory(runner.device)
                raise
        runner.allocate_kv()
        self._sleep = None
        if state.weights is not None:
            state.weights.discard()
        failed: dict[str, str] = {}
        for rid, snap in state.snapshots.items():
            try:
                self.restore(snap, paused=True)
            except ValueError as exc:
                failed[rid] = f"could not be restored after the engine woke: {exc}"
        return WakeReport(
            level=state.level,
            version=self.policy_version,
            updated=update is not None,
            fallback=update is None and state.level == 2,
            restored=len(state.snapshots) - len(failed),
            seconds=time.perf_counter() - t0,
            failed=failed,
        )

    def _awake(self, what: str) -> None:
        if self._sleep is not None:
            hint = "give the update to wake(update)" if "weights" in what else "wake it first"
            raise ValueError(f"{what} while the engine sleeps (level {self._sleep.level}); {hint}")

    # -- weights -------------------------------------------------------------------------

    def load_weights(
        self, weights: dict[str, torch.Tensor] | str | Path, *, version: int | None = None
    ) -> int:
        """Load new weights in place (full state dict or checkpoint directory) and bump the
        policy version.  Call only while no step runs (the facade pauses first)."""
        self._awake("loading weights")
        self.runner.load_weights(weights)
        self._store = None  # checksums are stale
        new = self.policy_version + 1 if version is None else version
        self.scheduler.set_weights_version(new)
        return new

    def weight_store(self) -> WeightStore:
        """The live weights as a ``WeightStore`` (version = the policy version)."""
        if self._store is None:
            self._store = WeightStore(self.runner.state_dict(), version=self.policy_version)
        return self._store

    def apply_update(self, update: WeightUpdate, *, _waking: bool = False) -> int:
        """Apply a full or delta ``WeightUpdate`` in place, verified by checksum and digest;
        returns the new policy version.  Raises ``WeightSyncError`` with nothing changed when
        it is refused.  Call only while no step runs (the facade pauses first)."""
        if not _waking:
            self._awake("applying new weights")
        store = self.weight_store()
        store.version = self.policy_version
        try:
            store.apply(update)
        finally:  # the store writes the live tensors in place (and restores them on failure)
            self.runner.weights_changed()
        self.scheduler.set_weights_version(update.version)
        return update.version

    def stage_update(self, update: WeightUpdate) -> StagedUpdate:
        """Verify ``update`` into a copy of the tensors it touches, leaving the live weights
        alone; safe to call from another thread while steps run."""
        self._awake("staging new weights")
        return self.weight_store().stage(update)

    def commit_staged(self, staged: StagedUpdate) -> int:
        """Install a staged update (call only while no step runs); returns the version."""
        self._awake("installing staged weights")
        store = self.weight_store()
        store.version = self.policy_version
        try:
            store.commit(staged)
        finally:
            self.runner.weights_changed()
        self.scheduler.set_weights_version(staged.version)
        return staged.version

    # -- snapshots -------------------------------------------------------------------------

    def snapshot(self, request_id: str, *, with_kv: bool = True) -> RequestSnapshot:
        """The state of a paused (or between-steps) request, as host copies."""
        return self.snapshot_many([request_id], with_kv=with_kv)[request_id]

    def snapshot_many(
        self,
        request_ids: list[str],
        *,
        with_kv: bool = True,
        hold_kv: Callable[[list[int]], None] | None = None,
    ) -> dict[str, RequestSnapshot]:
        """Snapshots of the live ones among ``request_ids``; their KV blocks are read in one
        gather per layer (a migration moves many requests at once).  With ``hold_kv`` (a
        thread-safe callback that hands held blocks back to ``release_blocks`` on this
        engine's thread) the blocks are held instead of read: a ``KVHold`` each, which the
        engine they move to in this process reads (see ``KVHold``)."""
        if self._sleep is not None:  # the parked snapshots (no KV to hold: it is on the host)
            return self._sleep.snapshot_many(request_ids, with_kv=with_kv)
        live = [rid for rid in request_ids if rid in self.requests]
        if with_kv and hold_kv is not None:
            out = {}
            for rid in live:
                seq = self.requests[rid].seq
                n = seq.num_blocks_needed(self.config.block_size, seq.num_computed_tokens)
                held = list(seq.block_table[:n]) if seq.num_computed_tokens else []
                snap = self._snapshot_of(rid, None, None)
                if held:
                    self.scheduler.block_manager.hold(held)
                    snap.kv_hold = KVHold(self.runner, held, hold_kv)
                    snap.num_computed_tokens = seq.num_computed_tokens
                out[rid] = snap
            return out
        spans: list[int] = []
        blocks: list[int] = []
        for rid in live:
            seq = self.requests[rid].seq
            n = seq.num_blocks_needed(self.config.block_size, seq.num_computed_tokens)
            n = n if with_kv and seq.num_computed_tokens else 0
            spans.append(n)
            blocks.extend(seq.block_table[:n])
        k_all = v_all = None
        if blocks:
            # requests that share a cached prefix share its blocks: read each block once
            unique = list(dict.fromkeys(blocks))
            k_all, v_all = self.runner.read_blocks(unique)
            if len(unique) < len(blocks):
                row = {b: i for i, b in enumerate(unique)}
                idx = torch.tensor([row[b] for b in blocks])
                k_all, v_all = k_all.index_select(1, idx), v_all.index_select(1, idx)
        out = {}
        start = 0
        for rid, n in zip(live, spans, strict=True):
            k = v = None
            if n and k_all is not None and v_all is not None:
                k, v = k_all[:, start : start + n], v_all[:, start : start + n]
                start += n
            out[rid] = self._snapshot_of(rid, k, v)
        return out

    def _snapshot_of(
        self, request_id: str, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> RequestSnapshot:
        req = self.requests[request_id]
        seq = req.seq
        return RequestSnapshot(
            request_id=request_id,
            token_ids=list(seq.token_ids),
            num_prompt_tokens=req.num_prompt_tokens,
            num_computed_tokens=seq.num_computed_tokens if k is not None else 0,
            kv_version=seq.kv_version,
            min_kv_version=seq.min_kv_version,
            params=req.params,
            seed=req.seed,
            logprobs=list(req.logprobs),
            block_size=self.config.block_size,
            model_fingerprint=self.fingerprint,
            k=k,
            v=v,
        )

    def restore(self, snap: RequestSnapshot, *, paused: bool = False) -> None:
        """Continue a snapshotted request here.  Its KV is written back bit-exactly when the
        engine matches (same model, dtype, block size) and the KV's weights version is not
        newer than this engine's; otherwise it is recomputed.  Raises ``ValueError`` for an
        inconsistent snapshot, or when its KV does not fit now.

        A held KV (``kv_hold``) is handed back whatever the outcome: read when restored,
        unread when refused.  A refused snapshot may stay referenced for long (a traceback's
        frame, a log record's arguments), and its hold must not keep the source's blocks
        meanwhile; restored again later, it recomputes its KV."""
        if self._sleep is not None:
            if snap.kv_hold is not None:
                snap.kv_hold.release()
            self._awake("restoring a request")
        try:
            self._restore(snap, paused=paused)
        finally:
            if snap.kv_hold is not None:
                snap.kv_hold.release()

    def _restore(self, snap: RequestSnapshot, *, paused: bool) -> None:
        if snap.request_id in self.requests:
            raise ValueError(f"request {snap.request_id!r} is already running here")
        if not 0 < snap.num_prompt_tokens <= len(snap.token_ids) or snap.num_computed_tokens >= len(
            snap.token_ids
        ):
            raise ValueError(f"snapshot of {snap.request_id!r} has inconsistent token counts")
        gen = len(snap.token_ids) - snap.num_prompt_tokens
        if len(snap.logprobs) != gen:
            raise ValueError(
                f"snapshot of {snap.request_id!r} has {len(snap.logprobs)} logprobs for {gen} tokens"
            )
        seq = Sequence(
            snap.request_id,
            list(snap.token_ids),
            num_prompt_tokens=len(snap.token_ids) - gen,
            max_tokens=snap.params.max_tokens,
            kv_version=snap.kv_version,
            min_kv_version=snap.min_kv_version,
        )
        req = Request(
            seq=seq,
            params=snap.params,
            seed=snap.seed,
            stop_ids=self._stop_ids(snap.params),
            num_prompt_tokens=snap.num_prompt_tokens,
            logprobs=list(snap.logprobs),
        )
        hold = snap.live_hold
        usable = (
            snap.has_kv  # a released hold is no KV (restored again after a refusal)
            and snap.num_computed_tokens > 0
            and snap.model_fingerprint == self.fingerprint
            and snap.kv_version <= self.policy_version
        )
        if usable:
            n_blocks = seq.num_blocks_needed(self.config.block_size, snap.num_computed_tokens)
            if hold is not None:
                if len(hold.block_ids) < n_blocks:
                    raise ValueError(
                        f"snapshot of {snap.request_id!r} holds {len(hold.block_ids)} KV "
                        f"blocks, expected {n_blocks}"
                    )
                kv = hold.read(n_blocks)  # read from the engine that held them
            else:
                assert snap.k is not None and snap.v is not None
                kv = snap.k, snap.v
            k, v = kv
            if k.shape[1] != n_blocks or k.shape != v.shape:
                raise ValueError(
                    f"snapshot of {snap.request_id!r} has KV for {k.shape[1]} blocks, expected {n_blocks}"
                )
            if not self.scheduler.add_with_kv(seq, snap.num_computed_tokens, paused=paused):
                raise ValueError(
                    "not enough free KV blocks to restore now; retry when requests finish"
                )
            self.runner.write_blocks(seq.block_table[:n_blocks], k, v)
        else:
            self.scheduler.add(seq)
            if paused and seq.status is not SequenceStatus.FINISHED:
                self.scheduler.pause(seq.seq_id)
        self.requests[snap.request_id] = req


def _release_memory(device: torch.device) -> None:
    """Hand freed memory back: the CUDA caching allocator's blocks, the C heap's pages."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        from agentroll._mem import trim_heap

        trim_heap()
