"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn, server-sent events).

No request can stop it: bodies are capped in size, tokenization and chat templating run on a
worker thread (not the event loop), every refusal is a 4xx with an OpenAI-shaped body, a client
that goes away aborts its request, and a request that fails mid-stream ends with an error event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hmac
import importlib.metadata
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import APIRouter, FastAPI, Request as HTTPRequest
from pydantic import BaseModel, ConfigDict
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.engine import LLMEngine, RequestError
from ..engine.gc_utils import GCPauses
from ..engine.request import Request
from ..sampling import SEED_RANGE, SamplingParams
from .metrics import render_metrics
from .parsers import ReasoningParser, ToolCallParser
from .protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest, StreamOptions

log = logging.getLogger("dflash2.server")
MAX_BODY_BYTES = 8 << 20  # 8 MiB: a 128k-token prompt as text or as ids fits several times over
DISCONNECT_POLL_S = 0.5  # how often a waiting request checks that its client is still there


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(message: str, type_: str, param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is a 413 before it is parsed (by
    Content-Length, or counted as it arrives when chunked)."""

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(send)
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise StarletteHTTPException(413, self._message())
            return msg

        await self.app(scope, limited, send)

    def _message(self) -> str:
        return f"request body is larger than {self.max_bytes} bytes"

    async def _refuse(self, send):
        body = json.dumps(error_body(self._message(), "invalid_request_error", None, "request_too_large")).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


class APIKey:
    """ASGI middleware: every route but /health needs ``Authorization: Bearer <key>`` (SGLang's and
    vLLM's ``--api-key``); a missing or wrong key is a 401 with an OpenAI-shaped body."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") == "/health" or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        got = dict(scope.get("headers") or []).get(b"authorization", b"")
        if hmac.compare_digest(got, self.expected):
            return await self.app(scope, receive, send)
        body = json.dumps(
            error_body(
                "missing or wrong API key (Authorization: Bearer <key>)",
                "invalid_request_error",
                None,
                "invalid_api_key",
            )
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def trim_stop(text: str, req: Request) -> str:
    for s in req.stop_strings:
        i = text.find(s)
        if i >= 0:
            text = text[:i]
    return text


def stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that begins some stop string (held back in a stream:
    it may yet become the stop string, which the answer never contains)."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class Detokenizer:
    """Incremental text of a request's output; holds back an incomplete UTF-8 character and what
    may be the start of a stop string. Each update decodes only a window of tokens: the last piece
    emitted and what came after it (vLLM's incremental detokenization), not the whole output. Why:
    decoding the whole output is O(length) per update with the GIL held (SmolLM2's tokenizer: 27 us
    at 128 tokens, 95 us at 512 on this CPU), per streaming request per engine step; at 128 streams that
    is milliseconds a step taken from the engine's thread."""

    def __init__(self, tokenizer, skip_special: bool = True):
        self.tok, self.skip, self.sent = tokenizer, skip_special, ""
        self.text = ""  # the text of output_ids[:read], committed (it ends in a complete character)
        self.start = self.read = 0  # the window: output_ids[start:read] is the last piece decoded

    def _advance(self, ids: list[int]) -> str:
        """Decode the window; commit its new text where it ends in a complete character, else return it
        (a character split across tokens decodes as U+FFFD until its last byte is in)."""
        if len(ids) <= self.read:
            return ""
        before = self.tok.decode(ids[self.start : self.read], skip_special_tokens=self.skip)
        after = self.tok.decode(ids[self.start :], skip_special_tokens=self.skip)
        if len(after) <= len(before):  # (nothing new yet, e.g. a skipped special token: the window grows)
            return ""
        if after.endswith("\ufffd"):
            return after[len(before) :]
        self.text += after[len(before) :]
        self.start, self.read = self.read, len(ids)
        return ""

    def delta(self, req: Request, final: bool = False) -> str:
        pending = self._advance(req.output_ids)  # (first: it may move self.text on)
        text = trim_stop(self.text + pending, req)
        if not final:
            if text.endswith("\ufffd"):
                return ""
            text = text[: len(text) - stop_prefix_len(text, req.stop_strings)]
        if len(text) <= len(self.sent):
            return ""
        out, self.sent = text[len(self.sent) :], text
        return out


@dataclass
class ServerState:
    """What every endpoint reads: the engine, the tokenizer (used on one worker thread, off the
    event loop) and the served model's name, context and output parsers."""

    engine: LLMEngine
    tokenizer: Any
    model_name: str
    context_length: int
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    server_args: dict = field(default_factory=dict)
    gc_pauses: GCPauses | None = None  # the collector's pauses (/metrics), where the launcher counts them
    tok_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash2-tokenize")
    )

    @property
    def spec_usage(self) -> bool:  # --enable-spec-usage: speculation's counters in OpenAI usage objects
        return bool(self.server_args.get("enable_spec_usage"))

    @property
    def skip_special(self) -> bool:  # Kimi-K2's tool-call section markers are special tokens
        return self.tool_call_parser != "kimi_k2"

    async def off_loop(self, fn, *args, **kw):
        return await asyncio.get_running_loop().run_in_executor(self.tok_pool, lambda: fn(*args, **kw))

    async def encode(self, text: str, param: str) -> list[int]:
        try:
            return list((await self.off_loop(self.tokenizer, text))["input_ids"])
        except Exception as e:
            raise APIError(400, f"{param} could not be tokenized: {type(e).__name__}: {e}", param=param) from None

    async def final_text(self, req: Request, skip: bool = True) -> str:
        return trim_stop(await self.off_loop(self.tokenizer.decode, req.output_ids, skip_special_tokens=skip), req)


router = APIRouter()


def state_of(http: HTTPRequest) -> ServerState:
    return http.app.state.dflash2


def create_app(
    engine: LLMEngine,
    tokenizer,
    model_name: str,
    context_length: int,
    reasoning_parser: str | None = None,
    tool_call_parser: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    api_key: str | None = None,
    server_args: dict | None = None,
    gc_pauses: GCPauses | None = None,
) -> FastAPI:
    app = FastAPI(title="dflash2")
    app.state.dflash2 = ServerState(
        engine,
        tokenizer,
        model_name,
        context_length,
        reasoning_parser,
        tool_call_parser,
        dict(server_args or {}),
        gc_pauses=gc_pauses,
    )
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(APIKey, api_key=api_key)  # added last: runs first
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)
    app.include_router(router)
    return app


# ---- errors ---------------------------------------------------------------------------------------
async def _api_error(_req, e: Exception):
    assert isinstance(e, APIError)
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)


async def _validation(_req, e: Exception):
    assert isinstance(e, RequestValidationError)
    errs = e.errors()
    first = errs[0] if errs else {}
    loc = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    return JSONResponse(error_body(msg + (f" ({loc})" if loc else ""), "invalid_request_error", loc), status_code=400)


async def _http_error(_req, e: Exception):
    assert isinstance(e, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status_code)
    kind = "invalid_request_error" if e.status_code < 500 else "server_error"
    return JSONResponse(error_body(str(e.detail), kind, None, code), status_code=e.status_code)


async def _internal(_req, e: Exception):
    log.exception("request failed")
    return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"), status_code=500)


# ---- requests in the engine ---------------------------------------------------------------------------
def check_model(st: ServerState, name: str | None) -> None:
    if name is not None and name not in (st.model_name, "default"):
        raise APIError(404, f"The model '{name}' does not exist", "invalid_request_error", "model", "model_not_found")


def make_request(
    st: ServerState,
    prompt_ids: list[int],
    max_tokens: int | None,
    body,
    param: str = "prompt",
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> Request:
    ctx = st.context_length
    if not prompt_ids:
        raise APIError(400, "the prompt is empty", param=param)
    if len(prompt_ids) >= ctx:
        raise APIError(
            400,
            f"This model's maximum context length is {ctx} tokens; the prompt has {len(prompt_ids)} tokens",
            param=param,
            code="context_length_exceeded",
        )
    budget = ctx - len(prompt_ids)
    max_new = max_tokens if max_tokens is not None else budget
    if max_new > budget:
        raise APIError(
            400,
            f"max_tokens={max_new} plus the prompt's {len(prompt_ids)} tokens exceeds the context length {ctx}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    try:
        sp = SamplingParams(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            max_new_tokens=max_new,
            seed=body.effective_seed,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            min_tokens=getattr(body, "min_tokens", None) or getattr(body, "min_new_tokens", None) or 0,
        )
    except ValueError as e:
        raise APIError(400, str(e)) from None
    return Request(list(prompt_ids), sp, stop_strings=body.stop_strings())


async def submit(st: ServerState, req: Request) -> asyncio.Queue[bool]:
    loop, queue = asyncio.get_running_loop(), asyncio.Queue[bool]()

    def on_update(r: Request, new: list[int]) -> None:
        if not loop.is_closed():
            loop.call_soon_threadsafe(queue.put_nowait, r.finished)

    req.on_update = on_update
    try:
        st.engine.add_request(req)
    except RequestError as e:
        raise APIError(400, str(e), param=e.param, code=e.code) from None
    return queue


async def updates(st: ServerState, req: Request, http: HTTPRequest):
    """Yield ``finished`` after engine updates; abort the request if the client goes away (checked
    every DISCONNECT_POLL_S, also while tokens keep coming)."""
    queue = await submit(st, req)
    last_check = time.monotonic()
    try:
        while True:
            try:
                done = await asyncio.wait_for(queue.get(), timeout=DISCONNECT_POLL_S)
                while not done and not queue.empty():  # coalesce what piled up
                    done = queue.get_nowait()
            except asyncio.TimeoutError:
                done = None
            if time.monotonic() - last_check >= DISCONNECT_POLL_S or done is None:
                last_check = time.monotonic()
                if await http.is_disconnected():
                    return
            if done is None:
                continue
            yield done
            if done:
                return
    finally:
        if not req.finished:
            st.engine.abort(req.request_id)  # frees its KV at the next step


async def run_to_end(st: ServerState, req: Request, http: HTTPRequest) -> Request:
    async for _ in updates(st, req, http):
        pass
    if not req.finished:
        raise APIError(499, "client disconnected")
    if req.finish_reason == "error":
        raise APIError(500, f"generation failed: {req.error}", "server_error")
    return req


async def stream_tokens(st: ServerState, req: Request, http: HTTPRequest, skip: bool = True):
    """Yield (text delta, finished) until the request ends."""
    detok = Detokenizer(st.tokenizer, skip_special=skip)
    async for done in updates(st, req, http):
        yield detok.delta(req, final=done), done


def usage(req: Request, spec: bool = False) -> dict:
    """OpenAI's usage; ``spec`` (``--enable-spec-usage``) adds the verify steps and acceptance length,
    which exact comparisons of usage objects would trip over otherwise."""
    out: dict[str, int | float] = {
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(req.output_ids),
        "total_tokens": len(req.prompt_ids) + len(req.output_ids),
    }
    if spec:
        out |= {"spec_verify_ct": req.verify_steps, "spec_accept_length": round(req.accept_length, 4)}
    return out


def sglang_finish(req: Request) -> dict | None:
    """SGLang's ``meta_info.finish_reason``: ``{"type": "stop", "matched": id or string}``,
    ``{"type": "length", "length": n}``, ``{"type": "abort", "message": ...}``."""
    if not req.finished:
        return None
    kind = finish_reason(req)
    if kind == "stop":
        return {"type": "stop", "matched": req.matched_stop}
    if kind == "length":
        return {"type": "length", "length": len(req.output_ids)}
    return {"type": kind, "message": req.error}


def chat_logprobs(st: ServerState, req: Request, start: int = 0, end: int | None = None) -> dict | None:
    """OpenAI's chat ``choices[].logprobs`` for output tokens ``start .. end``: per token its text,
    log-probability, UTF-8 bytes and ``top_logprobs`` alternatives (the target's own distribution,
    whatever the draft proposed)."""
    if req.sampling.logprobs is None:
        return None

    def entry(tok: int, lp: float) -> dict:
        text = st.tokenizer.decode([tok])
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    rows = zip(req.output_ids[start:end], req.logprobs[start:end], req.top_logprobs[start:end])
    content = [entry(t, lp) | {"top_logprobs": [entry(i, v) for i, v in top]} for t, lp, top in rows]
    return {"content": content, "refusal": None}


def completion_logprobs_of(st: ServerState, ids: list[int], lps: list, tops: list, with_top: bool, offset: int = 0):
    """The legacy completions ``logprobs`` object of tokens ``ids`` (a None entry: no logprob there)."""
    tokens = [st.tokenizer.decode([t]) for t in ids]
    offsets = [offset + sum(len(x) for x in tokens[:i]) for i in range(len(tokens))]
    top = [None if row is None else {st.tokenizer.decode([i]): v for i, v in row} for row in tops] if with_top else None
    return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": top, "text_offset": offsets}


def completion_logprobs(st: ServerState, req: Request, start: int = 0, end: int | None = None, offset: int = 0):
    """The legacy completions ``logprobs`` for output tokens ``start .. end``: tokens, token_logprobs,
    top_logprobs (text -> logprob; null when 0 were asked) and each token's character offset in the
    text (from ``offset``, where the previous chunk's text ended)."""
    if req.sampling.logprobs is None:
        return None
    return completion_logprobs_of(
        st,
        req.output_ids[start:end],
        req.logprobs[start:end],
        req.top_logprobs[start:end],
        bool(req.sampling.logprobs),
        offset,
    )


def finish_reason(req: Request, tool_calls: bool = False) -> str:
    if tool_calls:
        return "tool_calls"
    return {"length": "length", "abort": "abort", "error": "error"}.get(req.finish_reason or "", "stop")


def error_event(req: Request) -> str:
    """The last event of a stream that failed (as vLLM sends it), instead of a finish chunk."""
    body = error_body(f"generation failed: {req.error}", "server_error", None, 500)
    return f"data: {json.dumps(body)}\n\n"


# ---- endpoints --------------------------------------------------------------------------------------
@router.get("/health")
async def health(http: HTTPRequest):
    problem = state_of(http).engine.health()
    if problem:
        return JSONResponse({"status": "error", "message": problem}, status_code=503)
    return {"status": "ok"}


@router.get("/v1/models")
async def models(http: HTTPRequest):
    st = state_of(http)
    return {
        "object": "list",
        "data": [
            {
                "id": st.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "dflash2",
                "max_model_len": st.context_length,
            }
        ],
    }


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, http: HTTPRequest):
    st = state_of(http)
    check_model(st, model_id)
    return {
        "id": st.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "dflash2",
        "max_model_len": st.context_length,
    }


@router.get("/version")
async def version():
    return {"version": package_version()}


def package_version() -> str:
    try:
        return importlib.metadata.version("dflash2")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@router.get("/get_model_info")
async def model_info(http: HTTPRequest):
    st = state_of(http)
    path = st.server_args.get("model_path") or st.model_name
    return {"model_path": path, "tokenizer_path": path, "is_generation": True, "served_model_name": st.model_name}


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(http: HTTPRequest):
    """The server's arguments and, as SGLang's ``bench_serving`` reads them, its internal states."""
    st = state_of(http)
    s = st.engine.stats
    elapsed = max(time.perf_counter() - s.started, 1e-9)
    return {
        **st.server_args,
        "version": package_version(),
        "served_model_name": st.model_name,
        "context_length": st.context_length,
        "speculative_num_draft_tokens": st.engine.width,
        # what the runner does (the flag's default is "where it applies")
        "enable_mixed_chunk": bool(getattr(st.engine.runner, "mixed_lengths", ())),
        # whether a step's commit can run while the next one does (the static runner, the flag not given)
        "disable_overlap_schedule": st.engine.cfg.disable_overlap_schedule
        or not getattr(st.engine.runner, "defers_commit", False),
        "async_scheduling": st.engine.cfg.async_scheduling and not st.engine.cfg.disable_overlap_schedule,
        "gc_frozen_objects": gc.get_freeze_count(),  # what no collection walks (launch: freeze_gc)
        "internal_states": [
            {
                "avg_spec_accept_length": s.generated_tokens / s.verify_steps if s.verify_steps else 0.0,
                "last_gen_throughput": s.generated_tokens / elapsed,
            }
        ],
    }


@router.get("/health_generate")
async def health_generate(http: HTTPRequest):
    """Healthy only if a one-token request goes through the engine within 60 s."""
    st = state_of(http)
    if st.engine.health():
        return JSONResponse({"status": "error", "message": st.engine.health()}, status_code=503)
    req = Request(
        await st.encode("Hi", "text"),
        SamplingParams(max_new_tokens=1, ignore_eos=True),
        request_id=f"health-{uuid.uuid4().hex}",
    )
    try:
        await asyncio.wait_for(run_to_end(st, req, http), timeout=60)
    except (asyncio.TimeoutError, APIError) as e:
        st.engine.abort(req.request_id)
        return JSONResponse({"status": "error", "message": f"generation did not complete: {e}"}, status_code=503)
    return {"status": "ok"}


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache():
    return PlainTextResponse("Cache flushed (there is no prefix cache: nothing to drop).\n")


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rid: str | None = None
    abort_all: bool = False


@router.post("/abort_request")
async def abort_request(body: AbortRequest, http: HTTPRequest):
    """Abort by request id (the ``rid`` of /generate, the response ``id`` of the OpenAI routes)."""
    engine = state_of(http).engine
    if body.abort_all:
        ids = engine.request_ids()
    elif body.rid:
        ids = [body.rid]
    else:
        raise APIError(400, "give rid or abort_all", param="rid")
    for rid in ids:
        engine.abort(rid)
    return {"aborted": ids}


@router.get("/metrics")
async def metrics(http: HTTPRequest):
    st = state_of(http)
    return PlainTextResponse(render_metrics(st.engine, st.gc_pauses), media_type="text/plain; version=0.0.4")


def text_messages(messages: list[dict]) -> list[dict]:
    """Messages as a text-only chat template takes them: a list of text parts becomes one string
    (joined by newlines, as vLLM does), ``content: null`` (an assistant turn that only calls tools)
    becomes ``""``; any other part (images, audio) is refused by name."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise APIError(
                        400,
                        f"messages[{i}].content: a part of type {kind!r} is not supported (this model reads text only)",
                        param=f"messages[{i}].content",
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is None:
            content = ""
        out.append({**m, "content": content})
    return out


def usage_chunk(obj: str, rid: str, created: int, model: str, use: dict) -> str:
    """OpenAI's last stream chunk when ``stream_options.include_usage``: no choices, the usage."""
    return f"data: {json.dumps({'id': rid, 'object': obj, 'created': created, 'model': model, 'choices': [], 'usage': use})}\n\n"


async def merged_events(streams: list, tail) -> AsyncIterator[str]:
    """Several choices' event streams as one (n > 1, or a batch of prompts): events as they come,
    each choice's chunks carrying its index; then ``tail()`` (the usage chunk, if asked) and [DONE]
    once. A client that goes away cancels every choice (each aborts its request)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(gen) -> None:
        try:
            async for item in gen:
                await queue.put(item)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(g)) for g in streams]
    try:
        live = len(tasks)
        while live:
            item = await queue.get()
            if item is None:
                live -= 1
            else:
                yield item
        for t in tasks:
            t.result()  # a choice's exception reaches the client
        if (chunk := tail()) is not None:
            yield chunk
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, http: HTTPRequest):
    st = state_of(http)
    check_model(st, body.model)
    use_tools = body.tool_choice != "none"
    messages = text_messages(body.messages)
    try:
        ids = await st.off_loop(
            st.tokenizer.apply_chat_template,
            messages,
            tools=body.tools if use_tools else None,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tokenize=True,
        )
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    except Exception as e:
        raise APIError(400, f"messages could not be rendered with the chat template: {e}", param="messages") from None
    parser = st.tool_call_parser if use_tools else None
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    first = make_request(st, ids, body.max_completion_tokens or body.max_tokens, body, "messages", body.logprobs_k())
    batch = samples(first, body.n, rid)
    if not body.stream:
        await run_all(st, batch, http)
        choices = []
        for i, r in enumerate(batch):
            text = await st.final_text(r, st.skip_special)
            msg: dict = {"role": "assistant"}
            if st.reasoning_parser:
                msg["reasoning_content"], text = ReasoningParser.split(text)
            calls: list[dict] = []
            if parser:
                text, calls = ToolCallParser.parse(parser, text)
                if calls:
                    msg["tool_calls"] = calls
            msg["content"] = text
            choices.append(
                {
                    "index": i,
                    "message": msg,
                    "logprobs": chat_logprobs(st, r),
                    "finish_reason": finish_reason(r, bool(calls)),
                    "matched_stop": r.matched_stop,
                }
            )
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": st.model_name,
            "choices": choices,
            "usage": total_usage(batch, 1, st.spec_usage),
        }
    options = body.stream_options

    def tail() -> str | None:
        if options and options.include_usage:
            return usage_chunk(
                "chat.completion.chunk", rid, created, st.model_name, total_usage(batch, 1, st.spec_usage)
            )
        return None

    streams = [chat_events(st, r, http, rid, created, parser, options, i) for i, r in enumerate(batch)]
    return StreamingResponse(merged_events(streams, tail), media_type="text/event-stream")


async def chat_events(
    st: ServerState,
    req: Request,
    http: HTTPRequest,
    rid: str,
    created: int,
    parser: str | None,
    options: StreamOptions | None,
    index: int = 0,
):
    """One choice's chunks (its usage chunk and [DONE] are :func:`merged_events`')."""
    rp = ReasoningParser() if st.reasoning_parser else None
    tp = ToolCallParser(parser) if parser else None
    n_calls = 0
    every = bool(options and options.continuous_usage_stats)

    sent = 0  # output tokens whose logprobs went out

    def chunk(delta: dict, finish=None):
        nonlocal sent
        choice = {"index": index, "delta": delta, "finish_reason": finish}
        if req.sampling.logprobs is not None and ("content" in delta or finish):  # the tokens since the last one
            choice["logprobs"], sent = chat_logprobs(st, req, sent, len(req.logprobs)), len(req.logprobs)
        d = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": st.model_name,
            "choices": [choice],
        }
        if every:
            d["usage"] = usage(req, st.spec_usage)
        return f"data: {json.dumps(d)}\n\n"

    def call_chunks(calls):
        nonlocal n_calls
        for call in calls:
            yield chunk({"tool_calls": [{"index": n_calls, **call}]})
            n_calls += 1

    yield chunk({"role": "assistant", "content": ""})
    async for delta, done in stream_tokens(st, req, http, st.skip_special):
        if done and req.finish_reason == "error":
            yield error_event(req)
            break
        parts: list[tuple[str | None, str]] = [(None, delta)]
        if rp:
            r, c = rp.feed(delta)
            if done:
                r2, c2 = rp.flush()
                r, c = r + r2, c + c2
            parts = [("reasoning_content", r), (None, c)]
        for key, text in parts:
            if not text:
                continue
            if key:
                yield chunk({key: text})
                continue
            if tp:
                text, calls = tp.feed(text)
                for c in call_chunks(calls):
                    yield c
            if text:
                yield chunk({"content": text})
        if done:
            if tp:
                rest, calls = tp.flush()
                if rest:
                    yield chunk({"content": rest})
                for c in call_chunks(calls):
                    yield c
            yield chunk({}, finish_reason(req, n_calls > 0))


def samples(req: Request, n: int, rid: str) -> list[Request]:
    """``n`` parallel samples of one prompt: copies with their own generators (seed, seed + 1, ... when a
    seed is given, so a seeded request is reproducible), request ids ``rid`` or ``rid-j``."""
    if n == 1:
        req.request_id = rid
        return [req]
    seed = req.sampling.seed
    out = []
    for j in range(n):
        s = None if seed is None else (seed + j if seed + j <= SEED_RANGE[1] else seed - j)
        out.append(
            Request(
                list(req.prompt_ids),
                dataclasses.replace(req.sampling, seed=s),
                stop_strings=req.stop_strings,
                request_id=f"{rid}-{j}",
            )
        )
    return out


def is_batch(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)


async def prompt_ids(st: ServerState, prompt, param: str) -> list[list[int]]:
    """Token ids of each prompt of a batch (or of the one prompt): text is tokenized, ids kept."""
    prompts = prompt if is_batch(prompt) else [prompt]
    return [list(p) if isinstance(p, list) else await st.encode(p, param) for p in prompts]


async def run_all(st: ServerState, reqs: list[Request], http: HTTPRequest) -> None:
    """Every request of a batch to its end; if one fails, the others are cancelled (and aborted)."""
    tasks = [asyncio.ensure_future(run_to_end(st, r, http)) for r in reqs]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise


@router.post("/v1/completions")
async def completions(body: CompletionRequest, http: HTTPRequest):
    st = state_of(http)
    check_model(st, body.model)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    prompts = await prompt_ids(st, body.prompt, "prompt")
    # best_of: that many samples per prompt, the n with the highest log-probability returned (their
    # logprobs are kept internally even when the client did not ask for them)
    best_of, shown = body.best_of or body.n, body.logprobs_k()
    kept = shown if shown is not None or best_of == body.n else 0
    batch = [
        r
        for i, ids in enumerate(prompts)
        for r in samples(
            make_request(st, ids, body.max_tokens, body, "prompt", kept, body.prompt_logprobs_k()),
            best_of,
            rid if len(prompts) == 1 else f"{rid}-{i}",
        )
    ]
    options = body.stream_options
    if body.echo and body.stream:
        raise APIError(400, "echo with stream is not supported yet: send it without stream", param="echo")
    if not body.stream:
        await run_all(st, batch, http)
        chosen = [
            r
            for j in range(0, len(batch), best_of)
            for r in sorted(batch[j : j + best_of], key=lambda r: -sum(r.logprobs))[: body.n]
        ]
        choices = []
        for i, r in enumerate(chosen):
            text, lps = await st.final_text(r), completion_logprobs(st, r) if shown is not None else None
            if body.echo:  # the prompt's text first; with logprobs its tokens' too (the first has none)
                head = st.tokenizer.decode(r.prompt_ids)
                text = head + text
                if lps is not None:
                    pre = completion_logprobs_of(st, r.prompt_ids, [None, *r.prompt_logprobs],
                                                 [None, *r.prompt_top_logprobs], bool(r.sampling.logprobs))  # fmt: skip
                    lps = {
                        "tokens": pre["tokens"] + lps["tokens"],
                        "token_logprobs": pre["token_logprobs"] + lps["token_logprobs"],
                        "top_logprobs": None
                        if lps["top_logprobs"] is None
                        else pre["top_logprobs"] + lps["top_logprobs"],
                        "text_offset": pre["text_offset"] + [len(head) + o for o in lps["text_offset"]],
                    }
            choices.append(
                {
                    "index": i,
                    "text": text,
                    "finish_reason": finish_reason(r),
                    "logprobs": lps,
                    "matched_stop": r.matched_stop,
                }
            )
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": st.model_name,
            "choices": choices,
            "usage": total_usage(
                batch, len(prompts), st.spec_usage
            ),  # every sample best_of generated, as OpenAI counts
        }

    def tail() -> str | None:
        if options and options.include_usage:
            use = total_usage(batch, len(prompts), st.spec_usage)
            return usage_chunk("text_completion", rid, created, st.model_name, use)
        return None

    async def events(req: Request, index: int):
        sent, chars = 0, 0  # output tokens whose logprobs went out, characters of text sent
        async for delta, done in stream_tokens(st, req, http):
            if done and req.finish_reason == "error":
                yield error_event(req)
                break
            if delta or done:
                choice = {"index": index, "text": delta, "finish_reason": finish_reason(req) if done else None}
                choice["logprobs"] = completion_logprobs(st, req, sent, len(req.logprobs), chars)
                sent, chars = len(req.logprobs), chars + len(delta)
                d = {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": st.model_name,
                    "choices": [choice],
                }
                if options and options.continuous_usage_stats:
                    d["usage"] = usage(req, st.spec_usage)
                yield f"data: {json.dumps(d)}\n\n"

    streams = [events(r, i) for i, r in enumerate(batch)]  # choice i: prompt i // n, sample i % n
    return StreamingResponse(merged_events(streams, tail), media_type="text/event-stream")


def total_usage(batch: list[Request], prompts: int, spec: bool = False) -> dict:
    """Usage of a batch: each prompt counted once (n samples share it, as OpenAI counts), every completion."""
    per = [usage(r, spec) for r in batch]
    if len(per) == 1:
        return per[0]
    n = len(batch) // prompts
    out = {
        "prompt_tokens": sum(u["prompt_tokens"] for u in per[::n]),
        "completion_tokens": sum(u["completion_tokens"] for u in per),
    }
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    if spec:
        out["spec_verify_ct"] = sum(r.verify_steps for r in batch)
        out["spec_accept_length"] = round(out["completion_tokens"] / max(out["spec_verify_ct"], 1), 4)
    return out


@router.post("/generate")
async def generate(body: GenerateRequest, http: HTTPRequest):
    st = state_of(http)
    if (body.input_ids is None) == (body.text is None):
        raise APIError(400, "give exactly one of text or input_ids", param="text")
    prompt, param = (body.input_ids, "input_ids") if body.input_ids is not None else (body.text, "text")
    sp = body.sampling_params
    many = is_batch(prompt) or sp.n > 1
    rid = body.rid or uuid.uuid4().hex
    prompts = await prompt_ids(st, prompt, param)
    batch = [
        r
        for i, ids in enumerate(prompts)
        for r in samples(
            make_request(st, ids, sp.max_new_tokens, sp, param, body.logprobs_k(), body.prompt_logprobs_k()),
            sp.n,
            rid if len(prompts) == 1 else f"{rid}-{i}",
        )
    ]
    t0 = time.perf_counter()

    def meta(req: Request) -> dict:
        return {
            "id": req.request_id,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,  # no prefix cache
            "spec_verify_ct": req.verify_steps,
            "spec_accept_length": req.accept_length,
            "spec_accept_rate": round(req.spec_accept_rate, 4),
            "spec_accept_histogram": req.accept_hist,
            "spec_mean_width": round(req.mean_width, 4),  # the planner's verify widths, averaged
            # whether it drafted at all (the planner admits a request without drafting where it cannot pay)
            "spec_drafting": st.engine.draft is not None and req.speculate,
            "finish_reason": sglang_finish(req),
            "e2e_latency": time.perf_counter() - t0,
        } | (logprob_meta(req) if body.return_logprob else {})

    def logprob_meta(req: Request) -> dict:
        """SGLang's output_token_logprobs ([logprob, id, text]) and output_top_logprobs per token."""

        def item(tok: int, lp: float | None) -> list:
            return [lp, tok, st.tokenizer.decode([tok]) if body.return_text_in_logprobs else None]

        out: dict = {"output_token_logprobs": [item(t, lp) for t, lp in zip(req.output_ids, req.logprobs)]}
        if body.top_logprobs_num:
            out["output_top_logprobs"] = [[item(i, v) for i, v in row] for row in req.top_logprobs]
        if body.prompt_logprobs_k() is not None:  # from logprob_start_len on; the prompt's first token has none
            start = body.logprob_start_len or 0
            lps = [None, *req.prompt_logprobs]
            out["input_token_logprobs"] = [item(t, lp) for t, lp in zip(req.prompt_ids, lps)][start:]
            if body.top_logprobs_num:
                tops = [[], *req.prompt_top_logprobs]
                out["input_top_logprobs"] = [[item(i, v) for i, v in row] for row in tops][start:]
        return out

    if not body.stream:
        await run_all(st, batch, http)
        out = [{"text": await st.final_text(r), "output_ids": r.output_ids, "meta_info": meta(r)} for r in batch]
        return out if many else out[0]
    if many:
        raise APIError(
            400,
            "stream with a batch of prompts or n > 1 is not supported yet: send one stream each",
            param=param if len(prompts) > 1 else "n",
        )
    req = batch[0]

    async def events():
        text = ""
        async for delta, done in stream_tokens(st, req, http):
            if done and req.finish_reason == "error":
                yield error_event(req)
                break
            text += delta
            yield f"data: {json.dumps({'text': text, 'output_ids': req.output_ids, 'meta_info': meta(req)})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
