"""Check ``layout_roundtrip``: weights converted from FSDP2 shards (two processes, gloo on
the CPU, NCCL on CUDA) equal the trainer's full weights bit for bit in the serving dtype,
and the update built from them installs on the engine with the trainer's digest.

Invariant: the reference is the same seeded model before sharding, in the same run.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from agentroll.validate.common import CheckResult

WORLD = 2
BUCKET_BYTES = 64 << 10  # small, so that the tiny model takes several buckets


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_layout_roundtrip(
    model: Path, dtype: str = "bfloat16", device: str = "cpu", timeout: float = 300.0
) -> CheckResult:
    """Run the two ranks and read rank 0's findings."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="agentroll-layout-") as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "agentroll.validate.layout", str(rank), str(model)]
                + [dtype, device, str(out)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for rank in range(WORLD)
        ]
        logs = []
        try:
            for p in procs:
                logs.append(p.communicate(timeout=timeout)[0].decode(errors="replace"))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode for p in procs) or not out.exists():
            tail = " | ".join(log.strip().splitlines()[-1] for log in logs if log.strip())
            return CheckResult("layout_roundtrip", False, {"error": tail[-300:] or "no result"})
        figures: dict[str, Any] = json.loads(out.read_text())
    ok = bool(figures.pop("ok"))
    return CheckResult("layout_roundtrip", ok, figures)


def _rank_main(rank: int, model_dir: str, dtype: str, device: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from agentroll.engine.engine import EngineConfig, LLMEngine
    from agentroll.engine.models.decoder import load_model
    from agentroll.weights.exporter import WeightExporter
    from agentroll.weights.layout import Fuse, ServingLayout, convert, full_update
    from agentroll.weights.update import DTYPES, as_uint

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=WORLD)
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    model = load_model(model_dir, dtype=torch.float32, device=dev)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # fp32 masters after some training: not representable in bf16
        for p in model.parameters():
            p.add_(1e-3 * torch.randn(p.shape, generator=g).to(dev))
    reference = {n: t.detach().to("cpu", copy=True) for n, t in model.named_weights().items()}
    mesh = init_device_mesh(dev.type, (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = sum(isinstance(p, DTensor) for p in model.parameters())
    serving = ServingLayout(dtype=dtype)
    buckets = list(convert(model.named_parameters(), serving, bucket_bytes=BUCKET_BYTES))
    mlp = "model.layers.0.mlp."
    fused_layout = ServingLayout(
        dtype=dtype,
        fuse=(
            Fuse(
                target=mlp + "gate_up_proj.weight",
                sources=(mlp + "gate_proj.weight", mlp + "up_proj.weight"),
            ),
        ),
    )
    fused = {k: v for b in convert(model.named_parameters(), fused_layout) for k, v in b.items()}
    if rank == 0:
        target = DTYPES[dtype][0]

        def same(a: torch.Tensor, b: torch.Tensor) -> bool:
            return (
                a.shape == b.shape
                and a.dtype == b.dtype
                and bool((as_uint(a.contiguous()) == as_uint(b.contiguous())).all())
            )

        got = {n: t for b in buckets for n, t in b.items()}
        expect = {n: t.to(target) for n, t in reference.items()}
        bitexact = got.keys() == expect.keys() and all(same(got[n], expect[n]) for n in expect)
        gate_up = torch.cat([expect[mlp + "gate_proj.weight"], expect[mlp + "up_proj.weight"]])
        fused_ok = same(fused[mlp + "gate_up_proj.weight"], gate_up)
        sizes = [sum(t.numel() * t.element_size() for t in b.values()) for b in buckets]
        biggest = max(t.numel() * t.element_size() for t in got.values())
        bounded = all(s <= max(BUCKET_BYTES, biggest) for s in sizes)
        update = full_update(buckets, version=1)
        trainer = WeightExporter(lambda: reference, dtype=target).full()
        engine = LLMEngine(EngineConfig(model=model_dir, dtype=dtype, cpu_kernels=False))
        engine.apply_update(update)
        installed = engine.weight_store().verify()
        digest_ok = update.digest == trainer.digest == installed
        Path(out).write_text(
            json.dumps(
                {
                    "ok": bitexact
                    and fused_ok
                    and bounded
                    and digest_ok
                    and sharded > 0
                    and len(buckets) > 1,
                    "ranks": WORLD,
                    "sharded_tensors": sharded,
                    "tensors": len(got),
                    "buckets": len(buckets),
                    "max_bucket_kb": round(max(sizes) / 1024, 1),
                    "dtype": dtype,
                    "bitexact": bitexact,
                    "fused_bitexact": fused_ok,
                    "digest_equal": digest_ok,
                }
            )
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5])
