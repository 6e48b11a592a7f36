"""The result cache of pure tools: the cache's logic on synthetic calls, then the engine
with a pure tool (hits served without running it), an impure one (found by re-execution and
no longer cached) and one that reads the sandbox (its files are part of the key)."""

from __future__ import annotations

import asyncio
import io
import tarfile
from typing import Any

import pytest

from agentroll.backends.mock import MockBackend
from agentroll.chat import ChatTokenizer
from agentroll.env import Environment, EpisodeState, tool
from agentroll.errors import ConfigError
from agentroll.rollout.engine import RolloutConfig, RolloutEngine
from agentroll.rollout.tool_cache import ToolCache, for_call
from agentroll.sandbox.base import Sandbox, SandboxConfig, tar_digest
from agentroll.testing import FakeSandbox
from agentroll.types import Task, ToolResult, Trajectory


def ok(content: str, error: str | None = None) -> ToolResult:
    return ToolResult(call_id="c", name="t", content=content, error=error)


# -- the cache alone -------------------------------------------------------------------------


def test_key_depends_on_everything_the_tool_reads() -> None:
    k = ToolCache.key("t", {"a": 1, "b": [2]}, task_id=None, sandbox=None)
    assert k == ToolCache.key("t", {"b": [2], "a": 1}, task_id=None, sandbox=None)
    others = {
        ToolCache.key("u", {"a": 1, "b": [2]}, task_id=None, sandbox=None),
        ToolCache.key("t", {"a": 2, "b": [2]}, task_id=None, sandbox=None),
        ToolCache.key("t", {"a": 1, "b": [2]}, task_id="x", sandbox=None),
        ToolCache.key("t", {"a": 1, "b": [2]}, task_id=None, sandbox="d1"),
        ToolCache.key("t", {"a": 1, "b": [2]}, task_id=None, sandbox="d2"),
    }
    assert k not in others and len(others) == 5


def test_miss_store_hit_and_verification_of_the_first_hits() -> None:
    cache = ToolCache(verify_rate=0.0, verify_first=2)
    assert cache.lookup("t", "k") == (None, False)
    assert cache.store("t", "k", ok("42"))
    verifies = []
    for _ in range(5):
        hit, verify = cache.lookup("t", "k")
        assert hit is not None and hit.content == "42" and hit.cached
        verifies.append(verify)
    assert verifies == [True, True, False, False, False]
    assert cache.stats() == {
        "hits": 5,
        "misses": 1,
        "verified": 0,
        "uncacheable": 0,
        "joined": 0,
        "entries": 1,
        "impure": [],
    }
    served = for_call(hit, "call-7")
    assert served.call_id == "call-7" and served.duration == 0.0 and served.cached


def test_verify_rate_one_checks_every_hit() -> None:
    cache = ToolCache(verify_rate=1.0, verify_first=0)
    cache.store("t", "k", ok("x"))
    assert all(cache.lookup("t", "k")[1] for _ in range(20))


def test_a_differing_result_makes_the_tool_impure_and_drops_its_entries() -> None:
    cache = ToolCache()
    cache.store("t", "k1", ok("1"))
    cache.store("t", "k2", ok("2"))
    cache.store("u", "k3", ok("3"))
    assert cache.store("t", "k1", ok("1"))  # the same result: still pure
    assert not cache.store("t", "k1", ok("1!"))
    assert not cache.enabled("t") and cache.enabled("u")
    assert cache.impure["t"].cached == "1" and cache.impure["t"].fresh == "1!"
    assert cache.lookup("t", "k2") == (None, False)  # nothing of t is served any more
    assert cache.lookup("u", "k3")[0] is not None
    assert cache.stats()["impure"] == ["t"] and cache.stats()["verified"] == 2
    assert cache.store("t", "k1", ok("anything"))  # an impure tool is no longer compared


def test_only_results_that_are_a_function_of_the_key_are_kept() -> None:
    cache = ToolCache()
    cache.store("t", "refused", ok("not allowed", error="tool_error"))
    assert cache.lookup("t", "refused")[0] is not None
    for err in ("timeout", "exception", "bad_arguments"):
        cache.store("t", err, ok("x", error=err))
        assert cache.lookup("t", err)[0] is None
    assert cache.counters["uncacheable"] == 3


def test_the_oldest_entries_go_first() -> None:
    cache = ToolCache(max_entries=2)
    for k in ("a", "b", "c"):
        cache.store("t", k, ok(k))
    assert cache.lookup("t", "a")[0] is None
    assert cache.lookup("t", "b")[0] is not None and cache.lookup("t", "c")[0] is not None


@pytest.mark.parametrize("bad", [{"verify_rate": -0.1}, {"verify_rate": 1.5}, {"max_entries": 0}])
def test_bad_settings_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        ToolCache(**bad)


def test_bad_engine_setting_is_refused() -> None:
    with pytest.raises(ConfigError, match="tool_cache_verify"):
        RolloutConfig(tool_cache=True, tool_cache_verify=2.0)


def _tar(files: dict[str, bytes], mode: int = 0o644, mtime: int = 0) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, mtime
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_tar_digest_sees_files_not_times_or_order() -> None:
    base = tar_digest(_tar({"a.py": b"1", "b/c.txt": b"2"}))
    assert base == tar_digest(_tar({"b/c.txt": b"2", "a.py": b"1"}, mtime=12345))
    assert base != tar_digest(_tar({"a.py": b"1", "b/c.txt": b"3"}))
    assert base != tar_digest(_tar({"a.py": b"1", "b/d.txt": b"2"}))
    assert base != tar_digest(_tar({"a.py": b"1", "b/c.txt": b"2"}, mode=0o755))
    assert base != tar_digest(_tar({"a.py": b"1"}))


# -- the engine ------------------------------------------------------------------------------


def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


class Counting(Environment):
    """A pure tool, an impure one and a pure one that reads the sandbox; each counts how
    often it really runs."""

    system_prompt = "Use the tools."
    max_turns = 6
    sandbox_config = SandboxConfig()

    def __init__(self) -> None:
        self.runs = {"square": 0, "clock": 0, "cat": 0}

    @tool(pure=True)
    async def square(self, x: int) -> str:
        """The square of x."""
        self.runs["square"] += 1
        return str(x * x)

    @tool(pure=True)  # a false declaration: the result changes on every call
    async def clock(self) -> str:
        """A counter."""
        self.runs["clock"] += 1
        return str(self.runs["clock"])

    @tool(pure=True)
    async def cat(self, path: str, sandbox: Sandbox) -> str:
        """A file's contents."""
        self.runs["cat"] += 1
        return (await sandbox.read_file(path)).decode()

    @tool
    async def write(self, path: str, text: str, sandbox: Sandbox) -> str:
        """Write a file (not pure)."""
        await sandbox.write_file(path, text)
        return "ok"

    async def reward(self, trajectory: Trajectory, state: EpisodeState) -> float:
        return 1.0


@pytest.fixture(autouse=True)
def fake_sandboxes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        "agentroll.rollout.episode_loop.open_sandbox", lambda cfg, **kw: FakeSandbox()
    )


async def run_all(
    env: Environment, script: list[str], n: int, tok: ChatTokenizer, **cfg: Any
) -> tuple[list[Trajectory], RolloutEngine]:
    tasks = [Task(id=f"t{i % 2}", data={"prompt": f"question {i % 2}"}) for i in range(n)]
    config = RolloutConfig(**{"progress": "off", "concurrency": 1, **cfg})
    async with RolloutEngine(MockBackend(script, tokenizer=tok), env, config, tokenizer=tok) as e:
        return [t async for t in e.run(tasks)], e


def results(trajs: list[Trajectory]) -> list[list[tuple[str, str, bool]]]:
    return [
        [(r.name, r.content, r.cached) for turn in t.turns for r in turn.tool_results]
        for t in trajs
    ]


async def test_a_pure_tool_runs_once_per_key(tok: ChatTokenizer) -> None:
    script = [call("square", '{"x": 7}'), call("square", '{"x": 8}'), "done"]
    env = Counting()
    trajs, engine = await run_all(env, script, 12, tok, tool_cache=True, tool_cache_verify=0.0)
    assert all(t.status == "ok" for t in trajs)
    contents = [[c for _, c, _ in r] for r in results(trajs)]
    assert contents == [["49", "64"]] * 12
    # two keys, each executed once, plus the tool's first two hits (verified)
    assert env.runs["square"] == 2 + 2
    assert engine.tool_cache is not None
    stats = engine.tool_cache.stats()
    assert stats["hits"] == 22 and stats["misses"] == 2 and stats["impure"] == []
    assert sum(cached for r in results(trajs) for _, _, cached in r) == 22 - 2
    # without the cache every call runs and nothing is marked cached
    env2 = Counting()
    plain, engine2 = await run_all(env2, script, 12, tok)
    assert engine2.tool_cache is None and env2.runs["square"] == 24
    assert [[c for _, c, _ in r] for r in results(plain)] == contents
    assert not any(cached for r in results(plain) for _, _, cached in r)


async def test_concurrent_calls_with_one_key_share_one_run(tok: ChatTokenizer) -> None:
    class Slow(Counting):
        @tool(pure=True)
        async def square(self, x: int) -> str:
            """The square of x, slowly."""
            self.runs["square"] += 1
            await asyncio.sleep(0.2)
            return str(x * x)

    env = Slow()
    script = [call("square", '{"x": 3}'), "done"]
    trajs, engine = await run_all(env, script, 8, tok, tool_cache=True, concurrency=8)
    assert [[c for _, c, _ in r] for r in results(trajs)] == [["9"]] * 8
    assert env.runs["square"] == 1  # the group's samples waited for the one run
    assert engine.tool_cache is not None
    stats = engine.tool_cache.stats()
    assert (stats["hits"], stats["joined"], stats["misses"]) == (7, 7, 1)
    assert sum(cached for r in results(trajs) for _, _, cached in r) == 7


async def test_an_impure_tool_is_found_and_no_longer_cached(tok: ChatTokenizer) -> None:
    env = Counting()
    trajs, engine = await run_all(env, [call("clock", "{}"), "done"], 10, tok, tool_cache=True)
    assert engine.tool_cache is not None
    assert engine.tool_cache.stats()["impure"] == ["clock"]
    assert env.runs["clock"] == 10  # the first verified hit differed; from then on it runs
    assert not any(cached for r in results(trajs) for _, _, cached in r)


async def test_the_sandbox_files_are_part_of_the_key(tok: ChatTokenizer) -> None:
    script = [
        call("write", '{"path": "f", "text": "one"}'),
        call("cat", '{"path": "f"}'),
        call("write", '{"path": "f", "text": "two"}'),
        call("cat", '{"path": "f"}'),
        "done",
    ]
    env = Counting()
    trajs, engine = await run_all(env, script, 6, tok, tool_cache=True, tool_cache_verify=0.0)
    cats = [[c for name, c, _ in r if name == "cat"] for r in results(trajs)]
    assert cats == [["one", "two"]] * 6  # never the result for the other file contents
    assert engine.tool_cache is not None and engine.tool_cache.stats()["misses"] == 2
    assert env.runs["cat"] == 2 + 2
