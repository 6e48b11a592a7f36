"""Shared fixtures.  Tests marked with a resource (bwrap, docker, vllm, ray) skip with a
reason when it is absent, unless the resource is listed in AGENTROLL_REQUIRE (``make test``
sets it): then a skip is turned into a failure, so CI never skips silently."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentroll.chat import ChatTokenizer
from agentroll.tokenizer import tiny_chat_tokenizer

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
