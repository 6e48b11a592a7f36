"""Chat rendering, token-in / token-out (tool-call parsing: ``agentroll.parsers``).

Invariants: the prompt is rendered once, then only each new environment message is
(``continuation_ids``), so every request's prompt is a prefix of the final trajectory (a
template that breaks this raises ``ChatTemplateError``); message content never becomes a
special token; parsing never raises on model output (problems come back as error strings).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import msgspec
from tokenizers import Tokenizer

from agentroll._fs import read_json_object
from agentroll.errors import ChatTemplateError, ConfigError

# the tool-call parsers live in agentroll.parsers; re-exported here for existing imports
from agentroll.parsers import _PARSER_PLUGINS as _PARSER_PLUGINS
from agentroll.parsers import TOOL_PARSERS as TOOL_PARSERS
from agentroll.parsers import HermesToolParser as HermesToolParser
from agentroll.parsers import ParsedOutput as ParsedOutput
from agentroll.parsers import ToolParser as ToolParser
from agentroll.parsers import get_tool_parser as get_tool_parser
from agentroll.types import Message, ToolSpec


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def compile_template(source: str) -> jinja2.Template:
    """Compile a Hugging Face chat template in a sandboxed jinja environment."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    if not isinstance(source, str):
        raise ConfigError(f"a chat template must be a string, got {type(source).__name__}")
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"the chat template does not compile: {exc} (line {exc.lineno})") from exc


_CACHE_MAX_PIECE = 4096  # encode() caches pieces up to this many characters
_CACHE_MAX_ENTRIES = 4096
# a special token's text inside a message's content stands in the rendered text as
# "\ue000<k>\ue001" (k: its index in a list of literals) until it is encoded as plain text
_LITERAL = re.compile("\ue000(\\d+)\ue001")
_MISSING: Any = object()

# A fixed conversation the incremental renderer extends; never shown to the model.
_ANCHOR = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    {"role": "assistant", "content": "A"},
]


class ChatTokenizer:
    """A fast tokenizer plus its chat template.

    ``eot_token`` ends an assistant turn (``<|im_end|>`` for Qwen/Hermes templates) and is
    the default stop token.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str,
        *,
        eot_token: str,
        bos_token: str | None = None,
        pad_token: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._template = compile_template(chat_template)
        eot_id = tokenizer.token_to_id(eot_token)
        if eot_id is None:
            raise ConfigError(f"end-of-turn token {eot_token!r} is not in the vocabulary")
        self.eot_token = eot_token
        self.eot_id: int = eot_id
        self.bos_token = bos_token
        self.pad_token = pad_token
        self.pad_id = tokenizer.token_to_id(pad_token) if pad_token else eot_id
        self._init_encode_cache()
        self._anchor_text = self.render(_ANCHOR)
        self._fast_shapes: dict[tuple[Any, ...], tuple[list[str] | None, Any]] = {}
        # The text a template puts after an assistant turn's end-of-turn token ("\n" for
        # Qwen): the sampled ids stop at the token, the template's rendering goes on.
        idx = self._anchor_text.rfind(eot_token)
        if idx < 0:
            raise ChatTemplateError(
                f"the chat template never emits the end-of-turn token {eot_token!r}"
            )
        self._eot_tail = self._anchor_text[idx + len(eot_token) :]

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ChatTokenizer:
        """Load ``tokenizer.json`` and ``tokenizer_config.json`` (chat_template, eos) from a
        Hugging Face style directory, without transformers."""
        p = Path(path)
        tok_file = p / "tokenizer.json"
        cfg_file = p / "tokenizer_config.json"
        if not tok_file.exists() or not cfg_file.exists():
            raise ConfigError(
                f"{p} has no tokenizer.json/tokenizer_config.json; make one with "
                "`agentroll model create-tiny DIR` or point at a Hugging Face checkpoint"
            )
        cfg = read_json_object(cfg_file)
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next(
                (
                    t.get("template")
                    for t in template
                    if isinstance(t, dict) and t.get("name") == "default"
                ),
                None,
            )
        if not template:
            raise ConfigError(f"{cfg_file} has no chat_template")
        if not isinstance(template, str):
            raise ConfigError(f"{cfg_file}: chat_template must be a string")

        def token(name: str) -> str | None:
            val = cfg.get(name)
            return val.get("content") if isinstance(val, dict) else val

        names = {n: token(n) for n in ("eos_token", "bos_token", "pad_token")}
        bad = [n for n, v in names.items() if v is not None and not isinstance(v, str)]
        if bad:
            raise ConfigError(f"{cfg_file}: {bad[0]} must be a string (or {{content: ...}})")
        eot = names["eos_token"]
        if eot is None:
            raise ConfigError(f"{cfg_file} has no eos_token")
        try:
            tokenizer = Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # the tokenizers library raises a bare Exception
            raise ConfigError(
                f"{tok_file} is not a readable tokenizer ({exc}); copy it again from the "
                "checkpoint (the tiny model: `agentroll model create-tiny DIR`)"
            ) from exc
        try:
            return cls(
                tokenizer,
                template,
                eot_token=eot,
                bos_token=names["bos_token"],
                pad_token=names["pad_token"],
            )
        except ConfigError as exc:
            raise ConfigError(f"{cfg_file}: {exc}") from exc

    # -- tokens ----------------------------------------------------------------------------

    @property
    def added_token_ids(self) -> frozenset[int]:
        """Ids of the tokenizer's added tokens (``<|im_end|>``, ``<tool_call>``, ...): the ones
        message contents can never produce (their text is encoded as plain text)."""
        return self._added_id_set

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def _init_encode_cache(self) -> None:
        # A fast tokenizer splits its input at added tokens and encodes the pieces
        # independently, so pieces (a system prompt with tool schemas, "user\n", ...) can be
        # encoded once and reused.  Enabled only if this tokenizer is seen to behave so.
        added = sorted(
            (t.content for t in self.tokenizer.get_added_tokens_decoder().values()),
            key=len,
            reverse=True,
        )
        self._added_ids: dict[str, int] = {
            t.content: i for i, t in self.tokenizer.get_added_tokens_decoder().items()
        }
        self._split_re = re.compile("(" + "|".join(map(re.escape, added)) + ")") if added else None
        # what a message's content must not smuggle in as control tokens: the added tokens'
        # texts, and the literal marker itself (so every marker in a rendering is ours)
        self._content_re = re.compile("|".join([*map(re.escape, added), "\ue000"]))
        self._added_id_set = frozenset(self._added_ids.values())
        self._piece_cache: dict[str, list[int]] = {}
        probe = f"Hello  world 12{self.eot_token}\n x  y{self.eot_token}z"
        self._can_cache = self._split_re is not None and self._encode_pieces(
            probe
        ) == self._encode_raw(probe)

    def _encode_raw(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def _encode_pieces(self, text: str) -> list[int]:
        assert self._split_re is not None
        ids: list[int] = []
        cache = self._piece_cache
        # re.split with a group alternates: text, added token, text, added token, ..., text
        for i, piece in enumerate(self._split_re.split(text)):
            if i & 1:
                ids.append(self._added_ids[piece])
            elif piece:
                cached = cache.get(piece)
                if cached is None:
                    cached = self._encode_raw(piece)
                    if len(piece) <= _CACHE_MAX_PIECE:
                        if len(cache) >= _CACHE_MAX_ENTRIES:
                            cache.clear()
                        cache[piece] = cached
                ids.extend(cached)
        return ids

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens in the text are recognised, none added)."""
        if self._can_cache:
            return self._encode_pieces(text)
        return self._encode_raw(text)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    # -- rendering -------------------------------------------------------------------------

    def render(
        self,
        messages: Sequence[Message | dict[str, Any]],
        *,
        tools: Sequence[ToolSpec] | None = None,
        add_generation_prompt: bool = False,
    ) -> str:
        """Render ``messages`` with the chat template to text."""
        msgs = [m.to_template() if isinstance(m, Message) else m for m in messages]
        try:
            return self._template.render(
                messages=msgs,
                tools=[t.to_openai() for t in tools] if tools else None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eot_token,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def prompt_ids(
        self, messages: Sequence[Message], *, tools: Sequence[ToolSpec] | None = None
    ) -> list[int]:
        """Ids of the first prompt: all ``messages`` plus the generation prompt.  A special
        token's text inside a message's content is encoded as text, never as the token
        (see ``continuation_ids``)."""
        return self.encode_rendered(*self.prompt_text(messages, tools=tools))

    def prompt_text(
        self, messages: Sequence[Message], *, tools: Sequence[ToolSpec] | None = None
    ) -> tuple[str, list[str]]:
        """The first prompt's rendering, with each special token's text inside a content as
        a marker, and the texts the markers stand for: ``encode_rendered`` of the two is
        ``prompt_ids``.  (Two steps so that a caller can encode a long one elsewhere.)"""
        messages, literals = self._literal_contents(messages)
        return self.render_prompt(messages, tools=tools), literals

    def _literal_contents(self, messages: Sequence[Message]) -> tuple[list[Message], list[str]]:
        """``messages`` with every special token's text in a content replaced by a marker,
        and the texts the markers stand for."""
        literals: list[str] = []

        def mark(match: re.Match[str]) -> str:
            literals.append(match.group(0))
            return f"\ue000{len(literals) - 1}\ue001"

        out = list(messages)
        for i, m in enumerate(out):
            if m.content and self._content_re.search(m.content):
                out[i] = msgspec.structs.replace(m, content=self._content_re.sub(mark, m.content))
        return out, literals

    def encode_rendered(self, text: str, literals: list[str]) -> list[int]:
        """``encode(text)`` with each marker's literal (see ``prompt_text``) encoded as plain
        text."""
        if not literals:
            return self.encode(text)
        ids: list[int] = []
        for i, piece in enumerate(_LITERAL.split(text)):
            if i & 1:
                ids += self._text_ids(literals[int(piece)])
            elif piece:
                ids += self.encode(piece)
        return ids

    def _text_ids(self, literal: str) -> list[int]:
        """Ids of an added token's text as plain text: its first character, then the rest
        (which matches no added token; else one character at a time)."""
        ids = self._encode_raw(literal[:1]) + self._encode_raw(literal[1:])
        if self._added_id_set.intersection(ids):
            ids = [i for ch in literal for i in self._encode_raw(ch)]
        return ids

    def render_prompt(
        self, messages: Sequence[Message], *, tools: Sequence[ToolSpec] | None = None
    ) -> str:
        """``render(messages, tools=tools, add_generation_prompt=True)``, fast for plain
        (no tool-call) messages; pass the same ``tools`` object each time to benefit."""
        return self._fast_render(
            ("prompt", id(tools)),
            messages,
            lambda msgs: self.render(msgs, tools=tools, add_generation_prompt=True),
            keep=tools,
        )

    def continuation_ids(
        self, new_messages: Sequence[Message], *, ended_with_eot: bool
    ) -> list[int]:
        """Ids to append after a sampled assistant turn: the template's text after the
        end-of-turn token, the new (tool/user) messages, and the next generation prompt.

        ``ended_with_eot`` says whether the sampled ids already end with the end-of-turn
        token; if not (the turn hit its length limit), it is inserted.  A special token's
        text inside a message's content (a tool's output printing ``<|im_end|>``, say) is
        encoded as plain text: content never forges a turn boundary or a tool call.
        """
        new_messages, literals = self._literal_contents(new_messages)
        text = self._eot_tail + self._render_suffix(new_messages)
        ids = self.encode_rendered(text, literals)
        return ids if ended_with_eot else [self.eot_id, *ids]

    def _render_suffix(self, new_messages: Sequence[Message]) -> str:
        """The template's text for ``new_messages`` after an assistant turn (+ generation
        prompt)."""
        return self._fast_render(("suffix",), new_messages, self._render_suffix_slow)

    def _render_suffix_slow(self, new_messages: Sequence[Message | dict[str, Any]]) -> str:
        full = self.render([*_ANCHOR, *new_messages], add_generation_prompt=True)
        if not full.startswith(self._anchor_text):
            raise ChatTemplateError(
                "the chat template rewrites earlier messages when new ones are added; "
                "token-in/token-out rendering needs a template whose output only grows"
            )
        return full[len(self._anchor_text) :]

    def _fast_render(
        self,
        kind: tuple[Any, ...],
        messages: Sequence[Message],
        render: Callable[[list[Message | dict[str, Any]]], str],
        keep: Any = None,
    ) -> str:
        """``render(messages)`` through a cache of the template's output per message shape.

        Messages without tool calls are rendered once per shape (roles, names) with
        placeholder contents; afterwards only the contents are substituted.  A template
        that transforms or branches on contents is detected by the placeholders (which
        carry surrounding whitespace) not coming out verbatim; then the shape always takes
        the slow path.  ``keep`` is held with the entry so that an ``id()`` in ``kind``
        stays unique.
        """
        if any(m.tool_calls for m in messages):
            return render(list(messages))
        key = (*kind, tuple((m.role, m.name) for m in messages))
        entry = self._fast_shapes.get(key)
        if entry is None:
            if len(self._fast_shapes) >= _CACHE_MAX_ENTRIES:
                self._fast_shapes.clear()
            entry = self._fast_shapes[key] = (self._shape_parts(messages, render), keep)
        parts = entry[0]
        if parts is None:
            return render(list(messages))
        out = [parts[0]]
        for m, tail in zip(messages, parts[1:], strict=True):
            out.append(m.content)
            out.append(tail)
        return "".join(out)

    @staticmethod
    def _shape_parts(
        messages: Sequence[Message], render: Callable[[list[Message | dict[str, Any]]], str]
    ) -> list[str] | None:
        """The rendering of ``messages`` split around their contents, or ``None``."""
        marks = [f" \n\x00agentroll-content-{i}\x00 \n" for i in range(len(messages))]
        probe: list[Message | dict[str, Any]] = [
            {**m.to_template(), "content": mark} for m, mark in zip(messages, marks, strict=True)
        ]
        text = render(probe)
        parts: list[str] = []
        for mark in marks:
            if text.count(mark) != 1:
                return None
            head, text = text.split(mark)
            parts.append(head)
        parts.append(text)
        return parts
