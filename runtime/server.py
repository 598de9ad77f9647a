"""``mkc serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the batching engine.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with SSE streaming ending
in ``data: [DONE]`` and ``stream_options.include_usage``), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus).

Every bad request gets an OpenAI error object ``{"error": {"message", "type", "param", "code"}}``
with status 400 (404 for an unknown model or route) and the server keeps serving. A client that
goes away mid-request has its request aborted, which frees its slot and KV pages.

CLI: ``add_serve_arguments(parser)`` declares the options and ``serve_main(args)`` runs the server;
``python -m mkc.runtime.server ...`` does both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from mkc.runtime.engine import Engine, Output
from mkc.runtime.metrics import Metrics
from mkc.runtime.sampling import SamplingParams
from mkc.runtime.serve_options import add_serve_arguments
from mkc.runtime.tokenizer import Tokenizer, encode_chat, message_text
from mkc.runtime.tool_calls import parse_tool_calls, tool_names

log = logging.getLogger("mkc.server")

DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


# ----------------------------------------------------------------------------------------------
# errors


class APIError(Exception):
    """An error answered to the client as an OpenAI error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content={"error": {
            "message": self.message, "type": self.type, "param": self.param, "code": self.code}})


def _validation_error(e: ValidationError | RequestValidationError) -> APIError:
    err = e.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    # pydantic names union members in the location ("prompt.str"): keep the field path only
    param = ".".join(x for x in loc if not x.startswith(("str", "list[", "int", "float", "bool", "dict[",
                                                          "function-")))
    msg = err.get("msg", "invalid value")
    return APIError(400, f"{param or 'body'}: {msg}" + (f" (got {err['input']!r})" if "input" in err and
                                                         not isinstance(err["input"], (dict, list)) else ""),
                    param=param or None)


# ----------------------------------------------------------------------------------------------
# request bodies (strict: "5" is not an integer, true is not a number)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # extension (as vLLM's): the usage so far on every chunk


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM and others accept it)
    seed: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    ignore_eos: bool | None = False  # extension, for benchmarks


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    echo: bool | None = False
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


# ----------------------------------------------------------------------------------------------
# the app


@dataclass
class ServerState:
    engine: Engine
    tokenizer: Tokenizer
    model_name: str  # the one id /v1/models lists and requests must name
    context: int  # KV positions per sequence
    vocab_size: int
    metrics: Metrics
    created: int  # unix time the server started


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI app; starts the engine thread on startup and stops it on shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        yield
        state.engine.stop()

    app = FastAPI(title="mkc", lifespan=lifespan)
    app.state.mkc = state
    _add_error_handlers(app, state)
    _add_status_routes(app, state)
    _add_generation_routes(app, state)
    return app


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    """Our errors (APIError), a body that fails validation, an unknown route or method, and a bug
    (500) are each answered as an OpenAI error object and counted by status."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        state.metrics.http_errors.labels(status=str(e.status)).inc()
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, e: RequestValidationError) -> JSONResponse:
        return await _api_error(request, _validation_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return await _api_error(request, APIError(e.status_code, str(e.detail), code=code))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return await _api_error(request, APIError(500, f"internal error: {type(e).__name__}: {e}",
                                                  type="server_error"))


def _add_status_routes(app: FastAPI, state: ServerState) -> None:
    """GET /health, /metrics (Prometheus) and /v1/models: whether the engine runs, its counters,
    and the one model served."""

    @app.get("/health")
    async def health() -> Response:
        if not state.engine.alive:
            return JSONResponse(status_code=503, content={"status": "engine not running"})
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        _check_model(state, model_id)
        return _model_card(state)


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    """POST /v1/completions and /v1/chat/completions: a request checked, its prompt tokenized and
    handed to the engine, the answer streamed as SSE or returned whole."""

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = _parse(CompletionRequest, await _json_body(request))
        _check_model(state, req.model)
        _check_common(req)
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if req.best_of not in (None, 1):
            raise APIError(400, f"best_of = {req.best_of}: only 1 is supported", param="best_of")
        ids = _prompt_ids(state, req.prompt)
        params = _sampling_params(state, req, req.max_tokens, len(ids), DEFAULT_COMPLETION_MAX_TOKENS)
        gen = _Generation(state, request, ids, params)
        gen.start()
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            return _sse(_stream(state, gen, req, rid, created, "text_completion", _completion_choices))
        text, last = await gen.collect()
        return JSONResponse({"id": rid, "object": "text_completion", "created": created,
                             "model": state.model_name, "choices": [_choice(last.finish_reason, text=text)],
                             "usage": _usage(last)})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = _parse(ChatRequest, await _json_body(request))
        _check_model(state, req.model)
        _check_common(req)
        messages = [_message_dict(m, i) for i, m in enumerate(req.messages)]
        use_tools = bool(req.tools) and req.tool_choice != "none"
        try:
            text = state.tokenizer.apply_chat_template(messages, req.tools if use_tools else None)
        except Exception as e:  # noqa: BLE001 - a template rejecting the conversation (roles out of order)
            raise APIError(400, f"messages: the chat template rejected them: {e}", param="messages") from None
        ids = encode_chat(state.tokenizer, text)
        if not ids:
            raise APIError(400, "messages: the prompt is empty", param="messages")
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        params = _sampling_params(state, req, limit, len(ids), None, param=param)
        gen = _Generation(state, request, ids, params)
        gen.start()
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        names = tool_names(req.tools) if use_tools else set()
        if req.stream:
            return _sse(_stream(state, gen, req, rid, created, "chat.completion.chunk", _chat_choices(names),
                                first=[_choice(None, delta={"role": "assistant", "content": ""})]))
        text, last = await gen.collect()
        message, finish = _chat_message(text, last.finish_reason, names)
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created,
                             "model": state.model_name, "choices": [_choice(finish, message=message)],
                             "usage": _usage(last)})


def _model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "mkc",
            "max_model_len": state.context}


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None


def _parse(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e) from None


def _check_model(state: ServerState, name: str) -> None:
    if name != state.model_name:
        raise APIError(404, f"The model '{name}' does not exist (this server serves '{state.model_name}')",
                       param="model", code="model_not_found")


def _check_common(req: _Sampling) -> None:
    if req.n not in (None, 1):
        raise APIError(400, f"n = {req.n}: only n = 1 is supported", param="n")
    if req.logprobs not in (None, False, 0):
        raise APIError(400, "logprobs are not supported", param="logprobs")


def _prompt_ids(state: ServerState, prompt: str | list[str] | list[int]) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, f"prompt: got {len(prompt)} prompts: only one per request is supported",
                           param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = state.tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < state.vocab_size]
        if bad:
            raise APIError(400, f"prompt: token ids {bad[:5]} outside [0, {state.vocab_size})", param="prompt")
    if not ids:
        raise APIError(400, "prompt: no tokens: expected at least one", param="prompt")
    return ids


def _sampling_params(state: ServerState, req: _Sampling, max_tokens: int | None, prompt_len: int,
                     default_max: int | None, param: str = "max_tokens") -> SamplingParams:
    room = state.context - prompt_len
    if room < 1:
        raise APIError(400, f"This model's maximum context length is {state.context} tokens; the prompt has "
                            f"{prompt_len}. Shorten the prompt.", param="messages" if param != "max_tokens"
                       or not isinstance(req, CompletionRequest) else "prompt", code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(default_max or room, room)
    elif max_tokens < 1:
        raise APIError(400, f"{param} = {max_tokens}: expected at least 1", param=param)
    elif prompt_len + max_tokens > state.context:
        raise APIError(400, f"This model's maximum context length is {state.context} tokens; the prompt has "
                            f"{prompt_len} and {param} asks for {max_tokens}. Lower {param} to at most {room}.",
                       param=param, code="context_length_exceeded")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None or req.top_k < 0 else req.top_k,
        seed=req.seed, stop=stop, ignore_eos=bool(req.ignore_eos))
    try:
        params.check()
    except ValueError as e:
        field = str(e).split(" ")[0].rstrip(":")
        raise APIError(400, str(e), param=field) from None
    return params


def _message_dict(m: ChatMessage, i: int) -> dict[str, Any]:
    if isinstance(m.content, list):
        for p in m.content:
            if p.get("type") not in ("text", None):
                raise APIError(400, f"messages[{i}].content: only text parts are supported (got type "
                                    f"{p.get('type')!r})", param=f"messages.{i}.content")
            if not isinstance(p.get("text", ""), str):
                raise APIError(400, f"messages[{i}].content: a text part's text must be a string (got "
                                    f"{type(p['text']).__name__})", param=f"messages.{i}.content")
    for j, call in enumerate(m.tool_calls or ()):
        # an assistant's earlier call must name its function and arguments: the prompt shows both
        f = call.get("function")
        if not (isinstance(f, dict) and isinstance(f.get("name"), str) and "arguments" in f):
            raise APIError(400, f"messages[{i}].tool_calls[{j}]: expected {{\"function\": {{\"name\": ..., "
                                f"\"arguments\": ...}}}}, got {json.dumps(call)[:200]}", param=f"messages.{i}.tool_calls")
    d = m.model_dump(exclude_none=True)
    d["content"] = message_text(d)
    return d


def _usage(last: Output) -> dict[str, int]:
    return {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
            "total_tokens": last.prompt_tokens + last.completion_tokens}


def _chat_message(text: str, finish: str | None, names: set[str]) -> tuple[dict[str, Any], str | None]:
    if names:
        calls, content = parse_tool_calls(text, names)
        if calls:
            return ({"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]},
                    "tool_calls")
    return {"role": "assistant", "content": text}, finish


# ----------------------------------------------------------------------------------------------
# one generation: engine outputs → asyncio


class _Generation:
    """Submits a request to the engine and hands its outputs to the event loop.

    Iterating it yields ``Output``s until the finishing one; leaving early (client gone, task
    cancelled) aborts the request so the engine frees its slot.
    """

    def __init__(self, state: ServerState, request: Request, ids: list[int], params: SamplingParams):
        self.state, self.request, self.ids, self.params = state, request, ids, params
        self.queue: asyncio.Queue[Output] = asyncio.Queue()
        self.rid: str | None = None
        self.done = False

    def start(self) -> None:
        """Submit now, so a request the engine refuses is still answered with a 400."""
        loop = asyncio.get_running_loop()
        q = self.queue

        def sink(out: Output) -> None:
            loop.call_soon_threadsafe(q.put_nowait, out)

        try:
            self.rid = self.state.engine.submit(self.ids, self.params, sink)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    async def outputs(self, poll_disconnect: bool = False) -> AsyncIterator[Output]:
        if self.rid is None:
            self.start()
        checked = time.monotonic()
        try:
            while True:
                if poll_disconnect:
                    # nothing is being sent: only asking the connection tells a client that left
                    if time.monotonic() - checked > DISCONNECT_POLL_S:
                        checked = time.monotonic()
                        if await self.request.is_disconnected():
                            log.info("client of %s went away", self.rid)
                            return
                    try:
                        out = await asyncio.wait_for(self.queue.get(), timeout=DISCONNECT_POLL_S)
                    except TimeoutError:
                        continue
                else:
                    out = await self.queue.get()
                if out.finish_reason is not None:
                    self.done = True
                yield out
                if self.done:
                    return
        finally:
            if not self.done and self.rid is not None:
                self.state.engine.abort(self.rid)

    async def collect(self) -> tuple[str, Output]:
        """All text and the last output; raises APIError(500) when generation failed."""
        parts: list[str] = []
        last: Output | None = None
        async for out in self.outputs(poll_disconnect=True):
            parts.append(out.text)
            last = out
        if last is None or last.finish_reason is None or last.finish_reason == "abort":
            raise APIError(499, "client closed the request", code="client_closed")
        if last.finish_reason == "error":
            raise APIError(500, f"generation failed: {last.error}", type="server_error")
        return "".join(parts), last


def _sse(events: AsyncIterator[dict[str, Any] | str]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        async for e in events:
            yield f"data: {e if isinstance(e, str) else json.dumps(e, separators=(',', ':'))}\n\n"
    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _error_event(out: Output) -> dict[str, Any]:
    return {"error": {"message": f"generation failed: {out.error or out.finish_reason}", "type": "server_error",
                      "param": None, "code": None}}


def _choice(finish: str | None, **payload: Any) -> dict[str, Any]:
    """The one choice of a response or chunk: ``payload`` is ``text=`` (completions), ``message=``
    (chat) or ``delta=`` (chat chunks)."""
    return {"index": 0, **payload, "logprobs": None, "finish_reason": finish}


async def _stream(state: ServerState, gen: _Generation, req: _Sampling, rid: str, created: int,
                  object_type: str, choices: Callable[[Output], Iterable[dict[str, Any]]],
                  first: Iterable[dict[str, Any]] = ()) -> AsyncIterator[dict[str, Any] | str]:
    """The SSE events of one streamed request: a chunk for each of ``first``, then for each choice
    ``choices`` makes of an output; an error event if generation fails or the server shuts down;
    the usage chunk when ``stream_options.include_usage`` asks for it; ``[DONE]`` last."""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    # a chunk for every token, even one with no text of its own, carrying the usage so far: a
    # client can time each token
    continuous = include_usage and bool(req.stream_options and req.stream_options.continuous_usage_stats)
    base = {"id": rid, "object": object_type, "created": created, "model": state.model_name}

    def chunk(choice: dict[str, Any], out: Output | None = None) -> dict[str, Any]:
        c = {**base, "choices": [choice]}
        if include_usage:
            c["usage"] = _usage(out) if continuous and out is not None else None
        return c

    for choice in first:
        yield chunk(choice)
    last = None
    async for out in gen.outputs():
        last = out
        if out.finish_reason in ("error", "abort"):  # abort here = the server is shutting down
            yield _error_event(out)
            break
        sent = False
        for choice in choices(out):
            yield chunk(choice, out)
            sent = True
        if continuous and not sent and out.token_ids:
            empty = _choice(None, text="") if object_type == "text_completion" else _choice(None, delta={})
            yield chunk(empty, out)
    if include_usage and last is not None:
        yield {**base, "choices": [], "usage": _usage(last)}
    yield "[DONE]"


def _completion_choices(out: Output) -> Iterator[dict[str, Any]]:
    if out.text or out.finish_reason:
        yield _choice(out.finish_reason, text=out.text)


def _chat_choices(names: set[str]) -> Callable[[Output], Iterator[dict[str, Any]]]:
    """Chat deltas of one stream; with tools (``names``) the text is held until it is known whether
    it is a call, and comes as one delta at the end."""
    held: list[str] = []

    def choices(out: Output) -> Iterator[dict[str, Any]]:
        if names:
            held.append(out.text)
            if out.finish_reason:
                message, finish = _chat_message("".join(held), out.finish_reason, names)
                if "tool_calls" in message:
                    delta = {"tool_calls": [{**c, "index": i} for i, c in enumerate(message["tool_calls"])]}
                    if message["content"]:
                        delta["content"] = message["content"]
                else:
                    delta = {"content": message["content"]}
                yield _choice(finish, delta=delta)
            return
        if out.text:
            yield _choice(None, delta={"content": out.text})
        if out.finish_reason:
            yield _choice(out.finish_reason, delta={})

    return choices


# ----------------------------------------------------------------------------------------------
# CLI


def build_state(args: argparse.Namespace) -> ServerState:
    """Spec, weights, backend, tokenizer and engine from the parsed options (raises on bad input)."""
    import torch

    from mkc.ir.spec import load_spec
    from mkc.runtime.tokenizer import load_tokenizer
    from mkc.runtime.weights import load_checkpoint, random_weights

    config = args.config or args.checkpoint
    if config is None:
        raise ValueError("--config is required with --random-weights")
    if not 1 <= args.max_batch <= 8:
        raise ValueError(f"--max-batch {args.max_batch}: expected 1 to 8 (the batch sizes the lowering supports)")
    if args.context < 2 or args.page_size < 1:
        raise ValueError(f"--context {args.context} / --page-size {args.page_size}: expected at least 2 / 1")
    spec = load_spec(config)
    backend_name = args.backend
    if backend_name == "auto":
        backend_name = "cuda" if _has_cuda_backend() else "cpu"
    if backend_name == "cuda":
        _require_cuda()
    threads = args.cpu_threads or (1 if backend_name == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    dtype = getattr(torch, args.dtype or ("float32" if backend_name == "cpu" else "bfloat16"))
    if args.prefill_chunk < 1 or args.prefill_budget <= 0:
        raise ValueError(f"--prefill-chunk {args.prefill_chunk} / --prefill-budget {args.prefill_budget}: "
                         f"expected at least 1 token / a positive number of decode steps")
    t0 = time.monotonic()
    log.info("loading %s weights of %s (%s) ...", "random" if args.random_weights else "checkpoint", spec.name,
             str(dtype).removeprefix("torch."))
    if backend_name == "cuda":
        _check_gpu_memory(spec, args)
    fmt = getattr(args, "weights", "bf16")
    if args.random_weights and backend_name == "cuda" and fmt != "bf16":  # FP8 as made: never the bf16 model
        from mkc.runtime.bench import device_random_fp8_weights

        weights = device_random_fp8_weights(spec, args.seed, fmt)
    elif args.random_weights and backend_name == "cuda":  # made on the GPU: seconds, not minutes on the host
        from mkc.runtime.bench import device_random_weights

        weights = device_random_weights(spec, args.seed)
    else:
        weights = (random_weights(spec, args.seed, dtype) if args.random_weights
                   else load_checkpoint(args.checkpoint, spec, dtype))
    log.info("weights ready in %.1f s; building the %s backend (schedule, kernel, weights on the device) ...",
             time.monotonic() - t0, backend_name)
    t1 = time.monotonic()
    paged = args.kv_layout == "paged"
    kv_pages = args.kv_pages or args.max_batch * -(-args.context // args.page_size)
    backend = make_backend(backend_name, spec, weights, max_batch=args.max_batch, context=args.context,
                           dtype=dtype, num_sms=args.num_sms, page_size=args.page_size if paged else 0,
                           kv_pages=kv_pages if paged else 0, batches=getattr(args, "step_batches", None),
                           weights_format=fmt)
    log.info("backend ready in %.1f s", time.monotonic() - t1)
    tokenizer = load_tokenizer(args.checkpoint, spec.vocab_size)
    metrics = Metrics()
    copies = (prefix_copy_pages(spec, args)
              if backend_name == "cuda" and not paged and not args.no_prefix_cache else None)
    engine = Engine(backend, tokenizer, page_size=args.page_size, kv_pages=args.kv_pages,
                    prefix_cache=not args.no_prefix_cache, metrics=metrics, prefill_chunk=args.prefill_chunk,
                    prefill_budget=args.prefill_budget, prefix_cache_pages=copies)
    log.info("serving %s: backend %s, step batches %s, context %d, tokenizer %s, %d KV pages of %d",
             spec.name, backend_name, ",".join(map(str, backend.step_batches)), args.context, tokenizer.name,
             engine.kv_pages, args.page_size)
    return ServerState(engine=engine, tokenizer=tokenizer, model_name=args.served_model_name or spec.name,
                       context=args.context, vocab_size=spec.vocab_size, metrics=metrics, created=int(time.time()))


def _has_cuda_backend() -> bool:
    try:
        from mkc.runtime.cuda_backend import cuda_available
    except ImportError:  # the cuda extra is not installed
        return False
    return cuda_available()


def serve_memory(spec: Any, max_batch: int, context: int, page_size: int, kv_pages: int, prefill_chunk: int,
                 weights_format: str = "bf16") -> dict:
    """Bytes ``mkc serve --backend cuda`` needs on the GPU, by part: the weights (in
    ``weights_format``: mkc/ir/fp8.py); the KV
    cache (a slab per slot, or ``kv_pages`` pages and the scratch page); the prefill's working
    memory (the largest layer's matrices read back row-major, and a chunk's activations and
    expert rows, bounded by FastPrefill's SUB_CHUNK positions at a time within a layer); a margin for the
    step decoders' activations and the allocator."""
    import math

    from mkc.ir.fp8 import stored_bytes
    from mkc.runtime.prefill import SUB_CHUNK
    from mkc.runtime.weights import weight_shapes

    a, m, H = spec.attention, spec.moe, spec.hidden_size
    kv = ((kv_pages + 1) * page_size if page_size else max_batch * context) * kv_position_bytes(spec)
    shapes = weight_shapes(spec)
    weights = stored_bytes(shapes, weights_format, spec.tie_word_embeddings)
    layer = max(sum(math.prod(s) for n, s in shapes.items() if n.startswith(f"L{i}.")) for i in range(spec.num_layers))
    rows = min(prefill_chunk, SUB_CHUNK) * (m.top_k if m else 1)
    wide = max(m.intermediate if m else 0, spec.dense_intermediate)
    acts = rows * (2 * wide + H) * 4 * 2 + prefill_chunk * H * 4 + context * a.num_heads * a.head_dim * 2 * 2
    return {"weights": weights, "kv_cache": kv, "prefill": layer * 2 + acts, "margin": 1 << 30}


def _check_gpu_memory(spec: Any, args: argparse.Namespace) -> None:
    """One line, before anything is allocated, when the model and its cache cannot fit on the GPU."""
    import torch

    paged = args.kv_layout == "paged"
    kv_pages = args.kv_pages or args.max_batch * -(-args.context // args.page_size)
    need = serve_memory(spec, args.max_batch, args.context, args.page_size if paged else 0, kv_pages,
                        args.prefill_chunk, getattr(args, "weights", "bf16"))
    problem = memory_problem(spec.name, need, torch.cuda.mem_get_info()[0], torch.cuda.get_device_name(),
                             args.max_batch, args.context)
    if problem:
        raise ValueError(problem)


def kv_position_bytes(spec: Any) -> int:
    """Bytes of one position's KV cache: K and V of every layer, bf16."""
    a = spec.attention
    return 2 * spec.num_layers * a.num_kv_heads * a.head_dim * 2


def prefix_copy_pages(spec: Any, args: argparse.Namespace) -> int:
    """How many prefix-cache pages the slab layout may keep as KV copies on the GPU: what is free
    once the backend is built, less the prefill's working memory and the margin (serve_memory),
    with a tenth kept back for the allocator's rounding; logged."""
    import torch

    need = serve_memory(spec, args.max_batch, args.context, 0, 0, args.prefill_chunk,
                        getattr(args, "weights", "bf16"))
    page = args.page_size * kv_position_bytes(spec)
    free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    pages = max(0, int((free - need["prefill"] - need["margin"]) * 0.9) // page)
    log.info("prefix cache: at most %d pages of KV copies (%.1f GB)", pages, pages * page / 1e9)
    return pages


def memory_problem(model: str, need: dict, free: int, gpu: str, max_batch: int, context: int) -> str | None:
    """The one-line error when ``need`` (serve_memory's parts) exceeds ``free`` bytes, else None."""
    total = sum(need.values())
    if total <= free:
        return None
    parts = ", ".join(f"{k.replace('_', ' ')} {v / 1e9:.1f}" for k, v in need.items())
    return (f"{model} needs {total / 1e9:.1f} GB on the GPU ({parts} GB) at --max-batch {max_batch} and "
            f"--context {context}; {free / 1e9:.1f} GB are free on {gpu}: lower --context or --max-batch, or "
            f"serve a smaller model")


def _require_cuda() -> None:
    """Raise ValueError, saying what is missing, unless the CUDA backend can run here."""
    if _has_cuda_backend():
        return
    try:
        import cuda.bindings  # noqa: F401
    except ImportError:
        raise ValueError("--backend cuda: the CUDA driver bindings are not installed (pip install 'mkc[cuda]'); "
                         "or use --backend cpu") from None
    raise ValueError("--backend cuda: no usable CUDA GPU or driver on this machine; use --backend cpu")


def make_backend(name: str, spec: Any, weights: dict[str, Any], *, max_batch: int, context: int, dtype: Any,
                 num_sms: int | None = None, page_size: int = 0, kv_pages: int = 0,
                 batches: list[int] | None = None, weights_format: str = "bf16") -> Any:
    """The decode backend by name; unknown names raise with the list of valid ones. With a
    ``page_size`` its KV cache is a pool of ``kv_pages`` pages; ``batches``: the step decoders'
    batch sizes besides ``max_batch`` (runtime/backends.py: step_batches)."""
    from mkc.runtime.backends import CpuBackend, CudaBackend, step_batches

    step_batches(max_batch, batches)  # bad sizes fail here, before any work
    if name == "cpu":
        return CpuBackend(spec, weights, max_batch=max_batch, context=context, num_sms=num_sms or 8, dtype=dtype,
                          page_size=page_size, kv_pages=kv_pages, batches=batches,
                          weights_format=weights_format)
    if name == "cuda":
        _require_cuda()
        return CudaBackend(spec, weights, max_batch=max_batch, context=context, num_sms=num_sms,
                           page_size=page_size, kv_pages=kv_pages, batches=batches,
                           weights_format=weights_format)
    raise ValueError(f"--backend {name!r}: expected one of ['auto', 'cuda', 'cpu']")


SHUTDOWN_GRACE_S = 5  # on SIGTERM or Ctrl-C: how long the requests in flight may go on
_DRAIN_S = SHUTDOWN_GRACE_S - 1  # then the engine ends what is left, a second before uvicorn cuts it


def serve_main(args: argparse.Namespace) -> int:
    """Run ``mkc serve`` until interrupted; returns the process exit status."""
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        state = build_state(args)
    except (ValueError, OSError, KeyError) as e:  # SpecError and CheckpointError are ValueErrors
        print(f"mkc: error: {e}", file=sys.stderr)
        return 2
    config = uvicorn.Config(build_app(state), host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    _graceful_server(config, state.engine).run()
    return 0


def _graceful_server(config, engine: Engine):
    """uvicorn's server, whose shutdown lets the requests in flight finish for ``_DRAIN_S`` and then
    stops the engine, so that those still running end with an error event ("server shutting
    down") rather than a cut connection when uvicorn's grace runs out."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:  # the first signal; a second one still exits at once
                drain = threading.Timer(_DRAIN_S, engine.stop)
                drain.daemon = True  # a server that empties sooner exits without waiting for it
                drain.start()
            super().handle_exit(sig, frame)

    return Server(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mkc serve", description="OpenAI-compatible server")
    add_serve_arguments(parser)
    return serve_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
