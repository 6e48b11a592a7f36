"""The built wheel holds the whole package and its command runs from it alone.

The wheel is built from this checkout without network (the venv's setuptools) and
installed with ``--no-deps`` into an empty target directory; its dependencies come from
this venv, so the test needs no download, while agentroll itself is the installed copy.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _packages_in_tree() -> set[str]:
    found = {
        ".".join(p.parent.relative_to(REPO).parts)
        for p in (REPO / "agentroll").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    return found | {"agentroll.environments", "agentroll.tools"}


def test_wheel_installs_and_its_cli_runs(tmp_path: Path) -> None:
    dist, target = tmp_path / "dist", tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(dist), str(REPO)],
        check=True, timeout=300,
    )  # fmt: skip
    (wheel,) = dist.glob("agentroll-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    in_wheel = {n.rsplit("/", 1)[0].replace("/", ".") for n in names if n.endswith("__init__.py")}
    assert _packages_in_tree() <= in_wheel, sorted(_packages_in_tree() - in_wheel)
    assert any(n.startswith("agentroll/engine/csrc/") and n.endswith(".cpp") for n in names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "agentroll = agentroll.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()

    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
         str(wheel)],
        check=True, timeout=300,
    )  # fmt: skip
    # the installed copy first; this venv's site-packages only for the dependencies
    deps = [p for p in sys.path if p.endswith("site-packages")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), *deps])}
    code = (
        "import sys, agentroll, agentroll.cli, agentroll.environments.calculator; "
        f"assert agentroll.__file__.startswith({str(target)!r}), agentroll.__file__; "
        "sys.argv = ['agentroll', '--help']; agentroll.cli.main()"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", code],  # -S: no .pth files, so no editable install
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "usage: agentroll" in out.stdout
