"""Offline tokenizer factory: a byte-level BPE trained on an embedded corpus, with a
Qwen/Hermes-style chat template that supports tool calls.

Invariants: no network, deterministic output for a given vocabulary size; the special tokens
and template match the Qwen2 conventions (``<|im_start|>``, ``<|im_end|>``, ``<tool_call>``),
so the files load in ``tokenizers``, ``transformers`` and vLLM alike.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from agentroll.chat import ChatTokenizer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Not "special": they stay in decoded text so the tool-call parser can see them.
TAG_TOKENS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]

CHAT_TEMPLATE = """\
{%- if tools %}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}


# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'user' or message.role == 'system' or (message.role == 'assistant' and not message.tool_calls) %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}
<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}
{% if loop.first and not message.content %}{% else %}
{% endif %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{%- endfor %}
<|im_end|>
{% elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
<|im_start|>user
{%- endif %}

<tool_response>
{{ message.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
<|im_end|>
{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

_WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "and",
    "in",
    "is",
    "it",
    "you",
    "that",
    "he",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "his",
    "they",
    "be",
    "at",
    "one",
    "have",
    "this",
    "from",
    "or",
    "had",
    "by",
    "word",
    "but",
    "what",
    "some",
    "we",
    "can",
    "out",
    "other",
    "were",
    "all",
    "there",
    "when",
    "up",
    "use",
    "your",
    "how",
    "said",
    "each",
    "she",
    "which",
    "do",
    "their",
    "time",
    "if",
    "will",
    "way",
    "about",
    "many",
    "then",
    "them",
    "write",
    "would",
    "like",
    "so",
    "these",
    "her",
    "long",
    "make",
    "thing",
    "see",
    "him",
    "two",
    "has",
    "look",
    "more",
    "day",
    "could",
    "go",
    "come",
    "did",
    "number",
    "sound",
    "no",
    "most",
    "people",
    "my",
    "over",
    "know",
    "water",
    "than",
    "call",
    "first",
    "who",
    "may",
    "down",
    "side",
    "been",
    "now",
    "find",
    "answer",
    "result",
    "error",
    "tool",
    "function",
    "python",
    "print",
    "return",
    "def",
    "import",
    "class",
    "value",
    "true",
    "false",
    "none",
    "calculate",
    "compute",
    "guess",
    "number",
    "higher",
    "lower",
    "correct",
    "test",
    "pass",
    "fail",
    "code",
    "fix",
    "file",
    "shell",
    "assistant",
    "user",
    "system",
    "helpful",
    "question",
    "solve",
    "step",
    "think",
    "final",
    "please",
    "let",
    "me",
    "check",
]


def _corpus() -> list[str]:
    """A small deterministic corpus: chat markup, JSON tool calls, code, arithmetic, prose."""
    lines: list[str] = []
    for i, w in enumerate(_WORDS):
        nxt = _WORDS[(i * 7 + 3) % len(_WORDS)]
        lines.append(f"{w} {nxt} {w.capitalize()} {nxt}. {w}, {nxt}?")
        lines.append(f'{{"name": "{w}", "arguments": {{"{nxt}": "{w} {nxt}", "n": {i}}}}}')
        lines.append(f"def {w}_{nxt}(x):\n    return x + {i}\n")
        lines.append(f"{i} + {i * 3} = {i * 4}; {i} * {i + 2} - {i // 2} = {i * (i + 2) - i // 2}")
    lines.append(CHAT_TEMPLATE)
    return lines * 4


def build_tokenizer(vocab_size: int = 2048) -> Tokenizer:
    """Train the byte-level BPE tokenizer (deterministic for a given ``vocab_size``)."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS) - len(TAG_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return tok


@lru_cache(maxsize=4)
def tiny_chat_tokenizer(vocab_size: int = 2048) -> ChatTokenizer:
    """The project-made tokenizer with its chat template, built in memory (cached)."""
    return ChatTokenizer(
        build_tokenizer(vocab_size),
        CHAT_TEMPLATE,
        eot_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )


def save_tokenizer(out_dir: str | Path, vocab_size: int = 2048) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (Qwen2 style) into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab_size)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
        for t in SPECIAL_TOKENS + TAG_TOKENS
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out
