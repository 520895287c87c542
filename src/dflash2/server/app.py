"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn, server-sent events)."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..engine.engine import LLMEngine
from ..engine.request import Request
from ..verification import SamplingParams
from .metrics import render_metrics
from .parsers import ReasoningParser, ToolCallParser
from .protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(message: str, type_: str, param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def trim_stop(text: str, req: Request) -> str:
    for s in req.stop_strings:
        i = text.find(s)
        if i >= 0:
            text = text[:i]
    return text


class Detokenizer:
    """Incremental text of a request's output; holds back an incomplete UTF-8 character."""

    def __init__(self, tokenizer, skip_special: bool = True):
        self.tok, self.skip, self.sent = tokenizer, skip_special, ""

    def delta(self, req: Request, final: bool = False) -> str:
        text = trim_stop(self.tok.decode(req.output_ids, skip_special_tokens=self.skip), req)
        if not final and text.endswith("\ufffd"):
            return ""
        out, self.sent = text[len(self.sent):], text
        return out


def create_app(engine: LLMEngine, tokenizer, model_name: str, context_length: int,
               reasoning_parser: str | None = None, tool_call_parser: str | None = None) -> FastAPI:
    app = FastAPI(title="dflash2")

    @app.exception_handler(APIError)
    async def _api_error(_req, e: APIError):
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return JSONResponse(error_body(f"{first.get('msg', 'invalid request')}" + (f" ({loc})" if loc else ""),
                                       "invalid_request_error", loc), status_code=400)

    # ---- helpers -------------------------------------------------------------------------
    def check_model(name: str | None) -> None:
        if name is not None and name not in (model_name, "default"):
            raise APIError(404, f"The model '{name}' does not exist", "invalid_request_error", "model", "model_not_found")

    def make_request(prompt_ids: list[int], max_tokens: int | None, body) -> Request:
        if len(prompt_ids) >= context_length:
            raise APIError(400, f"This model's maximum context length is {context_length} tokens; the prompt has "
                                f"{len(prompt_ids)} tokens", param="messages", code="context_length_exceeded")
        budget = context_length - len(prompt_ids)
        max_new = max_tokens if max_tokens is not None else budget
        if max_new > budget:
            raise APIError(400, f"max_tokens={max_new} plus the prompt's {len(prompt_ids)} tokens exceeds the "
                                f"context length {context_length}", param="max_tokens", code="context_length_exceeded")
        stop = body.stop if isinstance(body.stop, list) else ([body.stop] if body.stop else [])
        try:
            sp = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                                max_new_tokens=max_new, seed=body.seed, stop_token_ids=tuple(body.stop_token_ids or ()),
                                ignore_eos=body.ignore_eos)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return Request(list(prompt_ids), sp, stop_strings=tuple(stop))

    async def submit(req: Request) -> asyncio.Queue:
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        req.on_update = lambda r, new: loop.call_soon_threadsafe(queue.put_nowait, (list(new), r.finished))
        try:
            engine.add_request(req)
        except ValueError as e:
            raise APIError(400, str(e), code="context_length_exceeded") from None
        return queue

    def usage(req: Request) -> dict:
        return {"prompt_tokens": len(req.prompt_ids), "completion_tokens": len(req.output_ids),
                "total_tokens": len(req.prompt_ids) + len(req.output_ids), "spec_verify_ct": req.verify_steps,
                "spec_accept_length": round(req.accept_length, 4)}

    async def updates(req: Request, http: HTTPRequest):
        """Yield ``finished`` after every engine update; abort the request if the client goes away."""
        queue = await submit(req)
        try:
            while True:
                try:
                    _, done = await asyncio.wait_for(queue.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        return
                    continue
                yield done
                if done:
                    return
        finally:
            if not req.finished:
                engine.abort(req.request_id)  # frees its KV blocks at the next step

    async def run_to_end(req: Request, http: HTTPRequest) -> Request:
        async for _ in updates(req, http):
            pass
        if not req.finished:
            raise APIError(499, "client disconnected")
        if req.finish_reason == "error":
            raise APIError(500, f"generation failed: {req.error}", "server_error")
        return req

    async def stream_tokens(req: Request, http: HTTPRequest):
        """Yield (text delta, finished) until the request ends."""
        detok = Detokenizer(tokenizer, skip_special=tool_call_parser != "kimi_k2")
        async for done in updates(req, http):
            yield detok.delta(req, final=done), done

    def finish_reason(req: Request, tool_calls: bool = False) -> str:
        return "tool_calls" if tool_calls else ("length" if req.finish_reason == "length" else "stop")

    # ---- endpoints -----------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "dflash2",
                                            "max_model_len": context_length}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(engine), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: HTTPRequest):
        check_model(body.model)
        try:
            ids = tokenizer.apply_chat_template(body.messages, tools=body.tools, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        except Exception as e:
            raise APIError(400, f"messages could not be rendered with the chat template: {e}", param="messages") from None
        req = make_request(ids, body.max_completion_tokens or body.max_tokens, body)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if not body.stream:
            await run_to_end(req, http)
            text = trim_stop(tokenizer.decode(req.output_ids, skip_special_tokens=tool_call_parser != "kimi_k2"), req)
            msg: dict = {"role": "assistant"}
            if reasoning_parser:
                msg["reasoning_content"], text = ReasoningParser.split(text)
            calls = []
            if tool_call_parser:
                text, calls = ToolCallParser.parse(tool_call_parser, text)
                if calls:
                    msg["tool_calls"] = calls
            msg["content"] = text
            return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "message": msg, "finish_reason": finish_reason(req, bool(calls))}],
                    "usage": usage(req)}

        async def events():
            rp = ReasoningParser() if reasoning_parser else None
            tp = ToolCallParser(tool_call_parser) if tool_call_parser else None
            any_calls = False

            def chunk(delta: dict, finish=None, use=None):
                d = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
                if use:
                    d["usage"] = use
                return f"data: {json.dumps(d)}\n\n"

            yield chunk({"role": "assistant", "content": ""})
            async for delta, done in stream_tokens(req, http):
                parts = [(None, delta)]
                if rp:
                    r, c = rp.feed(delta)
                    if done:
                        r2, c2 = rp.flush(); r, c = r + r2, c + c2
                    parts = [("reasoning_content", r), (None, c)]
                for key, text in parts:
                    if not text:
                        continue
                    if key:
                        yield chunk({key: text}); continue
                    if tp:
                        text, calls = tp.feed(text)
                        for i, call in enumerate(calls):
                            any_calls = True
                            yield chunk({"tool_calls": [{"index": i, **call}]})
                    if text:
                        yield chunk({"content": text})
                if done:
                    if tp:
                        rest, calls = tp.flush()
                        if rest:
                            yield chunk({"content": rest})
                        for i, call in enumerate(calls):
                            any_calls = True
                            yield chunk({"tool_calls": [{"index": i, **call}]})
                    yield chunk({}, finish_reason(req, any_calls), usage(req))
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        check_model(body.model)
        ids = list(body.prompt) if isinstance(body.prompt, list) else tokenizer(body.prompt)["input_ids"]
        req = make_request(ids, body.max_tokens, body)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if not body.stream:
            await run_to_end(req, http)
            text = trim_stop(tokenizer.decode(req.output_ids, skip_special_tokens=True), req)
            return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "text": text, "finish_reason": finish_reason(req), "logprobs": None}],
                    "usage": usage(req)}

        async def events():
            async for delta, done in stream_tokens(req, http):
                if delta or done:
                    d = {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                         "choices": [{"index": 0, "text": delta, "finish_reason": finish_reason(req) if done else None}]}
                    if done:
                        d["usage"] = usage(req)
                    yield f"data: {json.dumps(d)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/generate")
    async def generate(body: GenerateRequest, http: HTTPRequest):
        if body.input_ids is None and body.text is None:
            raise APIError(400, "give text or input_ids", param="text")
        ids = body.input_ids if body.input_ids is not None else tokenizer(body.text)["input_ids"]
        sp = body.sampling_params
        req = make_request(ids, sp.max_new_tokens, sp)
        rid = uuid.uuid4().hex
        t0 = time.perf_counter()

        def meta() -> dict:
            return {"id": rid, "prompt_tokens": len(req.prompt_ids), "completion_tokens": len(req.output_ids),
                    "spec_verify_ct": req.verify_steps, "spec_accept_length": req.accept_length,
                    "spec_accept_histogram": req.accept_hist,
                    "finish_reason": {"type": finish_reason(req)} if req.finished else None,
                    "e2e_latency": time.perf_counter() - t0}

        if not body.stream:
            await run_to_end(req, http)
            return {"text": trim_stop(tokenizer.decode(req.output_ids, skip_special_tokens=True), req),
                    "output_ids": req.output_ids, "meta_info": meta()}

        async def events():
            text = ""
            async for delta, done in stream_tokens(req, http):
                text += delta
                yield f"data: {json.dumps({'text': text, 'output_ids': req.output_ids, 'meta_info': meta()})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app
