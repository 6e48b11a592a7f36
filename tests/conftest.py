"""Shared fixtures.  Tests marked with a resource (bwrap, docker, vllm, ray) skip with a
reason when it is absent, unless the resource is listed in AGENTROLL_REQUIRE (``make test``
sets it): then a skip is turned into a failure, so CI never skips silently."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from agentroll.chat import ChatTokenizer
from agentroll.tokenizer import tiny_chat_tokenizer

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
    """One local Ray cluster for the session (3-5 s to start on the 2-core box): 4 logical CPUs,
    every server bound to 127.0.0.1, token authentication with a token kept in the
    environment (nothing written to ~/.ray), no usage stats, no dashboard, files under a
    fresh /tmp directory that is removed afterwards.  Yields the ``ray`` module."""
    with pytest.MonkeyPatch.context() as mp:
        # read when ray is imported: bind to loopback instead of the host's address
        mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        # ray.init turns token authentication on (and sets RAY_AUTH_MODE, undone at the end);
        # with a token here it writes none to ~/.ray
        mp.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
        mp.delenv("RAY_AUTH_MODE", raising=False)
        try:
            import ray
            from ray._private import ray_constants
        except ImportError as exc:
            pytest.skip(f"ray is not installed ({exc}); pip install 'agentroll[ray]'")
        # ray may have been imported before the variable was set
        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False, raising=False)
        if ray.is_initialized():
            pytest.fail("a Ray cluster is already connected; the ray tests start their own")
        temp_dir = tempfile.mkdtemp(prefix="agentroll-ray-")
        try:
            ray.init(
                num_cpus=4,
                object_store_memory=200 * 2**20,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
                _temp_dir=temp_dir,
            )
            yield ray
        finally:
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)


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
