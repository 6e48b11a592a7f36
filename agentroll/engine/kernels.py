"""The engine's C++ CPU kernels (``csrc/cpu_kernels.cpp``): built once per machine, then loaded.

Invariants: a build is keyed by the source, torch, Python and the CPU's feature flags, so a
changed source or another CPU never loads a stale build; concurrent processes build it once
and a half-written library is never loaded; a failed build is reported once and the engine
runs on the torch path, never failing a request.  ``AGENTROLL_CPU_KERNELS=0`` turns them off.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
# -fno-trapping-math lets g++ vectorise floor (fast_exp); it changes no rounding.  -fopenmp
# compiles ATen's inline parallel_for into OpenMP regions (without it they run on one
# thread); the library links no OpenMP runtime of its own, so they run on the libgomp torch
# loaded, with torch's thread count.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-trapping-math")
_state: dict[str, Any] = {}  # "module": ModuleType | None once tried, "error": str
_lock = threading.Lock()  # replicas start their engines on several threads at once


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build_key() -> str:
    """The cache key of this source built here (source, torch, Python, CPU, flags)."""
    h = hashlib.sha256(SOURCE.read_bytes())
    for part in (torch.__version__, sys.version, platform.machine(), _cpu_flags(), *CFLAGS):
        h.update(part.encode())
    return h.hexdigest()[:16]


def kernel_dir() -> Path:
    default = Path.home() / ".cache" / "agentroll" / "kernels"
    return Path(os.environ.get("AGENTROLL_KERNEL_DIR", str(default)))


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ninja_on_path() -> None:
    """torch runs ``ninja`` from PATH; the pip package's binary may not be on it (a venv that
    was not activated)."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"


def build(root: Path | None = None) -> ModuleType:
    """Build (or find) the extension under ``root`` and import it.  Raises on failure.

    The extension is compiled with ``torch.utils.cpp_extension`` (g++ and ninja) into
    ``$AGENTROLL_KERNEL_DIR`` (default ``~/.cache/agentroll/kernels``) under ``build_key`` (it is
    built with ``-march=native``); concurrent processes build it once (file lock) and a finished
    build is moved into place atomically.
    """
    from torch.utils import cpp_extension

    root = root or kernel_dir()
    _ninja_on_path()
    key = build_key()
    name = f"agentroll_cpu_kernels_{key}"
    final = root / key / f"{name}.so"
    if name in sys.modules:  # this process has it already
        return sys.modules[name]
    if final.exists():
        return _import(name, final)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it right now
        if not final.exists():
            print(
                f"[agentroll] compiling the engine's CPU kernels into {root / key} "
                "(once per machine, about 30 s)",
                file=sys.stderr,
                flush=True,
            )
            start = time.monotonic()
            with tempfile.TemporaryDirectory(prefix=f"{key}.build-", dir=root) as tmp:
                cpp_extension.load(
                    name,
                    [str(SOURCE)],
                    extra_cflags=list(CFLAGS),
                    build_directory=tmp,
                    verbose=False,
                )
                built = Path(tmp) / f"{name}.so"
                final.parent.mkdir(exist_ok=True)
                staged = final.with_suffix(f".so.{os.getpid()}")
                shutil.copyfile(built, staged)
                os.replace(staged, final)
            print(
                f"[agentroll] CPU kernels built in {time.monotonic() - start:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    loaded = sys.modules.get(name)
    return loaded if loaded is not None else _import(name, final)


def get() -> ModuleType | None:
    """The kernels module, or ``None`` when turned off or unbuildable (reported once).

    On a small model a decode step is mostly the cost of many small torch ops (RMSNorm is seven
    of them, RoPE eight), of gathering every sequence's K/V out of the paged cache before
    attention, of the Python between ops, and of MKL's sgemm, which repacks the weights on every
    call and runs AVX2 code on AMD CPUs.  The kernels do RMSNorm, SiLU-and-multiply and RoPE in
    one pass each, attend straight from the paged cache, multiply by blocked calls of oneDNN's
    brgemm micro-kernels (through torch's ``at::native::cpublas``), and run a whole decoder step
    in one call (``decoder_forward``, which releases the GIL); the model runner uses them for
    fp32 on the CPU and falls back to plain torch everywhere else (other dtypes, CUDA, or when
    they cannot be built).  A failed build is reported once, with what to do.
    """
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" not in _state:
            _state["module"] = _load()
    return _state["module"]


def _load() -> ModuleType | None:
    module = None
    if os.environ.get("AGENTROLL_CPU_KERNELS", "1") != "0":
        try:
            module = build()
        except Exception as exc:  # a missing compiler, ninja, headers...: run without them
            _state["error"] = f"{type(exc).__name__}: {exc}"
            print(
                "[agentroll] warning: the engine's CPU kernels could not be built "
                f"({_state['error'].splitlines()[0][:300]}); the built-in engine runs on plain "
                "torch ops, about 1.5-2x slower on small models.  Install g++ and ninja "
                "(`apt-get install g++ ninja-build`) or set AGENTROLL_CPU_KERNELS=0 to "
                "silence this.",
                file=sys.stderr,
                flush=True,
            )
    return module


def main(argv: list[str] | None = None) -> int:
    """``python -m agentroll.engine.kernels``: build now (make does it before tests/demo)."""
    del argv
    if os.environ.get("AGENTROLL_CPU_KERNELS", "1") == "0":
        print("[agentroll] AGENTROLL_CPU_KERNELS=0: not building the CPU kernels")
        return 0
    if get() is None:
        return 0  # the warning said why; the engine still works
    print(f"[agentroll] CPU kernels ready ({kernel_dir() / build_key()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
