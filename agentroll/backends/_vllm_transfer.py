"""Moving verified weights into vLLM workers, and checking what they serve.

Invariants: what vLLM serves is compared with the verified host tensors byte for byte, and a
parameter that cannot be compared is reported as ``unverifiable``, never as checked; a patch
carries values taken from the verified new tensor.  Pure functions here import no vLLM and
run on the CPU; ``NCCLSender`` needs CUDA and vLLM's CUDA build (``scripts/gpu-check.sh``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from agentroll.errors import BackendError, WeightSyncError

__all__ = [
    "PACKED_MODULES",
    "CheckedBackend",
    "NCCLSender",
    "Patch",
    "ReferenceScorer",
    "ServedCheck",
    "Verified",
    "probe_ids",
    "served_digests",
    "sparse_patches",
    "verify_served",
]

# vLLM's ``packed_modules_mapping`` of the Llama / Qwen2 / Qwen3 families: a served
# parameter ``...qkv_proj.<w|b>`` is the checkpoint's q, k, v stacked along dim 0.
PACKED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_INT32_MAX = 2**31 - 1
log = logging.getLogger("agentroll.backends.vllm")


def _sha256(t: torch.Tensor) -> str:
    flat = t.detach().contiguous().cpu().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().data).hexdigest()


def _sources(served: str, host: Mapping[str, torch.Tensor]) -> list[str] | None:
    """The checkpoint tensors a served parameter is made of (None: no counterpart)."""
    if served in host:
        return [served]
    parts = served.split(".")
    for i, part in enumerate(parts):
        members = PACKED_MODULES.get(part)
        if members is not None:
            names = [".".join([*parts[:i], m, *parts[i + 1 :]]) for m in members]
            return names if all(n in host for n in names) else None
    if served == "lm_head.weight" and "model.embed_tokens.weight" in host:  # tied head
        return ["model.embed_tokens.weight"]
    return None


def served_digests(
    host: Mapping[str, torch.Tensor], names: list[str], dtype: torch.dtype
) -> dict[str, str | None]:
    """sha256 of each served parameter rebuilt from ``host`` (None: no counterpart)."""
    out: dict[str, str | None] = {}
    for name in names:
        sources = _sources(name, host)
        if sources is None:
            out[name] = None
            continue
        parts = [host[n].to(dtype) for n in sources]
        out[name] = _sha256(parts[0] if len(parts) == 1 else torch.cat(parts, dim=0))
    return out


@dataclass
class Verified:
    """What ``verify_served`` compared: ``checked`` parameters matched byte for byte."""

    checked: int = 0
    unverifiable: dict[str, str] = field(default_factory=dict)  # name -> why


def verify_served(
    host: Mapping[str, torch.Tensor], reported: list[dict[str, str]], dtype: torch.dtype
) -> Verified:
    """Compare vLLM's per-worker digests with ``host``; ``WeightSyncError`` names the first
    served parameter whose bytes differ.

    vLLM reports a sha256 per *served* parameter (``AsyncLLM.compute_weight_checksums``),
    under its own names, where the checkpoint's q/k/v and gate/up projections are stacked into
    ``qkv_proj`` / ``gate_up_proj``; ``served_digests`` rebuilds each served parameter from the
    verified host tensors (same stacking, cast to the served dtype) for a byte-for-byte
    comparison.  vLLM's CPU build repacks linear weights into its own layout and reports them
    as empty (the sha256 of no bytes): those are counted as ``unverifiable`` and covered by the
    rescoring probe instead; on CUDA every parameter is compared.  Sharded workers
    (tensor/pipeline parallel) are not compared (their partition is vLLM's business) and are
    reported as such.
    """
    result = Verified()
    if len(reported) != 1:
        for worker in reported:
            for key in worker:
                result.unverifiable[key] = "sharded across workers"
        return result
    plain = {key.rsplit(":", 1)[-1]: digest for key, digest in reported[0].items()}
    expected = served_digests(host, sorted(plain), dtype)
    for name, digest in sorted(plain.items()):
        want = expected[name]
        if want is None:
            result.unverifiable[name] = "no checkpoint tensor"
        elif digest == EMPTY_SHA256 and want != EMPTY_SHA256:
            result.unverifiable[name] = "repacked by the engine (CPU)"
        elif digest != want:
            raise WeightSyncError(
                f"vLLM serves {name!r} with bytes that differ from the verified weights "
                f"(sha256 {digest[:12]}..., expected {want[:12]}...)"
            )
        else:
            result.checked += 1
    return result


@dataclass(frozen=True)
class Patch:
    """Flat-index changes of one tensor (``indices`` int32, as vLLM's sparse path wants)."""

    name: str
    indices: torch.Tensor
    values: torch.Tensor
    shape: tuple[int, ...]

    def inverse(self, old: torch.Tensor) -> Patch:
        """The patch that puts ``old``'s values back (the rollback)."""
        return Patch(self.name, self.indices, old.reshape(-1)[self.indices.long()], self.shape)


_UINT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def sparse_patches(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> list[Patch]:
    """One ``Patch`` per tensor of ``new`` whose bytes differ from ``old`` (same names,
    shapes and dtypes required: ``WeightSyncError`` otherwise).

    A patch holds the elements an update changed, as flat ``(indices, values)``, found by
    comparing the old and the new tensor bitwise (so +0.0/-0.0 and NaN payloads count), with
    values taken from the *verified* new tensor.  The inverse patch (old values) is the
    rollback.  This is the payload of vLLM's ``sparse_nccl`` transfer.
    """
    patches = []
    for name, after in new.items():
        before = old.get(name)
        if before is None or before.shape != after.shape or before.dtype != after.dtype:
            raise WeightSyncError(f"sparse transfer: {name!r} does not match the served tensor")
        if after.numel() > _INT32_MAX:
            raise WeightSyncError(
                f"sparse transfer: {name!r} has {after.numel()} elements, beyond int32 indices; "
                "use transfer='nccl' (dense) for this model"
            )
        a = after.detach().contiguous().reshape(-1)
        b = before.detach().contiguous().reshape(-1)
        view = _UINT[a.element_size()]
        changed = torch.nonzero(a.view(view) != b.view(view)).reshape(-1)
        if changed.numel():
            patches.append(Patch(name, changed.to(torch.int32), a[changed], tuple(after.shape)))
    return patches


def probe_ids(vocab_size: int, n: int) -> list[int]:
    """The probe's fixed token ids (seeded, the same on every replica and run)."""
    g = torch.Generator().manual_seed(20261130)
    return torch.randint(0, vocab_size, (max(2, n),), generator=g).tolist()


class ReferenceScorer:
    """The built-in engine's model code over given tensors: the probe's reference.  It runs
    in fp32 on the weights rounded to the served ``dtype`` (what the engine holds), so the
    reference carries no rounding of its own beyond fp32."""

    def __init__(self, model_dir: Any, dtype: str) -> None:
        from agentroll.engine.model_runner import ModelRunner

        served = getattr(torch, dtype, None)
        self.served = served if isinstance(served, torch.dtype) else None
        self.runner = ModelRunner(model_dir, num_blocks=64, block_size=16, dtype=torch.float32)
        self.vocab_size = int(self.runner.config.vocab_size)

    def score(self, tensors: Mapping[str, torch.Tensor], ids: list[int]) -> list[float]:
        """Log-probabilities (plain softmax, fp32) of ``ids[1:]`` under ``tensors``."""
        from agentroll.engine.model_runner import ForwardItem

        runner = self.runner
        if len(ids) > runner.num_blocks * runner.block_size:
            raise ValueError(f"the probe has {len(ids)} tokens, more than the scorer's cache")
        live = runner.state_dict()
        rounded = {n: t.to(self.served) if self.served else t for n, t in tensors.items()}
        runner.load_weights({n: t.float() for n, t in rounded.items() if n in live})
        table = list(range(-(-len(ids) // runner.block_size)))
        item = ForwardItem(
            token_ids=ids, start_pos=0, block_table=table, want_logits=False, want_all_logits=True
        )
        logits = runner.forward([item]).all_logits[0].float()
        lp = runner.log_softmax(logits)[:-1]
        return lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


class ServedCheck:
    """What both vLLM backends check after an update: vLLM's digests of what it serves
    (``verify``, see ``verify_served``) and the rescoring probe (``probe``: ``probe_ids``
    scored by vLLM and by ``ReferenceScorer``)."""

    def __init__(
        self,
        model_dir: Any,
        dtype: str,
        *,
        verify: bool | None,
        probe_tokens: int,
        tolerance: float | None,
    ) -> None:
        from pathlib import Path

        self.model_dir, self.dtype = Path(model_dir), dtype
        if verify is None:  # hashing every weight per update: worth it for small models
            verify = sum(f.stat().st_size for f in self.model_dir.glob("*.safetensors")) < 4 << 30
        self.verify_served = verify
        self.probe_tokens = probe_tokens
        fp32 = dtype in ("float32", "float")
        # fp32: kernels agree to ~1e-5 here; 16-bit engines round every activation
        self.tolerance = tolerance if tolerance is not None else (1e-3 if fp32 else 0.25)
        self.last_verified: Verified | None = None
        self.last_probe_diff: float | None = None
        self.probes = 0
        self._scorer: ReferenceScorer | None = None

    async def verify(
        self, reported: list[dict[str, str]], expected: Mapping[str, torch.Tensor]
    ) -> Verified:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            dtype = next(iter(expected.values())).dtype
        self.last_verified = await asyncio.to_thread(verify_served, expected, reported, dtype)
        return self.last_verified

    async def probe(
        self,
        prompt_logprobs: Callable[[list[int]], Awaitable[list[float]]],
        tensors: Mapping[str, torch.Tensor],
        version: int,
    ) -> float:
        """Rescore the probe in the engine and with our model code on ``tensors``;
        ``WeightSyncError`` when they differ by more than the tolerance."""
        if self._scorer is None:
            self._scorer = await asyncio.to_thread(ReferenceScorer, self.model_dir, self.dtype)
        ids = probe_ids(self._scorer.vocab_size, self.probe_tokens)
        theirs = await prompt_logprobs(ids)
        ours = await asyncio.to_thread(self._scorer.score, tensors, ids)
        diff = max(abs(a - b) for a, b in zip(ours, theirs, strict=True))
        self.last_probe_diff, self.probes = diff, self.probes + 1
        if not diff <= self.tolerance:
            raise WeightSyncError(
                f"vLLM failed the rescoring probe after loading version {version}: logprobs "
                f"differ from the verified weights by {diff:.3g} (tolerance {self.tolerance}); "
                "this replica is out of service until recover() or a restart"
            )
        return diff


class CheckedBackend:
    """The after-update checks both vLLM backends run, over their own hooks: ``_probe`` on
    the first resume after an update (a failure takes the backend out of service: every
    ``generate`` raises) and ``recover`` to bring it back."""

    check: ServedCheck
    weights: Any
    _broken: str | None
    _probe_due: bool
    _paused: bool
    _version: int

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        raise NotImplementedError

    async def _reload(self, directory: Any) -> None:
        raise NotImplementedError

    async def _verify(self, expected: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def _init_checks(
        self,
        model_dir: Any,
        dtype: str,
        verify_served: bool | None,
        probe_tokens: int,
        probe_tolerance: float | None,
    ) -> None:
        self.check = ServedCheck(
            model_dir, dtype, verify=verify_served, probe_tokens=probe_tokens,
            tolerance=probe_tolerance,
        )  # fmt: skip
        self._broken = None
        self._probe_due = False

    def _require_serving(self) -> None:
        if self._broken is not None:
            raise BackendError(self._broken)

    async def _probe(self) -> None:
        try:
            await self.check.probe(self.prompt_logprobs, self.weights.store.tensors, self._version)
        except WeightSyncError as exc:
            self._broken = str(exc)
            log.error("%s", exc)
            raise

    async def recover(self) -> None:
        """Bring a backend that failed its probe back: reload the verified checkpoint,
        verify and probe again (``WeightSyncError`` if it still fails).  Checkpoint reloads
        only: an NCCL replica that failed its probe should be restarted."""
        if self._broken is None:
            return
        if getattr(self, "_sender", None) is not None or self._paused:
            raise BackendError("recover() needs transfer='reload' and a resumed backend")
        self._broken = None
        await self._reload(self.weights.served)
        if self.check.verify_served:
            await self._verify(self.weights.store.tensors)
        if self.check.probe_tokens > 0:
            await self._probe()


class _LoopClient:
    """vLLM's ``VLLMWeightSyncClient`` over an in-process ``AsyncLLM``: the trainer engine
    calls these from its thread; each runs on ``loop`` and blocks the thread until done."""

    def __init__(self, llm: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.llm, self.loop = llm, loop

    def _run(self, coro: Any) -> None:
        asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._run(self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info)))

    def start_weight_update(self) -> None:
        self._run(self.llm.start_weight_update())

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._run(self.llm.update_weights(WeightTransferUpdateRequest(update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._run(self.llm.finish_weight_update(weight_version))


def _tensor_source(tensors: Mapping[str, torch.Tensor], device: torch.device) -> Any:
    """A vLLM ``WeightSource`` over a ``name -> tensor`` map, moved to ``device`` lazily;
    ``.tensors`` is replaced before each send."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class TensorSource(WeightSource):
        def __init__(self) -> None:
            self.tensors = dict(tensors)

        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in self.tensors.items():
                yield name, t.to(device)

    return TensorSource()


class NCCLSender:
    """Rank 0 of vLLM's weight-transfer NCCL group, in this process, on its own CUDA device.

    This is the trainer-side end of vLLM's ``nccl`` / ``sparse_nccl`` weight-transfer
    engines.  NCCL refuses two ranks on one GPU, so it needs a second device; on one GPU, or
    on the CPU, use ``transfer="reload"``.  vLLM's trainer engines call the control plane
    synchronously from a thread; ``_LoopClient`` runs those calls on the event loop that owns
    the ``AsyncLLM``.

    ``kind`` is ``nccl`` (dense: every tensor of the model each update) or ``sparse_nccl``
    (only the changed elements).  ``start`` rendezvous with the workers on
    ``master_address:master_port``; ``send_*`` run the transfer on a thread while the event
    loop serves the control-plane calls.  The engine must have been started with
    ``weight_transfer_config={"backend": kind}``.
    """

    def __init__(
        self,
        llm: Any,
        kind: Literal["nccl", "sparse_nccl"],
        *,
        device: str,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
    ) -> None:
        if not torch.cuda.is_available():
            raise BackendError(
                f"transfer={kind!r} needs CUDA (NCCL); on this machine use transfer='reload'"
            )
        self.llm, self.kind = llm, kind
        self.device = torch.device(device)
        self.master_address, self.master_port = master_address, master_port
        self._engine: Any = None
        self._source: Any = None

    async def start(self, tensors: Mapping[str, torch.Tensor]) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        port = self.master_port or _free_port(self.master_address)
        loop = asyncio.get_running_loop()
        client = _LoopClient(self.llm, loop)
        if self.kind == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            info: Any = NCCLTrainerInitInfo(
                master_address=self.master_address, master_port=port, world_size=2, rank=0
            )
            self._source = _tensor_source(tensors, self.device)
        else:
            from vllm.distributed.weight_transfer.sparse_nccl_engine import (
                SparseNCCLTrainerInitInfo,
            )

            info = SparseNCCLTrainerInitInfo(
                master_address=self.master_address, master_port=port, world_size=2, rank=0
            )

        def init() -> Any:
            torch.cuda.set_device(self.device)
            return WeightTransferTrainerFactory.trainer_init(
                info, client=client, source=self._source
            )

        self._engine = await asyncio.to_thread(init)

    async def send_dense(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Every tensor of the model (the workers reload layer by layer)."""
        assert self._engine is not None and self._source is not None, "start() first"
        self._source.tensors = dict(tensors)
        await asyncio.to_thread(self._engine.send_weights)

    async def send_sparse(self, patches: list[Patch]) -> None:
        """The changed elements only (applied in place by the workers)."""
        assert self._engine is not None, "start() first"
        from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseWeightPatch

        wire = [
            SparseWeightPatch(
                name=p.name,
                indices=p.indices.to(self.device),
                values=p.values.to(self.device),
                full_shape=p.shape,
            )
            for p in patches
        ]
        await asyncio.to_thread(self._engine.send_weights, wire)

    async def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
