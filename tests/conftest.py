"""Shared fixtures.  Tests marked with a resource (bwrap, docker, vllm, ray) skip with a
reason when it is absent, unless the resource is listed in AGENTROLL_REQUIRE (``make test``
sets it): then a skip is turned into a failure, so CI never skips silently."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from agentroll.chat import ChatTokenizer
from agentroll.model.tokenizer import tiny_chat_tokenizer

if TYPE_CHECKING:
    from agentroll.fleet.replica import Replica

REQUIRED = {r.strip() for r in os.environ.get("AGENTROLL_REQUIRE", "").split(",") if r.strip()}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if report.skipped and REQUIRED:
        needed = REQUIRED.intersection(m.name for m in item.iter_markers())
        if needed:
            report.outcome = "failed"
            report.longrepr = (
                f"skipped although {sorted(needed)} is required (AGENTROLL_REQUIRE): "
                f"{report.longrepr}"
            )


@pytest.fixture(scope="session")
def tok() -> ChatTokenizer:
    return tiny_chat_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project-made tiny Qwen2 checkpoint, created once per test session."""
    from agentroll.model.tiny import create_tiny

    return create_tiny(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """One local Ray cluster for the session (3-5 s to start on the 2-core box), loopback
    only (agentroll.fleet.ray.local_cluster).  Yields the ``ray`` module."""
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"ray is not installed ({exc}); pip install 'agentroll[ray]'")
    from agentroll.fleet.ray import local_cluster

    with local_cluster(num_cpus=4) as ray_module:
        yield ray_module


MakeReplicas = Callable[..., Awaitable["list[Replica]"]]


@pytest.fixture
async def make_replicas(request: pytest.FixtureRequest) -> AsyncIterator[MakeReplicas]:
    """``await make_replicas(kind, n, model_dir, **engine_overrides)``: ``n`` started
    replicas of ``kind`` "local" (``LocalReplica`` over ``TorchBackend``) or "ray"
    (``RayReplica``, on the session's ``ray_cluster``); all are closed at teardown."""
    from agentroll.backends.torch import TorchBackend
    from agentroll.fleet.replica import LocalReplica

    made: list[Replica] = []

    async def make(kind: str, n: int, model_dir: str | Path, **overrides: Any) -> list[Replica]:
        new: list[Replica]
        if kind == "local":
            new = [
                LocalReplica(TorchBackend(model_dir, **overrides), name=f"local-{len(made) + i}")
                for i in range(n)
            ]
        elif kind == "ray":
            request.getfixturevalue("ray_cluster")
            from agentroll.fleet.ray import RayReplica

            new = [RayReplica(model_dir, f"ray-{len(made) + i}", **overrides) for i in range(n)]
        else:
            raise ValueError(f"unknown replica kind {kind!r}; use local or ray")
        made.extend(new)
        results = await asyncio.gather(*(r.start() for r in new), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return new

    yield make
    failures = []
    for replica in reversed(made):  # every replica is closed even if one fails to close
        try:
            await asyncio.wait_for(replica.close(), 30)
        except Exception as exc:
            failures.append(f"{replica.name}: {type(exc).__name__}: {exc}")
    if failures:
        pytest.fail("closing replicas failed: " + "; ".join(failures))


@pytest.fixture(scope="session")
def small_fleet_toml() -> str:
    """Recipe sections of a small, fast rollout setup (two tiny-engine replicas, groups of
    two, batches of eight) for tests to combine with their own [run] / [environment]."""
    return """
[backend]
replicas = 2
kv_cache_mb = 16
max_num_seqs = 16
prefill_budget = 256
[sampling]
max_tokens = 24
[rollout]
concurrency = 8
samples_per_task = 2
[trainer]
batch_size = 8
"""
