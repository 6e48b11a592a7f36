"""Apply side of weight sync on the real engine: deltas from a real optimizer step, and every
refused update leaves the replica bit-identical."""

import os
from pathlib import Path

import msgspec
import pytest
import torch

from agentroll.backends.base import GenerationRequest, SamplingParams
from agentroll.backends.torch import TorchBackend
from agentroll.errors import WeightSyncError
from agentroll.weights.exporter import WeightExporter
from agentroll.weights.transport import describe
from agentroll.weights.update import TensorUpdate, WeightUpdate, model_digest


@pytest.fixture
def trainer(tiny_model: Path) -> torch.nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (4, 32), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad()
    loss.backward()
    opt.step()


def replace_tensor(update: WeightUpdate, index: int, **changes: object) -> WeightUpdate:
    tensors = list(update.tensors)
    tensors[index] = msgspec.structs.replace(tensors[index], **changes)
    return msgspec.structs.replace(update, tensors=tuple(tensors))


async def test_delta_from_a_real_optimizer_step_is_bit_exact(
    tiny_model: Path, trainer: torch.nn.Module
) -> None:
    exporter = WeightExporter(trainer, dtype=torch.bfloat16)
    opt = torch.optim.Adam(trainer.parameters(), lr=1e-4)
    async with TorchBackend(tiny_model, dtype="bfloat16") as backend:
        store = backend.engine.weight_store()
        assert store.digest() == exporter.full().digest  # same starting bytes
        for step in range(2):
            train_step(trainer, opt, step)
            update = exporter.export()
            assert update.kind == "delta" and update.base_version == step
            changed = sum(t.num_changed for t in update.tensors if t.encoding == "delta")
            total = sum(p.numel() for p in trainer.parameters())
            assert 0 < changed < total  # bf16 rounding hides many small steps: a real delta
            await backend.pause()
            await backend.apply(update)
            await backend.resume()
            assert backend.policy_version == update.version == step + 1
            assert store.digest() == update.digest == store.verify()
        req = GenerationRequest(
            request_id="g", prompt_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=4)
        )
        versions = [c.policy_version async for c in backend.generate(req)]
        assert versions and all(v == 2 for v in versions)


@pytest.mark.parametrize(
    "fault",
    [
        "flipped_payload_bit",
        "truncated_payload",
        "wrong_base",
        "unknown_tensor",
        "wrong_shape",
        "wrong_digest",
    ],
)
async def test_refused_updates_leave_the_replica_unchanged(
    tiny_model: Path, trainer: torch.nn.Module, fault: str
) -> None:
    exporter = WeightExporter(trainer, dtype=torch.bfloat16)
    opt = torch.optim.SGD(trainer.parameters(), lr=1e-2)
    train_step(trainer, opt, 7)
    good = exporter.export()
    big = max(range(len(good.tensors)), key=lambda i: len(good.tensors[i].payload))
    payload = good.tensors[big].payload
    if fault == "flipped_payload_bit":
        bad = replace_tensor(
            good, big, payload=payload[:-3] + bytes([payload[-3] ^ 0x10]) + payload[-2:]
        )
    elif fault == "truncated_payload":
        bad = replace_tensor(good, big, payload=payload[: len(payload) // 2])
    elif fault == "wrong_base":
        bad = msgspec.structs.replace(good, base_version=5)
    elif fault == "unknown_tensor":
        bad = replace_tensor(good, big, name="model.layers.99.mlp.up_proj.weight")
    elif fault == "wrong_shape":
        bad = replace_tensor(good, big, shape=(1, 2, 3))
    else:
        bad = msgspec.structs.replace(good, digest="0" * 32)
    async with TorchBackend(tiny_model, dtype="bfloat16") as backend:
        store = backend.engine.weight_store()
        before = store.verify()
        await backend.pause()
        with pytest.raises(WeightSyncError) as refused:
            await backend.apply(bad)
        assert store.verify() == before and backend.policy_version == 0
        # what the header shows is refused from the header alone, with the same message
        # (a receiver runs this check before it reads a payload byte)
        if fault in ("wrong_base", "unknown_tensor", "wrong_shape"):
            with pytest.raises(WeightSyncError) as early:
                store.check(describe(bad))
            assert str(early.value) == str(refused.value)
        else:
            store.check(describe(bad))  # only the payloads or the digest give it away
        await backend.apply(good)  # the retry succeeds
        await backend.resume()
        assert store.verify() == good.digest and backend.policy_version == 1


def test_exporter_sends_full_updates_to_replicas_too_far_behind(trainer: torch.nn.Module) -> None:
    exporter = WeightExporter(trainer, dtype=torch.bfloat16)
    opt = torch.optim.SGD(trainer.parameters(), lr=1e-2)
    train_step(trainer, opt, 1)
    first = exporter.export()
    train_step(trainer, opt, 2)
    second = exporter.export()
    assert exporter.update_for(2) is None
    assert exporter.update_for(1) is second
    full = exporter.update_for(0)
    assert full is not None and full.kind == "full" and full.base_version == -1
    assert full.digest == second.digest != first.digest
    assert all(t.encoding == "full" or t.num_changed >= 0 for t in full.tensors)


def test_digest_is_order_independent_and_name_sensitive() -> None:
    assert model_digest({"a": "1", "b": "2"}) == model_digest([("b", "2"), ("a", "1")])
    assert model_digest({"a": "1", "b": "2"}) != model_digest({"a": "2", "b": "1"})
    t = TensorUpdate(
        name="x", dtype="float32", shape=(2, 3), encoding="full", payload=b"", checksum=""
    )
    assert t.numel == 6


async def test_http_transport_into_a_live_engine(
    tiny_model: Path, trainer: torch.nn.Module
) -> None:
    """Trainer -> HTTP (127.0.0.1) -> replica endpoint -> pause, apply, resume."""
    from weights_server import serve_weights

    from agentroll.weights.http import HttpTransport

    exporter = WeightExporter(trainer, dtype=torch.bfloat16)
    opt = torch.optim.Adam(trainer.parameters(), lr=1e-4)
    async with TorchBackend(tiny_model, dtype="bfloat16") as backend:

        async def on_update(update: WeightUpdate) -> None:
            await backend.pause()
            try:
                await backend.apply(update)
            finally:
                await backend.resume()

        async with serve_weights(on_update) as url:
            assert url.startswith("http://127.0.0.1:")
            sender = HttpTransport(url)
            try:
                for step in range(2):
                    train_step(trainer, opt, step)
                    update = exporter.export()
                    await sender.send(update)
                    assert backend.policy_version == update.version
                    assert backend.engine.weight_store().verify() == update.digest
                stale = msgspec.structs.replace(update, version=9, base_version=0)
                with pytest.raises(WeightSyncError, match=r"409|based on version"):
                    await sender.send(stale)
                assert backend.policy_version == 2
            finally:
                await sender.aclose()


async def test_a_staged_update_that_changed_nothing_swaps_in(
    tiny_model: Path, trainer: torch.nn.Module
) -> None:
    """An export right after the last one has no changed tensor: staged and swapped in, it
    only moves the version on (the install's one-call copy refused an empty list)."""
    exporter = WeightExporter(trainer, dtype=torch.float32)
    async with TorchBackend(tiny_model) as backend:
        store = backend.engine.weight_store()
        before = store.digest()
        update = exporter.export()
        assert all(t.num_changed == 0 for t in update.tensors if t.encoding == "delta")
        await backend.stage(update)
        assert await backend.swap() == update.version == backend.policy_version
        assert store.digest() == before == store.verify()
