"""The call half of the gateway: Chat Completions and Completions calls into samples.

``CallHandler`` is what ``Gateway`` does per call (the gateway adds sessions, groups and
syncs).  Invariants: a call's prompt is its sample's tokens so far; sampled ids enter the
sample as the backend streamed them, with their versions; a call that fails or whose
client leaves is undone (``Capture.discard``); the reply recorded for the session is what
the client received.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from agentroll.backends.base import Backend, GenerationRequest
from agentroll.chat import ChatTokenizer, ToolParser
from agentroll.errors import BackendError
from agentroll.gateway.capture import Plan, Sample
from agentroll.gateway.config import GatewayConfig
from agentroll.gateway.session import Session
from agentroll.gateway.stream import ChoiceStream
from agentroll.gateway.wire import (
    ChatRequest,
    CompletionRequest,
    RequestError,
    Sampling,
    ToolDef,
    chat_reply,
    check_chat,
    check_sampling,
    check_tools,
    completion_id,
    openai_tool_calls,
    sse,
)
from agentroll.types import Message, SamplingParams, ToolSpec

_SEED_MASK = 0x7FFF_FFFF_FFFF_FFFF
_TOOLS_CACHE = 1024  # distinct tool lists whose checked form is kept


class _Call:
    """One generation in flight (what a pause's policy sees of it)."""

    __slots__ = ("plan", "request_id", "sent", "session", "streamed")

    def __init__(self, session: Session, plan: Plan, request_id: str, streamed: bool) -> None:
        self.session = session
        self.plan = plan
        self.request_id = request_id
        self.streamed = streamed
        self.sent = 0  # tokens already sent to the client


class StreamedCall:
    """A streamed call's events; ``close`` undoes the call when they were never iterated
    (once they were, the events' own ``finally`` settles the call)."""

    __slots__ = ("_events", "_started", "_undo")

    def __init__(self, events: AsyncIterator[bytes], undo: Callable[[], None]) -> None:
        self._events, self._undo, self._started = events, undo, False

    def __aiter__(self) -> AsyncIterator[bytes]:
        self._started = True
        return self._events

    def close(self) -> None:
        if not self._started:
            self._started = True  # undone once
            self._undo()


class CallHandler:
    """The calls of a ``Gateway`` (which sets every attribute below)."""

    backend: Backend
    tokenizer: ChatTokenizer
    config: GatewayConfig
    parser: ToolParser
    stats: dict[str, int]
    _calls: dict[str, _Call]
    _tools_cache: dict[bytes, list[ToolSpec]]
    _clock: Callable[[], float]

    def _sampling(self, session: Session, s: Sampling, call: int, choice: int) -> SamplingParams:
        max_tokens = s.max_tokens or self.config.max_tokens
        if max_tokens > self.config.max_tokens_limit:
            raise RequestError(
                400,
                f"max_tokens={max_tokens} exceeds this gateway's limit "
                f"{self.config.max_tokens_limit}; ask for fewer",
                param="max_tokens",
            )
        seed = s.seed if s.seed is not None else session.seed + 1_000_003 * call
        return SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            max_tokens=max_tokens,
            stop=s.stop,
            seed=(seed + choice) & _SEED_MASK,
            logprobs=True,
        )

    def _begin(self, session: Session) -> None:
        session.last_active = self._clock()

    def _tools(self, tools: list[ToolDef] | None) -> list[ToolSpec] | None:
        """The checked tools of a call, one object per distinct list: the chat template's
        render cache is keyed by it, and a session sends the same tools every call."""
        if not tools:
            return None
        key = msgspec.json.encode(tools)
        checked = self._tools_cache.get(key)
        if checked is None:
            checked = check_tools(tools) or []
            if len(self._tools_cache) >= _TOOLS_CACHE:
                self._tools_cache.clear()
            self._tools_cache[key] = checked
        return checked

    async def _generate(
        self, session: Session, plan: Plan, sampling: SamplingParams, call: _Call
    ) -> AsyncIterator[tuple[list[int], str | None]]:
        """Run one generation into the sample; yields (new ids, finish reason)."""
        sample = session.capture.samples[plan.sample]
        builder = sample.builder
        request = GenerationRequest(
            request_id=call.request_id,
            prompt_ids=builder.token_ids[: plan.gen_start],
            sampling=sampling,
            episode_id=session.id,
            turn_index=session.capture.calls - 1,
        )
        self._calls[call.request_id] = call
        try:
            stream = self.backend.generate(request)
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for chunk in stream:
                    if chunk.rollback:
                        keep = len(builder) - chunk.rollback
                        sent = plan.gen_start + call.sent  # streamed calls: what the client has
                        if keep < plan.gen_start or (call.streamed and sent > keep):
                            raise BackendError(
                                f"backend rolled back {chunk.rollback} tokens already sent"
                            )
                        builder.truncate(keep)
                    builder.add_sampled(
                        chunk.token_ids, chunk.logprobs, chunk.policy_version, chunk.kv_version
                    )
                    yield chunk.token_ids, chunk.finish_reason
        finally:
            self._calls.pop(call.request_id, None)

    def _reply(
        self, session: Session, plan: Plan, text: str, finish: str, call_prefix: str
    ) -> tuple[Message, str, str | None]:
        parsed = self.parser.parse(text, call_id_prefix=call_prefix)
        if parsed.errors:  # returned as text, counted: never dropped silently
            session.unparsed_tool_calls += len(parsed.errors)
            return Message(role="assistant", content=text), finish, "; ".join(parsed.errors)
        if parsed.tool_calls and finish == "stop":
            finish = "tool_calls"
        msg = Message(role="assistant", content=parsed.content, tool_calls=parsed.tool_calls)
        return msg, finish, None

    def _text(self, sample_ids: Any, gen_start: int) -> str:
        sampled = sample_ids[gen_start:]
        if len(sampled) and sampled[-1] == self.tokenizer.eot_id:
            sampled = sampled[:-1]
        return self.tokenizer.decode(sampled)

    def _choice_fields(self, session: Session, plan: Plan, logprobs: bool) -> dict[str, Any]:
        b = session.capture.samples[plan.sample].builder
        ids = b.token_ids[plan.gen_start :].tolist()
        lps = b.logprobs[plan.gen_start :].tolist()
        out: dict[str, Any] = {
            "token_ids": ids,
            "token_logprobs": lps,
            "policy_version": b.policy[plan.gen_start :].tolist(),
            "kv_version": b.kv[plan.gen_start :].tolist(),
            "sample_index": plan.sample,
        }
        if logprobs:
            out["logprobs"] = {"content": self._logprob_entries(ids, lps)}
        else:
            out["logprobs"] = None
        return out

    def _logprob_entries(self, ids: list[int], lps: list[float]) -> list[dict[str, Any]]:
        entries = []
        for tid, lp in zip(ids, lps, strict=True):
            token = self.tokenizer.decode([tid], skip_special_tokens=False)
            entries.append(
                {
                    "token": token,
                    "logprob": lp,
                    "bytes": list(token.encode()),
                    "top_logprobs": [],
                }
            )
        return entries

    def _plans(self, session: Session, messages: list[Message], tools: Any, n: int) -> list[Plan]:
        cap = session.capture
        plan = cap.plan(messages, tools)
        if plan.fork is not None and self.config.fork_policy == "refuse":
            cap.discard(plan)
            raise RequestError(
                409,
                f"this call rewrites the session's history ({plan.fork.reason}, "
                f"{plan.fork.mismatched_tokens} tokens would differ); send the messages "
                "as returned, or set the gateway's fork_policy to fork",
                code="history_rewritten",
            )
        return [plan, *(cap.branch(plan) for _ in range(n - 1))]

    async def chat(self, session: Session, req: ChatRequest) -> dict[str, Any]:
        """Answer a non-streamed Chat Completions call (OpenAI reply dict)."""
        messages, tools, s = check_chat(req, self._tools, session.messages)
        self._begin(session)
        call_index = session.capture.calls
        plans = self._plans(session, messages, tools, s.n)
        calls = [
            _Call(session, p, f"{session.id}-{call_index}-{k}", False) for k, p in enumerate(plans)
        ]
        recorded: set[int] = set()
        t0 = time.perf_counter()
        try:
            sps = [self._sampling(session, s, call_index, k) for k in range(len(plans))]
            runs = [
                self._run_to_end(session, p, sp, c)
                for p, sp, c in zip(plans, sps, calls, strict=True)
            ]
            # one choice (the usual call) runs here: no task, no extra loop iteration
            finishes = [await runs[0]] if len(runs) == 1 else await asyncio.gather(*runs)
            choices = []
            for k, (plan, finish) in enumerate(zip(plans, finishes, strict=True)):
                sample = session.capture.samples[plan.sample]
                text = self._text(sample.builder.token_ids, plan.gen_start)
                reply, finish_name, err = self._reply(
                    session, plan, text, finish, f"call_{call_index}_{k}"
                )
                fields = self._choice_fields(session, plan, s.logprobs)
                session.capture.record(
                    plan,
                    reply,
                    finish=finish,  # type: ignore[arg-type]
                    text=text,
                    format_error=err,
                    gen_seconds=time.perf_counter() - t0,
                )
                recorded.add(k)
                choices.append(
                    {
                        "index": k,
                        "message": {
                            "role": "assistant",
                            "content": reply.content or (None if reply.tool_calls else ""),
                            **(
                                {"tool_calls": openai_tool_calls(reply.tool_calls)}
                                if reply.tool_calls
                                else {}
                            ),
                        },
                        "finish_reason": finish_name,
                        **fields,
                    }
                )
        except BaseException:
            self.stats["failed_calls"] += 1
            for k, plan in enumerate(plans):
                if k not in recorded:
                    session.capture.discard(plan)
            raise
        finally:
            session.last_active = self._clock()
        self.stats["calls"] += 1
        prompt = plans[0].gen_start
        completion = sum(len(c["token_ids"]) for c in choices)
        first = session.capture.samples[plans[0].sample].builder
        return chat_reply(
            cid=completion_id(),
            model=req.model or self.config.model,
            choices=choices,
            prompt_ids=first.token_ids[:prompt].tolist(),
            usage={
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            },
            session=session.id,
        )

    async def _run_to_end(
        self, session: Session, plan: Plan, sampling: SamplingParams, call: _Call
    ) -> str:
        finish: str | None = None
        async for _ids, f in self._generate(session, plan, sampling, call):
            if f is not None:
                finish = f
        if finish is None:
            raise BackendError("the backend's stream ended without a finish_reason")
        if finish == "abort":
            raise RequestError(
                503, "the backend aborted this generation; retry the call", kind="server_error"
            )
        return finish

    async def chat_stream(self, session: Session, req: ChatRequest) -> StreamedCall:
        """Answer a streamed Chat Completions call: its server-sent events.  Checks run
        before the first event (``RequestError`` is raised here, not streamed); call the
        result's ``close`` once the response is over (it undoes a call whose events were
        never iterated: a client that left before the first byte)."""
        messages, tools, s = check_chat(req, self._tools, session.messages)
        if s.n > 1:
            raise RequestError(400, "n > 1 with stream is not supported; make n calls", param="n")
        self._begin(session)
        call_index = session.capture.calls
        plan = self._plans(session, messages, tools, 1)[0]
        try:
            sampling = self._sampling(session, s, call_index, 0)
        except BaseException:
            session.capture.discard(plan)
            raise
        call = _Call(session, plan, f"{session.id}-{call_index}-0", True)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = self._chat_events(session, plan, sampling, call, s, req.model, include_usage)
        return StreamedCall(events, lambda: session.capture.discard(plan))

    async def _chat_events(
        self,
        session: Session,
        plan: Plan,
        sampling: SamplingParams,
        call: _Call,
        s: Sampling,
        model: str,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        cid = completion_id()
        created = int(time.time())
        model = model or self.config.model
        call_index = session.capture.calls - 1
        head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
        stream = ChoiceStream(self.tokenizer, self.parser, call_prefix=f"call_{call_index}_0")
        recorded = False
        t0 = time.perf_counter()
        sample = session.capture.samples[plan.sample]
        try:
            first = {"role": "assistant", "content": ""}
            yield sse({**head, "choices": [{"index": 0, "delta": first, "finish_reason": None}]})
            finish: str | None = None
            async for ids, f in self._generate(session, plan, sampling, call):
                delta = stream.feed(ids)
                if f is not None:
                    finish = f
                if delta:
                    # the ids since the last delta: text held back (a partial character, a
                    # tool call being parsed) came from earlier chunks
                    choice = {"index": 0, "delta": delta, "finish_reason": None}
                    choice.update(self._unsent(sample, plan, call, s))
                    yield sse({**head, "choices": [choice]})
            if finish is None:
                raise BackendError("the backend's stream ended without a finish_reason")
            if finish == "abort":
                raise BackendError("the backend aborted this generation; retry the call")
            tail, reply, errors = stream.finish()
            finish_name = "tool_calls" if reply.tool_calls and finish == "stop" else finish
            if errors:
                session.unparsed_tool_calls += len(errors)
            text = self._text(sample.builder.token_ids, plan.gen_start)
            session.capture.record(
                plan,
                reply,
                finish=finish,  # type: ignore[arg-type]
                text=text,
                format_error="; ".join(errors) or None,
                gen_seconds=time.perf_counter() - t0,
            )
            recorded = True
            last = {"index": 0, "delta": tail, "finish_reason": finish_name}
            last.update(self._unsent(sample, plan, call, s))
            last["sample_index"] = plan.sample
            yield sse({**head, "choices": [last]})
            if include_usage:
                n = len(sample.builder) - plan.gen_start
                usage = {
                    "prompt_tokens": plan.gen_start,
                    "completion_tokens": n,
                    "total_tokens": plan.gen_start + n,
                }
                yield sse({**head, "choices": [], "usage": usage})
            self.stats["calls"] += 1
            yield sse("[DONE]")
        except RequestError as exc:
            yield sse({"error": msgspec.json.decode(exc.body())["error"]})
        except BackendError as exc:
            self.stats["failed_calls"] += 1
            yield sse(
                {
                    "error": {
                        "message": str(exc),
                        "type": "server_error",
                        "param": None,
                        "code": None,
                    }
                }
            )
        finally:
            if not recorded:
                session.capture.discard(plan)
            session.last_active = self._clock()

    def _unsent(self, sample: Sample, plan: Plan, call: _Call, s: Sampling) -> dict[str, Any]:
        """The extension fields of the tokens no event carried yet (joined over a call's
        events they are the turn's), and their OpenAI logprobs when asked for; marks them
        sent."""
        b, start = sample.builder, plan.gen_start + call.sent
        ids = b.token_ids[start:].tolist()
        lps = b.logprobs[start:].tolist()
        out: dict[str, Any] = {
            "token_ids": ids,
            "token_logprobs": lps,
            "policy_version": b.policy[start:].tolist(),
            "kv_version": b.kv[start:].tolist(),
        }
        if s.logprobs:
            out["logprobs"] = {"content": self._logprob_entries(ids, lps)}
        call.sent = len(b) - plan.gen_start
        return out

    async def completion(self, session: Session, req: CompletionRequest) -> dict[str, Any]:
        """Answer a (non-streamed) Completions call: prompt as text or token ids, matched
        against the session's samples token by token."""
        prompt: Any = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise RequestError(
                    400, "one prompt per call; send a batch as several calls", param="prompt"
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            vocab = self.tokenizer.vocab_size
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
                raise RequestError(
                    400,
                    f"prompt must be text or a list of token ids in [0, {vocab})",
                    param="prompt",
                )
        if not ids:
            raise RequestError(400, "the prompt is empty", param="prompt")
        if req.stream:
            raise RequestError(
                400,
                "stream is not supported on /completions; use /chat/completions or stream=false",
                param="stream",
            )
        s = check_sampling(
            temperature=req.temperature,
            top_p=req.top_p,
            max_tokens=req.max_tokens,
            stop=req.stop,
            seed=req.seed,
            n=req.n,
            logprobs=bool(req.logprobs),
        )
        if s.n > 1:
            raise RequestError(400, "n > 1 is not supported on /completions", param="n")
        self._begin(session)
        call_index = session.capture.calls
        plan = session.capture.plan_tokens(ids)
        call = _Call(session, plan, f"{session.id}-{call_index}-0", False)
        t0 = time.perf_counter()
        try:
            finish = await self._run_to_end(
                session, plan, self._sampling(session, s, call_index, 0), call
            )
        except BaseException:
            session.capture.discard(plan)
            raise
        finally:
            session.last_active = self._clock()
        sample = session.capture.samples[plan.sample]
        text = self._text(sample.builder.token_ids, plan.gen_start)
        session.capture.record(
            plan,
            Message(role="assistant", content=text),
            finish=finish,  # type: ignore[arg-type]
            text=text,
            format_error=None,
            gen_seconds=time.perf_counter() - t0,
        )
        fields = self._choice_fields(session, plan, False)
        n = len(fields["token_ids"])
        self.stats["calls"] += 1
        return {
            "id": f"cmpl-{time.time_ns():x}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": req.model or self.config.model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, **fields}],
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": n,
                "total_tokens": len(ids) + n,
            },
            "prompt_token_ids": ids,
            "session_id": session.id,
        }


__all__ = ["CallHandler", "StreamedCall"]
