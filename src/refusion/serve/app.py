"""The OpenAI-compatible HTTP API (Starlette): completions, chat completions, models, health, metrics.

``POST /v1/completions`` and ``POST /v1/chat/completions`` tokenise the prompt (chat: the tokenizer's chat
template; a 400 when it has none), build the request's decoder (:class:`~refusion.serve.options.DecoderPool`)
and queue a :class:`~refusion.serve.engine.Job` (:meth:`ServeState.new_job`; with the engine in a process of
its own, :mod:`refusion.serve.engine_process`'s state checks the options here and sends the job there). A streamed request (``stream: true``) answers with
server-sent events: one chunk per piece of text that became final (:class:`~refusion.serve.text.FinalText`),
then a chunk with the ``finish_reason``, then ``data: [DONE]``; a request without ``stream`` answers once.
Both carry the extension ``refusion: {"token_ids": [...]}`` (a stream: the tokens committed since the last
chunk). A client that disconnects cancels its job; so does a stop string found in the text.

Every error is OpenAI's error object with a message naming the field; ``/v1/*`` and ``/metrics`` need
``Authorization: Bearer KEY`` when the server has an API key (``/health`` never does).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import json
import os
import secrets
import socket
import time
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from refusion.serve.engine import STREAM_INTERVAL, Engine, Job, LoopSink
from refusion.serve.options import EXTENSION, DecoderPool
from refusion.serve.protocol import (
    MAX_BODY_BYTES, REQUEST_TIMEOUT_S, ChatRequest, CompletionRequest, RequestError, parse,
)
from refusion.serve.text import FinalText


#: the response header naming the server that answered (``ServeState.server_id``)
SERVER_HEADER = "X-Refusion-Server"
#: how often a waiting handler checks whether its client is still there (seconds)
DISCONNECT_POLL_S = 0.2


class ServeState:
    """What the routes share: the engine, the decoder pool, the tokenizer and the server's settings."""

    def __init__(self, engine: Engine, pool: DecoderPool, model_name: str, model_path: str | None = None,
                 api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
                 request_timeout_s: float = REQUEST_TIMEOUT_S, shutdown_grace_s: float = 30.0,
                 stream_interval: int = STREAM_INTERVAL, server_id: str | None = None) -> None:
        self.engine, self.pool, self.model_name, self.model_path = engine, pool, model_name, model_path
        self.api_key, self.max_body_bytes, self.request_timeout_s = api_key, max_body_bytes, request_timeout_s
        self.shutdown_grace_s = shutdown_grace_s
        if stream_interval < 1:
            raise ValueError(f"--stream-interval: must be at least 1, got {stream_interval}")
        self.stream_interval = stream_interval
        #: names this server in every response (:data:`SERVER_HEADER`) and in ``/health``: a replica's id
        self.server_id = server_id or f"{socket.gethostname()}:{os.getpid()}"
        self.tokenizer = pool.backbone.tokenizer
        self.eos_ids = pool.backbone.eos_ids
        self.vocab = len(self.tokenizer)
        self.created = int(time.time())

    def new_job(self, prompt_ids: list[int], req, sink: LoopSink, deadline: float) -> Job:
        """The engine's job of a request (its decoder built from its options); raises a 400
        :class:`RequestError` naming a bad field."""
        decoder = self.pool.decoder(req.refusion, req.temperature, req.max_tokens, len(prompt_ids))
        return Job(prompt_ids, decoder, req.seed, deadline, sink, self.stream_interval)

    def render_metrics(self) -> str:
        """``GET /metrics``'s text."""
        return self.engine.metrics.render()


class Inbox:
    """A request's events from the engine thread, read by its handler on the event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.events: collections.deque[tuple] = collections.deque()
        self._waiter: asyncio.Future | None = None  # the handler's wait, while it waits

    def sink(self) -> LoopSink:
        """The job's sink: the engine hands its events to the event loop (batched per model call)."""
        return LoopSink(self.loop, self._put)

    def _put(self, event: tuple) -> None:
        self.events.append(event)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(True)

    def take(self) -> tuple | None:
        """The next event, the commits right behind it joined to it; None when there is none."""
        if not self.events:
            return None
        event = self.events.popleft()
        if event[0] == "commit" and self.events and self.events[0][0] == "commit":
            tokens = list(event[1])
            while self.events and self.events[0][0] == "commit":
                tokens += self.events.popleft()[1]
            event = ("commit", tokens)
        return event

    async def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for an event; -> whether one came. A future and a timer, no task (the
        handler waits once per chunk)."""
        if self.events:
            return True
        self._waiter = waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout_s, _expire, waiter)
        try:
            return await waiter
        finally:
            timer.cancel()
            self._waiter = None


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(False)


def error_response(err: RequestError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def build_app(state: ServeState) -> Starlette:
    """The Starlette app over ``state``; its lifespan starts the engine and stops it (finishing what runs
    for up to ``state.shutdown_grace_s`` seconds, then rejecting the rest)."""
    metrics = state.engine.metrics

    def counted(endpoint: str, response: Response) -> Response:
        metrics.inc("refusion_requests_total", endpoint=endpoint, status=str(response.status_code))
        return response

    def authorize(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), state.api_key.encode()):
            raise RequestError(401, "Authorization", "Authorization: missing or wrong API key (send the header "
                               "'Authorization: Bearer KEY')" if header else "Authorization: this server needs an "
                               "API key (send the header 'Authorization: Bearer KEY')", "authentication_error")

    async def read_json(request: Request) -> Any:
        limit = state.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise RequestError(413, "body", f"body: {declared} bytes exceeds the limit of {limit} bytes "
                               "(--max-body-bytes)")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise RequestError(413, "body", f"body: more than the limit of {limit} bytes (--max-body-bytes)")
        try:
            return json.loads(bytes(body))
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(400, "body", f"body: invalid JSON: {e}") from None

    def check_model(name: str) -> None:
        if name != state.model_name:
            raise RequestError(404, "model", f"model: {name!r} is not served here; this server serves "
                               f"{state.model_name!r} (GET /v1/models)", "not_found_error")

    def token_ids(prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = state.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < state.vocab]
            if bad:
                raise RequestError(400, "prompt", f"prompt: token id {bad[0]} is outside the vocabulary "
                                   f"(0 .. {state.vocab - 1})")
        if not ids:
            raise RequestError(400, "prompt", "prompt: empty; give at least one token")
        return ids

    def chat_ids(req: ChatRequest) -> list[int]:
        if not getattr(state.tokenizer, "chat_template", None):
            raise RequestError(400, "messages", f"messages: model {state.model_name!r} has no chat template; "
                               "use /v1/completions with a prompt")
        messages = [{"role": m.role, "content": m.text} for m in req.messages]
        ids = list(state.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))
        if not ids:
            raise RequestError(400, "messages", "messages: the chat template renders them to no tokens")
        return ids

    async def decode(request: Request, req, prompt_ids: list[int], chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        events = Inbox()
        arrived = time.perf_counter()
        job = state.new_job(prompt_ids, req, events.sink(), arrived + state.request_timeout_s)
        state.engine.submit(job)
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        text = FinalText(state.tokenizer, req.stop_strings)
        usage_base = {"prompt_tokens": len(prompt_ids)}

        checked = [arrived]

        async def next_event() -> tuple:
            """The job's next event, with the commits already waiting behind it joined to it (one chunk for
            what is final now); ("gone",) when the client has disconnected (checked every 0.2 s while a whole
            answer is awaited; a stream's disconnect ends its response, whose ``finally`` cancels the job:
            Starlette's ``StreamingResponse`` listens for it, or its next write fails)."""
            while True:
                now = time.perf_counter()
                if not req.stream and now - checked[0] >= DISCONNECT_POLL_S:
                    checked[0] = now
                    if await request.is_disconnected():
                        job.cancel("disconnect")
                        return ("gone",)
                event = events.take()
                if event is not None:
                    return event
                # the engine ends every job with an event; the backstop is the deadline
                if not await events.wait(DISCONNECT_POLL_S) and time.perf_counter() > job.deadline + 30:
                    return ("error", 504, "the request timed out (--request-timeout)")

        def finish_reason(ids: list[int]) -> str:
            return "stop" if text.stopped or (ids and ids[-1] in state.eos_ids) else "length"

        def usage(n: int) -> dict[str, int]:
            return {**usage_base, "completion_tokens": n, "total_tokens": usage_base["prompt_tokens"] + n}

        def observe_tokens(first: list[float], last: list[float]) -> None:
            now = time.perf_counter()
            if not first:
                first.append(now)
                metrics.observe("refusion_time_to_first_token_seconds", now - arrived)
            else:
                metrics.observe("refusion_inter_token_seconds", now - last[0])
            last[:] = [now]

        if not req.stream:
            ids: list[int] = []
            first: list[float] = []
            last: list[float] = []
            while True:
                event = await next_event()
                if event[0] == "commit":
                    observe_tokens(first, last)
                    ids += event[1]
                    text.add(event[1])
                    if text.stopped:
                        job.cancel("stop")
                        break
                elif event[0] == "end":
                    text.finish()
                    break
                elif event[0] == "gone":
                    return counted(endpoint, Response(status_code=499))
                else:
                    raise RequestError(event[1], None, event[2], "server_error")
            metrics.observe("refusion_request_seconds", time.perf_counter() - arrived)
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason(ids)}
            if chat:
                choice["message"] = {"role": "assistant", "content": text.sent}
            else:
                choice.update(text=text.sent, logprobs=None)
            body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                    "model": state.model_name, "choices": [choice], "usage": usage(len(ids)),
                    EXTENSION: {"token_ids": ids, "decoder": state.pool.name}}
            return counted(endpoint, JSONResponse(body))

        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        # a chunk's JSON around its choice and tokens, encoded once: chunk() writes what json.dumps of the whole
        # body writes, key for key
        head = json.dumps({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                           "created": created, "model": state.model_name})[:-1]
        head = f'data: {head}, "choices": ['
        middle = f'], {json.dumps(EXTENSION)}: {{"token_ids": '
        tail = '}, "usage": null}\n\n' if include_usage else "}}\n\n"

        def chunk(delta: str | None, ids: list[int], reason: str | None = None, role: bool = False) -> str:
            if chat:
                d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
                choice = {"index": 0, "delta": d, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}
            return f"{head}{json.dumps(choice)}{middle}{json.dumps(ids)}{tail}"

        async def sse():
            done = False
            ids: list[int] = []
            pending: list[int] = []
            first: list[float] = []
            last: list[float] = []
            try:
                if chat:
                    yield chunk(None, [], role=True)
                while True:
                    event = await next_event()
                    if event[0] == "commit":
                        observe_tokens(first, last)
                        ids += event[1]
                        pending += event[1]
                        delta = text.add(event[1])
                        if delta:
                            yield chunk(delta, pending)
                            pending = []
                        if text.stopped:
                            job.cancel("stop")
                            break
                    elif event[0] == "end":
                        delta = text.finish()
                        if delta:
                            yield chunk(delta, pending)
                            pending = []
                        break
                    elif event[0] == "gone":
                        return
                    else:
                        err = RequestError(event[1], None, event[2], "server_error")
                        done = True
                        yield f"data: {json.dumps(err.body())}\n\n"
                        counted(endpoint, Response(status_code=event[1]))
                        return
                yield chunk(None, pending, finish_reason(ids))
                if include_usage:
                    tail = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": created, "model": state.model_name, "choices": [], "usage": usage(len(ids))}
                    yield f"data: {json.dumps(tail)}\n\n"
                yield "data: [DONE]\n\n"
                done = True
                metrics.observe("refusion_request_seconds", time.perf_counter() - arrived)
                counted(endpoint, Response(status_code=200))
            finally:
                if not done:  # the client went away mid-stream
                    job.cancel("disconnect")
                    counted(endpoint, Response(status_code=499))

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def completions(request: Request) -> Response:
        try:
            authorize(request)
            req: CompletionRequest = parse(CompletionRequest, await read_json(request))
            check_model(req.model)
            return await decode(request, req, token_ids(req.prompt), chat=False)
        except RequestError as e:
            return counted("completions", error_response(e))

    async def chat_completions(request: Request) -> Response:
        try:
            authorize(request)
            req: ChatRequest = parse(ChatRequest, await read_json(request))
            check_model(req.model)
            return await decode(request, req, chat_ids(req), chat=True)
        except RequestError as e:
            return counted("chat", error_response(e))

    async def models(request: Request) -> Response:
        try:
            authorize(request)
        except RequestError as e:
            return counted("models", error_response(e))
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "refusion",
                EXTENSION: {"decoder": state.pool.config, "model_path": state.model_path,
                            "max_positions": state.pool.backbone.max_positions}}
        return counted("models", JSONResponse({"object": "list", "data": [card]}))

    async def health(request: Request) -> Response:
        running, queued = state.engine.counts()
        ok = state.engine.accepting
        return JSONResponse({"status": "ok" if ok else "shutting down", "running": running, "queued": queued,
                             "pid": os.getpid(), "server": state.server_id},
                            status_code=200 if ok else 503)

    async def metrics_page(request: Request) -> Response:
        try:
            authorize(request)
        except RequestError as e:
            return counted("metrics", error_response(e))
        return PlainTextResponse(state.render_metrics(), media_type="text/plain; version=0.0.4")

    async def http_error(request: Request, exc: HTTPException) -> Response:
        what = {404: f"path: {request.url.path} does not exist; endpoints: /v1/completions, /v1/chat/completions, "
                     "/v1/models, /health, /metrics",
                405: f"method: {request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        return error_response(RequestError(exc.status_code, "path" if exc.status_code == 404 else "method", what))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.engine.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, state.engine.stop, 0.0)

    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics_page, methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan)
    return with_server_header(app, state.server_id)


def with_server_header(app, server_id: str):
    """``app`` (ASGI) answering every HTTP response with the header ``X-Refusion-Server: server_id``, which
    names the server (the replica, behind a proxy) that answered."""
    header = (SERVER_HEADER.lower().encode(), server_id.encode())

    async def wrapped(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        return await app(scope, receive, send_with_header)

    return wrapped
