"""The documentation builds and its examples run, so neither can rot.

Invariants: ``mkdocs build --strict`` succeeds (no broken link, no missing page, no
docstring the API reference cannot render); every ```python block of README.md and
docs/*.md runs in a fresh interpreter in an empty directory, unless the line right before
it is ``<!-- no-run -->`` followed by the reason; the generated recipe reference equals its
generator's output.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NO_RUN = re.compile(r"^<!-- no-run -->\s*<!--\s*\S.*-->\s*$")  # the reason is required
BLOCK_TIMEOUT_S = 240  # the first TorchBackend of a machine builds the CPU kernels


def _python_blocks(path: Path) -> list[tuple[int, str, str]]:
    """``(line, code, line before)`` of every ```python block in ``path``."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            before = lines[start - 1] if start else ""
            blocks.append((start + 1, "\n".join(lines[start + 1 : j]) + "\n", before))
            i = j
        i += 1
    return blocks


BLOCKS = [
    pytest.param(path, line, code, before, id=f"{path.relative_to(ROOT)}:{line}")
    for path in DOC_FILES
    for line, code, before in _python_blocks(path)
]


def test_there_are_examples_to_run() -> None:
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize(("path", "line", "code", "before"), BLOCKS)
def test_code_block_runs(path: Path, line: int, code: str, before: str, tmp_path: Path) -> None:
    if before.startswith("<!-- no-run"):
        assert NO_RUN.match(before), (
            f"{path.name}:{line}: an opted-out block needs its reason next to it, "
            "as `<!-- no-run --> <!-- why -->`"
        )
        pytest.skip(f"opted out: {before}")
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    assert result.returncode == 0, (
        f"the python block at {path.name}:{line} failed:\n{result.stdout}\n{result.stderr}"
    )


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr}"
    assert (tmp_path / "site" / "api" / "index.html").is_file()


def test_recipe_reference_is_current() -> None:
    spec = importlib.util.spec_from_file_location(
        "gen_recipe_reference", ROOT / "docs" / "gen_recipe_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    committed = (ROOT / "docs" / "recipes-reference.md").read_text(encoding="utf-8")
    assert committed == module.render(), (
        "docs/recipes-reference.md is stale; run: python docs/gen_recipe_reference.py"
    )


def test_readme_is_a_front_door() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) < 150
    assert "../" not in text  # every link stays inside the repository
