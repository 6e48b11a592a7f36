"""The gateway: OpenAI-style calls of outside agents as token-exact episodes on a backend.

Invariants: every call's prompt is its sample's tokens so far (``Capture``); sampled ids
enter the sample as the backend streamed them, with their versions; a call that fails or
whose client leaves is undone (its generation aborted, its tokens dropped); a weight sync
pauses calls in flight and resumes them under the policy (a streamed call that already sent
tokens resumes with ``recompute`` where ``restart`` was asked: sent text cannot be taken
back); ended sessions go to ``publish`` group by group; leaving the gateway ends the live
sessions as abandoned and publishes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

import msgspec
import numpy as np

from agentroll.backends.base import Backend, GenerationRequest, UpdatesInRotation
from agentroll.chat import ChatTokenizer, get_tool_parser
from agentroll.errors import BackendError, ConfigError
from agentroll.gateway.capture import Plan
from agentroll.gateway.session import Group, Session, session_clock
from agentroll.gateway.stream import ChoiceStream, TextStream
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
from agentroll.rollout.episode_loop import episode_seed
from agentroll.rollout.pause import EpisodeView, PauseController, PolicyFn, as_policy_fn
from agentroll.types import (
    Message,
    ResumePolicy,
    SamplingParams,
    Status,
    Strategy,
    SyncReport,
    Task,
    ToolSpec,
    Trajectory,
)

logger = logging.getLogger("agentroll.gateway")

Publish = Callable[[list[Trajectory]], Awaitable[None]]
_ENDED_MEMORY = 65_536  # ended session ids remembered (a late call gets 409, not 404)
_SEED_MASK = 0x7FFF_FFFF_FFFF_FFFF
_TOOLS_CACHE = 1024  # distinct tool lists whose checked form is kept


class GatewayConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Static settings of a gateway; invalid values raise ``ConfigError``.

    ``tool_parser``: how tool calls are read from the model's text; ``idle_timeout``:
    seconds without a call after which a session ends as abandoned; ``max_tokens``: a call's
    limit when it names none, ``max_tokens_limit`` the most a call may ask; ``fork_policy``:
    ``fork`` starts a new sample when a call rewrites the history, ``refuse`` answers 409;
    ``model``: the name ``/v1/models`` lists."""

    tool_parser: str = "hermes"
    idle_timeout: float = 600.0
    max_tokens: int = 512
    max_tokens_limit: int = 32_768
    max_sessions: int = 65_536
    max_body_bytes: int = 8 << 20
    fork_policy: Literal["fork", "refuse"] = "fork"
    model: str = "agentroll"
    keep_messages: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.idle_timeout, int | float) and 0 < self.idle_timeout < math.inf):
            raise ConfigError(f"gateway idle_timeout={self.idle_timeout!r}; use seconds > 0")
        for name in ("max_tokens", "max_tokens_limit", "max_sessions", "max_body_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"gateway {name}={value!r}; use an int >= 1")
        if self.max_tokens > self.max_tokens_limit:
            raise ConfigError("gateway max_tokens exceeds max_tokens_limit; lower it")
        if self.fork_policy not in ("fork", "refuse"):
            raise ConfigError(f"gateway fork_policy={self.fork_policy!r}; use fork or refuse")


class _Call:
    """One generation in flight (what a pause's policy sees of it)."""

    __slots__ = ("plan", "request_id", "sent", "session", "streamed")

    def __init__(self, session: Session, plan: Plan, request_id: str, streamed: bool) -> None:
        self.session = session
        self.plan = plan
        self.request_id = request_id
        self.streamed = streamed
        self.sent = 0  # tokens already sent to the client


class Gateway:
    """Sessions of outside agents over one backend (or fleet).

    ``async with Gateway(backend, publish=...) as gw:`` then serve ``gw.app()`` (see
    ``agentroll.gateway.serve``) or call ``chat`` / ``completion`` in process.  ``publish``
    receives each released group's trajectories (a spool, a buffer); without it they
    collect in ``finished``.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        tokenizer: ChatTokenizer | None = None,
        config: GatewayConfig | None = None,
        publish: Publish | None = None,
        clock: Callable[[], float] = session_clock,
    ) -> None:
        tok = tokenizer or backend.tokenizer
        if tok is None:
            raise ConfigError("Gateway needs a ChatTokenizer (pass tokenizer=...)")
        self.backend = backend
        self.tokenizer: ChatTokenizer = tok
        self.config = config or GatewayConfig()
        self.parser = get_tool_parser(self.config.tool_parser)
        self.publish = publish
        self.finished: list[Trajectory] = []
        self._clock = clock
        self.sessions: dict[str, Session] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # sid -> status
        self._groups: dict[str, Group] = {}
        self._calls: dict[str, _Call] = {}
        self._tools_cache: dict[bytes, list[ToolSpec]] = {}
        self.pauses = PauseController(backend, self._views)
        self._tg: asyncio.TaskGroup | None = None
        self.stats = {"calls": 0, "failed_calls": 0, "sessions": 0, "abandoned": 0, "forks": 0}

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> Gateway:
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        self._tg.create_task(self._reap())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        tg, self._tg = self._tg, None
        try:
            for session in list(self.sessions.values()):
                await self.end(session, status="abandoned", reason="gateway_closed")
        finally:
            if tg is not None:
                for task in list(tg._tasks):  # the reaper: it runs until cancelled
                    task.cancel()
                with contextlib.suppress(BaseExceptionGroup):
                    await tg.__aexit__(None, None, None)

    async def _reap(self) -> None:
        """End sessions idle for longer than ``idle_timeout`` as abandoned."""
        timeout = self.config.idle_timeout
        while True:
            await asyncio.sleep(min(timeout / 4, 5.0))
            cutoff = self._clock() - timeout
            for session in list(self.sessions.values()):
                if session.last_active < cutoff and not session.in_flight:
                    await self.end(session, status="abandoned", reason="idle_timeout")

    def open_session(
        self,
        *,
        task_id: str = "",
        group_id: str = "",
        group_size: int = 0,
        seed: int | None = None,
        metadata: dict[str, Any] | None = None,
        task: Task | None = None,
    ) -> Session:
        """A new session; ``group_id``/``group_size`` make it one sample of a group."""
        if len(self.sessions) >= self.config.max_sessions:
            raise RequestError(
                429,
                f"{len(self.sessions)} sessions are open (GatewayConfig.max_sessions); end "
                "some or raise the limit",
                kind="rate_limit_error",
            )
        if group_size < 0:
            raise RequestError(400, "group_size must be >= 0", param="group_size")
        group = None
        if group_id:
            group = self._groups.get(group_id)
            if group is None:
                group = self._groups[group_id] = Group(group_size)
            elif group.full():
                raise RequestError(
                    409,
                    f"group {group_id!r} already has its {group.size} sessions; use a new group id",
                    param="group_id",
                )
        index = group.join() if group is not None else 0
        task = task or Task(id=task_id or "gateway")
        session = Session(
            self.tokenizer,
            task=task,
            group_id=group_id,
            sample_index=index,
            seed=seed if seed is not None else episode_seed(self.config.seed, task.id, index),
            metadata=dict(metadata or {}),
            clock=self._clock(),
        )
        self.sessions[session.id] = session
        self.stats["sessions"] += 1
        return session

    def session(self, sid: str) -> Session:
        """The live session ``sid``; ``RequestError`` 404 (unknown) or 409 (ended)."""
        session = self.sessions.get(sid)
        if session is not None:
            return session
        if sid in self._ended:
            raise RequestError(
                409,
                f"session {sid} has ended ({self._ended[sid]}); create a new one with "
                "POST /sessions",
                code="session_ended",
            )
        raise RequestError(
            404, f"no session {sid!r}; create one with POST /sessions", code="unknown_session"
        )

    async def end(
        self, session: Session, *, status: Status = "ok", reason: str = "ended"
    ) -> list[Trajectory]:
        """End ``session``: calls in flight are aborted, its samples become trajectories,
        its group is released when complete.  Idempotent."""
        if session.ended:
            return []
        session.ended = True
        for task in list(session.in_flight.values()):
            task.cancel()
        for task in list(session.in_flight.values()):
            with contextlib.suppress(BaseException):
                await task
        self.sessions.pop(session.id, None)
        self._ended[session.id] = status
        if len(self._ended) > _ENDED_MEMORY:
            self._ended.popitem(last=False)
        session.status, session.stop_reason = status, reason
        self.stats["abandoned"] += status == "abandoned"
        self.stats["forks"] += session.capture.num_forks
        self.backend.end_episode(session.id)
        trajs = session.trajectories(
            backend=self.backend.name, keep_messages=self.config.keep_messages
        )
        group = self._groups.get(session.group_id) if session.group_id != session.id else None
        if group is None:
            await self._release(trajs)
            return trajs
        group.ended += 1
        group.trajectories.extend(trajs)
        if group.complete():
            del self._groups[session.group_id]
            await self._release(group.trajectories)
        return trajs

    async def _release(self, trajs: list[Trajectory]) -> None:
        if not trajs:
            return
        if self.publish is not None:
            await self.publish(trajs)
        else:
            self.finished.extend(trajs)

    # -- sync ----------------------------------------------------------------------------

    def _views(self) -> list[EpisodeView]:
        version = self.backend.policy_version
        views = []
        for call in self._calls.values():
            b = call.session.capture.samples[call.plan.sample].builder
            sampled = np.frombuffer(b.mask, dtype=np.uint8).view(bool)
            any_sampled = bool(sampled.any())
            min_pol = int(np.frombuffer(b.policy, np.int32)[sampled].min()) if any_sampled else None
            min_kv = int(np.frombuffer(b.kv, np.int32)[sampled].min()) if any_sampled else None
            views.append(
                EpisodeView(
                    episode_id=call.session.id,
                    request_id=call.request_id,
                    turn=call.session.capture.calls,
                    tokens_generated=len(b) - call.plan.gen_start,
                    min_policy_version=min_pol,
                    min_kv_version=min_kv,
                    policy_version=version,
                )
            )
        return views

    def _policy(self, choose: PolicyFn) -> PolicyFn:
        def pick(view: EpisodeView) -> ResumePolicy:
            policy = choose(view)
            call = self._calls.get(view.request_id)
            if policy == "restart" and call is not None and call.streamed and call.sent:
                return "recompute"  # what was streamed cannot be taken back
            return policy

        return pick

    async def sync(
        self,
        update: Any,
        *,
        policy: ResumePolicy | PolicyFn = "keep",
        strategy: Strategy | None = None,
    ) -> SyncReport:
        """Install a ``WeightUpdate`` while calls go on (as ``RolloutEngine.sync``): calls in
        flight pause at a token boundary and resume under ``policy``; clients only wait."""
        choose = self._policy(as_policy_fn(policy))
        backend = self.backend
        if isinstance(backend, UpdatesInRotation):
            return await backend.update(
                update,
                strategy=strategy,
                policies=lambda: self.pauses.policies(update.version, choose),
            )
        if strategy not in (None, "pause"):
            raise ConfigError(f"strategy {strategy!r} needs a fleet; a backend syncs by pause")
        t0 = time.perf_counter()
        await self.pauses.pause(choose)
        try:
            await backend.apply(update)
        finally:
            paused_for = await self.pauses.resume()
        return SyncReport(
            strategy="pause",
            version=update.version,
            seconds=time.perf_counter() - t0,
            pause_ms=[paused_for * 1000.0],
        )

    # -- calls ---------------------------------------------------------------------------

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
                        if keep < plan.gen_start or (call.streamed and call.sent > keep):
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
        messages, tools, s = check_chat(req, self._tools)
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

    async def chat_stream(self, session: Session, req: ChatRequest) -> AsyncIterator[bytes]:
        """Answer a streamed Chat Completions call: an iterator of server-sent events.
        Checks run before the first event (``RequestError`` is raised here, not streamed)."""
        messages, tools, s = check_chat(req, self._tools)
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
        return self._chat_events(session, plan, sampling, call, s, req.model, include_usage)

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

    def _unsent(self, sample: Any, plan: Plan, call: _Call, s: Sampling) -> dict[str, Any]:
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

    def track(self, session: Session, key: str, task: asyncio.Task[Any]) -> None:
        """Register a call's task (``end`` cancels it)."""
        session.in_flight[key] = task
        task.add_done_callback(lambda _t: session.in_flight.pop(key, None))

    def status(self) -> dict[str, Any]:
        return {
            "sessions_live": len(self.sessions),
            "groups_waiting": len(self._groups),
            "calls_in_flight": len(self._calls),
            "policy_version": self.backend.policy_version,
            "paused": self.pauses.paused,
            **self.stats,
        }


__all__ = ["Gateway", "GatewayConfig", "Publish", "TextStream"]
