"""The project-made tiny checkpoint: deterministic bytes, the agreed shape, loadable offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from agentroll.engine.models import read_config
from agentroll.errors import ConfigError
from agentroll.model import create_tiny
from agentroll.model.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny(tmp_path_factory.mktemp("tiny"))


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def test_same_seed_same_bytes_other_seed_other_weights(tiny: Path, tmp_path: Path) -> None:
    again = create_tiny(tmp_path / "again")
    other = create_tiny(tmp_path / "other", seed=1)
    assert _files(again) == _files(tiny)
    assert set(_files(tiny)) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert (other / "model.safetensors").read_bytes() != (tiny / "model.safetensors").read_bytes()
    assert (other / "config.json").read_bytes() == (tiny / "config.json").read_bytes()


def test_config_is_qwen2_with_head_dim_64(tiny: Path) -> None:
    raw = json.loads((tiny / "config.json").read_text())
    tok = build_tokenizer()
    assert raw["architectures"] == ["Qwen2ForCausalLM"] and raw["model_type"] == "qwen2"
    assert raw["hidden_size"] // raw["num_attention_heads"] == 64 == raw["head_dim"]
    assert raw["vocab_size"] % 64 == 0 and raw["vocab_size"] >= tok.get_vocab_size()
    assert raw["eos_token_id"] == tok.token_to_id("<|im_end|>")
    assert raw["bos_token_id"] == tok.token_to_id("<|endoftext|>")
    cfg = read_config(tiny)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (2, 128, 2, 1)
    assert cfg.qkv_bias and not cfg.qk_norm


def test_shape_options_and_refusals(tmp_path: Path) -> None:
    cfg = read_config(create_tiny(tmp_path / "wide", layers=1, hidden=256, dtype="bfloat16"))
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (1, 4, 2, 64)
    assert cfg.dtype == "bfloat16"
    with pytest.raises(ConfigError, match="head_dim is 64"):
        create_tiny(tmp_path / "bad", hidden=128, heads=4)
    with pytest.raises(ConfigError, match="vocab_size"):
        create_tiny(tmp_path / "bad", vocab_size=64)
    with pytest.raises(ConfigError, match="dtype"):
        create_tiny(tmp_path / "bad", dtype="int8")


def test_loads_offline_in_transformers(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tiny)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "what is 2 + 3?"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits[0]
    probs = logits.softmax(-1)
    # Not degenerate: peaked but not one-hot, and different contexts give different tokens.
    assert logits.std(-1).min() > 1.0
    assert 0.05 < probs.max(-1).values.mean() < 0.95
    assert len(set(logits.argmax(-1).tolist())) > 3
