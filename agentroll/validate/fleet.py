"""The ``provenance`` and ``rolling_versions`` checks of ``agentroll validate``.

Role: run multi-turn tool episodes (the checkpoint probe environment) with weight syncs in
the middle and compare every token's recorded versions with what the sync timeline says
they must be.  Invariant: the expectations come from the timeline recorded outside the
engine's token path, never from the tokens being checked.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

from agentroll.backends.base import GenerationRequest
from agentroll.backends.torch import TorchBackend
from agentroll.env import EpisodeState
from agentroll.rollout.engine import RolloutEngine
from agentroll.testing import SyntheticTrainer
from agentroll.types import Trajectory
from agentroll.validate.checkpoint import CheckpointProbe, probe_config
from agentroll.validate.common import CheckResult


class _Probe(CheckpointProbe):
    """The checkpoint probe, scoring 0 when an episode ended before its first tool call."""

    async def reward(self, trajectory: Trajectory, state: EpisodeState) -> float:
        try:
            return await super().reward(trajectory, state)
        except FileNotFoundError:
            return 0.0


class _TimelineBackend(TorchBackend):
    """Records, per request, how many syncs had completed when it was submitted."""

    syncs = 0
    submitted: dict[str, int]

    def generate(self, request: GenerationRequest) -> Any:
        self.submitted[request.request_id] = self.syncs
        return super().generate(request)


def _expected(
    rid: str, n: int, epoch0: int, at_sync: list[dict[str, tuple[int, int]]], versions: list[int]
) -> tuple[list[int], int]:
    """Expected policy versions of a request's ``n`` tokens and its KV version."""
    epochs = [epoch0] * n
    kv_epoch = epoch0
    for s in range(epoch0, len(at_sync)):
        seen = at_sync[s].get(rid)
        if seen is None:
            break  # finished before sync s
        generated, computed = seen
        for j in range(generated, n):
            epochs[j] = s + 1
        if computed == 0 and kv_epoch == s:
            kv_epoch = s + 1  # its prefill had not started: it runs under the new weights
    return [versions[e] for e in epochs], versions[kv_epoch]


async def _inside_a_turn(backend: TorchBackend, timeout: float = 2.0) -> None:
    """Wait until some request is part-way through its turn (or ``timeout``), so that a sync
    lands inside a turn rather than between turns: the engine is fast enough that timed
    syncs found only tool calls in flight."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        # list(): one atomic copy; the engine thread adds and removes requests meanwhile
        if any(
            r.seq.num_generated > 0 and not r.seq.is_finished
            for r in list(backend.engine.requests.values())
        ):
            return
        await asyncio.sleep(0.001)


async def check_provenance(model: Path, device: str = "cpu", syncs: int = 4) -> CheckResult:
    """One engine, ``keep``: at each sync the engine's in-flight requests are recorded (tokens
    generated, tokens whose KV is computed).

    A request's token ``j`` must carry the version of the epoch it was sampled in (the submit
    epoch plus the syncs that found it with ``<= j`` tokens), and its ``kv_version`` must be the
    version its prefill started under (the first epoch that found its KV computed), since
    ``keep`` never recomputes.
    """
    env = _Probe(num_tasks=6)
    trainer = SyntheticTrainer(model, seed=1)
    backend = _TimelineBackend(model, device=device)
    backend.submitted = {}
    at_sync: list[dict[str, tuple[int, int]]] = []
    versions = [0]
    trajs: list[Trajectory] = []
    config = probe_config(concurrency=6, seed=3)
    async with backend, RolloutEngine(backend, env, config) as engine:
        # the updates are trained up front: a sync that waited on training could find every
        # episode already finished (they take well under a second with the CPU kernels)
        updates = [await asyncio.to_thread(trainer.step) for _ in range(syncs)]

        async def syncer() -> None:
            for update in updates:
                await _inside_a_turn(backend)
                await engine.pause("keep")
                at_sync.append(
                    {
                        rid: (req.seq.num_generated, req.seq.num_computed_tokens)
                        for rid, req in backend.engine.requests.items()
                        if not req.seq.is_finished
                    }
                )
                await backend.apply(update)
                versions.append(backend.policy_version)
                backend.syncs += 1
                await engine.resume()
                await asyncio.sleep(0.02)  # a few steps under the new weights

        task = asyncio.create_task(syncer())
        async for traj in engine.run():
            trajs.append(traj)
        await task
    checked = wrong_policy = wrong_kv = straddling = 0
    for t in trajs:
        for turn in t.turns:
            rid = f"{t.id}-{turn.index}"
            n = turn.gen_end - turn.gen_start
            want_pol, want_kv = _expected(rid, n, backend.submitted[rid], at_sync, versions)
            got_pol = t.policy_version[turn.gen_start : turn.gen_end].tolist()
            got_kv = t.kv_version[turn.gen_start : turn.gen_end].tolist()
            checked += n
            wrong_policy += sum(a != b for a, b in zip(got_pol, want_pol, strict=True))
            wrong_kv += sum(k != want_kv for k in got_kv)
            straddling += len(set(want_pol)) > 1
    ok_eps = sum(t.status != "failed" for t in trajs)
    passed = (
        wrong_policy == 0
        and wrong_kv == 0
        and checked > 0
        and straddling > 0
        and ok_eps == len(trajs)
        and len(at_sync) == syncs
    )
    return CheckResult(
        "provenance",
        passed,
        {
            "syncs": len(at_sync),
            "episodes": len(trajs),
            "tokens_checked": checked,
            "turns_across_a_sync": straddling,
            "wrong_policy_version": wrong_policy,
            "wrong_kv_version": wrong_kv,
        },
    )


class _StepAudit(TorchBackend):
    """Counts engine steps whose outputs carry more than one policy version."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.audited = 0
        self.mixed = 0

    async def start(self) -> None:
        await super().start()
        step = self.engine.step

        def audited_step() -> Any:
            outputs = step()
            versions = {o.policy_version for o in outputs if o.token_id is not None}
            self.audited += bool(versions)
            self.mixed += len(versions) > 1
            return outputs

        self.engine.step = audited_step


async def _rolling_run(
    model: Path, device: str, *, pin: bool, syncs: int
) -> tuple[list[Trajectory], Any, list[_StepAudit]]:
    from agentroll.fleet import FleetBackend, LocalReplica

    backends = [_StepAudit(model, device=device) for _ in range(4)]
    replicas = [LocalReplica(b, name=f"replica-{i}") for i, b in enumerate(backends)]
    fleet = FleetBackend(replicas, strategy="rolling", pin_versions=pin)
    trainer = SyntheticTrainer(model, seed=2)
    env = _Probe(num_tasks=16)
    trajs: list[Trajectory] = []
    # Fewer slots than tasks, and admissions tied to the syncs (not to timing: an episode
    # takes well under a second with the CPU kernels): the first `slots` episodes start at
    # once, sync k starts once those and the next (k - 1) * 3 have started, and later episodes
    # wait for the syncs, 3 per sync, so some sample under every version.
    slots, per_sync = 8, 3
    config = probe_config(concurrency=slots, seed=5)
    started = 0
    progress = asyncio.Condition()
    synced = 0

    async def admit(_: int) -> None:  # called for one group at a time, in order
        nonlocal started
        need = 0 if started < slots else min(syncs, 1 + (started - slots) // per_sync)
        async with progress:
            await progress.wait_for(lambda: synced >= need)
            started += 1
            progress.notify_all()

    async with fleet, RolloutEngine(fleet, env, config) as engine:

        async def syncer() -> None:
            nonlocal synced
            for k in range(syncs):
                update = await asyncio.to_thread(trainer.step)
                enough = slots + k * per_sync
                async with progress:
                    await progress.wait_for(lambda: started >= enough)  # noqa: B023
                await engine.sync(update, policy=engine.pauses.policy)
                async with progress:
                    synced += 1
                    progress.notify_all()

        task = asyncio.create_task(syncer())
        async for traj in engine.run(admit=admit):
            trajs.append(traj)
        await task
    return trajs, fleet, backends


async def check_rolling_versions(model: Path, device: str = "cpu", syncs: int = 3) -> CheckResult:
    """Four replicas, rolling updates: no engine step ever returns tokens of two versions.

    Episodes pinned to a version never see another (every sampled token has one policy and KV
    version); without pinning, versions never decrease within a turn and ``kv_version <=
    policy_version``.
    """
    figures: dict[str, Any] = {}
    passed = True
    for pin in (True, False):
        trajs, fleet, backends = await _rolling_run(model, device, pin=pin, syncs=syncs)
        tag = "pinned" if pin else "unpinned"
        mixed = sum(b.mixed for b in backends)
        audited = sum(b.audited for b in backends)
        bad = 0
        for t in trajs:
            sampled = t.loss_mask == 1
            pol, kv = t.policy_version[sampled], t.kv_version[sampled]
            if pin:
                bad += len(set(pol.tolist()) | set(kv.tolist())) > 1
            else:
                for turn in t.turns:
                    p = t.policy_version[turn.gen_start : turn.gen_end]
                    k = t.kv_version[turn.gen_start : turn.gen_end]
                    bad += bool((p[1:] < p[:-1]).any() or (k > p).any())
        versions_seen = Counter(v for t in trajs for v in set(t.policy_version[t.loss_mask == 1]))
        lost = sum(t.status == "failed" for t in trajs)
        syncs_done = len(fleet.reports)
        figures.update(
            {
                f"{tag}_steps_audited": audited,
                f"{tag}_mixed_steps": mixed,
                f"{tag}_bad_episodes": bad,
                f"{tag}_versions_seen": len(versions_seen),
                f"{tag}_lost": lost,
            }
        )
        if pin:
            figures["pin_breaks"] = fleet.stats.pin_breaks
        else:
            figures["migrated"] = fleet.stats.migrated
        passed &= (
            mixed == 0
            and bad == 0
            and lost == 0
            and audited > 0
            and syncs_done == syncs
            and len(versions_seen) > 1
        )
    return CheckResult("rolling_versions", passed, figures)


__all__ = ["check_provenance", "check_rolling_versions"]
