"""The vLLM weight-transfer helpers that need neither vLLM nor CUDA: digests of served
(stacked) parameters, sparse patches and their inverse, the probe's reference scorer.  The
NCCL path itself needs two CUDA devices (tests/backends/test_vllm_gpu.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from agentroll.backends._vllm_transfer import (
    EMPTY_SHA256,
    NCCLSender,
    ReferenceScorer,
    probe_ids,
    served_digests,
    sparse_patches,
    verify_served,
)
from agentroll.errors import BackendError, WeightSyncError

L = "model.layers.0"


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(
        t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    ).hexdigest()


@pytest.fixture
def host() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (16, 8),
        f"{L}.self_attn.q_proj.weight": (8, 8),
        f"{L}.self_attn.k_proj.weight": (4, 8),
        f"{L}.self_attn.v_proj.weight": (4, 8),
        f"{L}.self_attn.q_proj.bias": (8,),
        f"{L}.self_attn.k_proj.bias": (4,),
        f"{L}.self_attn.v_proj.bias": (4,),
        f"{L}.mlp.gate_proj.weight": (12, 8),
        f"{L}.mlp.up_proj.weight": (12, 8),
        f"{L}.input_layernorm.weight": (8,),
    }
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def _reported(host: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> dict[str, str]:
    """What vLLM's compute_weight_checksums would say for these weights (built by hand)."""
    a = f"{L}.self_attn"
    m = f"{L}.mlp"
    served = {
        "model.embed_tokens.weight": host["model.embed_tokens.weight"],
        f"{a}.qkv_proj.weight": torch.cat([host[f"{a}.{x}_proj.weight"] for x in "qkv"]),
        f"{a}.qkv_proj.bias": torch.cat([host[f"{a}.{x}_proj.bias"] for x in "qkv"]),
        f"{m}.gate_up_proj.weight": torch.cat(
            [host[f"{m}.gate_proj.weight"], host[f"{m}.up_proj.weight"]]
        ),
        f"{L}.input_layernorm.weight": host[f"{L}.input_layernorm.weight"],
        "lm_head.weight": host["model.embed_tokens.weight"],  # tied
    }
    return {f"dp0:pp0:pcp0:tp0:{n}": _sha(t.to(dtype)) for n, t in served.items()}


def test_served_parameters_are_rebuilt_from_checkpoint_tensors(host: dict) -> None:
    result = verify_served(host, [_reported(host)], torch.float32)
    assert result.checked == 6 and not result.unverifiable


def test_the_served_dtype_is_what_is_compared(host: dict) -> None:
    assert verify_served(host, [_reported(host, torch.bfloat16)], torch.bfloat16).checked == 6
    with pytest.raises(WeightSyncError):
        verify_served(host, [_reported(host, torch.bfloat16)], torch.float32)


def test_one_changed_element_of_a_stacked_parameter_is_named(host: dict) -> None:
    served = {k: v.clone() for k, v in host.items()}
    served[f"{L}.self_attn.v_proj.bias"][3] += 1e-6  # the last member of qkv_proj.bias
    with pytest.raises(WeightSyncError, match=r"qkv_proj\.bias"):
        verify_served(host, [_reported(served)], torch.float32)


def test_repacked_unknown_and_sharded_parameters_are_reported_not_passed(host: dict) -> None:
    reported = _reported(host)
    key = f"dp0:pp0:pcp0:tp0:{L}.mlp.gate_up_proj.weight"
    reported[key] = EMPTY_SHA256  # vLLM's CPU build repacks linear weights
    reported["dp0:pp0:pcp0:tp0:model.rotary.inv_freq"] = "ab" * 32
    result = verify_served(host, [reported], torch.float32)
    assert result.checked == 5
    assert result.unverifiable == {
        f"{L}.mlp.gate_up_proj.weight": "repacked by the engine (CPU)",
        "model.rotary.inv_freq": "no checkpoint tensor",
    }
    two = verify_served(host, [reported, reported], torch.float32)
    assert two.checked == 0 and set(two.unverifiable.values()) == {"sharded across workers"}


def test_digests_of_unstacked_names() -> None:
    t = {"a.weight": torch.arange(6.0).view(2, 3)}
    assert served_digests(t, ["a.weight", "b.weight"], torch.float32) == {
        "a.weight": _sha(t["a.weight"]),
        "b.weight": None,
    }


def test_sparse_patches_carry_exactly_the_changed_bits_and_invert() -> None:
    old = {"w": torch.tensor([0.0, 1.0, 2.0, float("nan"), 4.0]), "u": torch.ones(3)}
    new = {"w": torch.tensor([-0.0, 1.0, 2.5, float("nan"), 4.0]), "u": torch.ones(3)}
    patches = sparse_patches(old, new)
    assert [p.name for p in patches] == ["w"]  # "u" is unchanged: no patch
    (p,) = patches
    assert p.indices.dtype == torch.int32 and p.indices.tolist() == [0, 2]  # -0.0 counts
    assert p.shape == (5,)

    def apply(base: torch.Tensor, patch: object) -> torch.Tensor:
        out = base.clone().reshape(-1)
        out[patch.indices.long()] = patch.values  # type: ignore[attr-defined]
        return out.view(base.shape)

    after = apply(old["w"], p)
    assert torch.equal(after.view(torch.int32), new["w"].view(torch.int32))
    back = apply(after, p.inverse(old["w"]))
    assert torch.equal(back.view(torch.int32), old["w"].view(torch.int32))


def test_sparse_patches_refuse_mismatched_tensors() -> None:
    with pytest.raises(WeightSyncError, match="does not match"):
        sparse_patches({"w": torch.zeros(3)}, {"w": torch.zeros(4)})
    with pytest.raises(WeightSyncError, match="does not match"):
        sparse_patches({}, {"w": torch.zeros(4)})


def test_the_reference_scorer_is_the_builtin_engines_score(tiny_model: Path) -> None:
    from agentroll.engine.engine import EngineConfig, LLMEngine
    from agentroll.engine.models import read_tensors

    tensors = read_tensors(tiny_model)
    scorer = ReferenceScorer(tiny_model, "float32")
    ids = probe_ids(scorer.vocab_size, 40)
    assert ids == probe_ids(scorer.vocab_size, 40) and len(ids) == 40
    engine = LLMEngine(EngineConfig(model=str(tiny_model), num_blocks=64))
    assert scorer.score(tensors, ids) == engine.score(ids)
    # other weights, other logprobs: the probe sees a stale engine
    changed = {n: t * 1.01 if n.endswith("norm.weight") else t for n, t in tensors.items()}
    assert (
        max(abs(a - b) for a, b in zip(scorer.score(changed, ids), engine.score(ids), strict=True))
        > 1e-4
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_nccl_transfer_without_cuda_says_what_to_use() -> None:
    with pytest.raises(BackendError, match="transfer='reload'"):
        NCCLSender(object(), "sparse_nccl", device="cuda:1")
