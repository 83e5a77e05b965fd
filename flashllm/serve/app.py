"""`flashllm serve`: an OpenAI-compatible HTTP server over one loaded model.

Starlette routes on uvicorn. The model is loaded once; generation runs in one worker thread, one
request at a time, behind a bounded queue (see decode_queue). Every error a client can cause is an
OpenAI-style JSON error; anything else is logged here and answered with a JSON 500.
"""

from __future__ import annotations

import hmac
import json
import socket
import time
import uuid
from pathlib import Path

from flashllm.serve.decode_queue import DecodeQueue, Job
from flashllm.errors import FlashLLMError
from flashllm.serve.openai_api import APIError, Params, parse_request

MAX_BODY_BYTES = 4 << 20
FINISH_REASON = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


class Server:
    """The state behind the routes: the model, its name, its chat template and the decode queue."""

    def __init__(self, model, name: str | None = None, max_queue: int = 8, api_key: str | None = None,
                 chat_template: str | None = None, max_body_bytes: int = MAX_BODY_BYTES):
        self.model, self.api_key, self.max_body_bytes = model, api_key, max_body_bytes
        self.name = name or Path(model.manifest.root).name
        self.created = int(time.time())
        model.tokenizer  # noqa: B018  (load it now, not in the first request)
        try:
            model.chat_template = chat_template
            self.template, self.no_template = model.chat_template, None
        except FlashLLMError as exc:  # the model has none: completions still work, chat requests get this
            if chat_template is not None:
                raise
            self.template, self.no_template = None, str(exc)
        self.queue = DecodeQueue(max_queue)

    # -- one request, start to end ---------------------------------------------------------------
    def prepare(self, kind: str, body: dict) -> Params:
        """Validate a request body and tokenize its prompt (raises APIError)."""
        req = parse_request(kind, body, self.name)
        if kind == "chat":
            if self.template is None:
                raise APIError(400, self.no_template, param="messages", code="no_chat_template")
            try:
                req.prompt_ids = self.model.chat_ids(req.messages)
            except FlashLLMError as exc:
                raise APIError(400, str(exc), param="messages") from None
            req.stop = req.stop + list(self.template.stop)
        elif req.prompt_ids is None:
            req.prompt_ids = self.model.tokenizer.encode(req.prompt)
        context, n = self.model.context, len(req.prompt_ids)
        if not n:
            raise APIError(400, "the prompt is empty", param="prompt")
        if n >= context:
            limit = self.model.spec.context_limit
            fix = "shorten it (the model has no more positions)" if context >= limit else \
                f"shorten it or restart the server with a larger --context (the model has {limit} positions)"
            raise APIError(400, f"the prompt has {n} tokens but the context holds {context} (with room for at least "
                           f"one new token); {fix}",
                           param="messages" if kind == "chat" else "prompt", code="context_length_exceeded")
        if any(not 0 <= t < self.model.spec.vocab_size for t in req.prompt_ids):
            raise APIError(400, f"prompt token ids must lie in [0, {self.model.spec.vocab_size})", param="prompt")
        return req

    def decode(self, req: Params, job: Job) -> None:
        """In the worker thread: generate, emitting text pieces, then a summary (or a clear error)."""
        model = self.model
        budget = context_left = model.context - len(req.prompt_ids)
        if req.max_tokens is not None:
            budget = min(req.max_tokens, context_left)
        try:
            tokens = model.stream_tokens(req.prompt_ids, budget, req.temperature, req.top_p, req.seed, req.stop)
            for _token, piece in tokens:
                if job.cancelled.is_set():
                    tokens.close()
                    return
                if piece:
                    job.emit("text", piece)
        except FlashLLMError as exc:
            job.emit("error", APIError(400, str(exc)))
            return
        run = model.last_generation
        capped = req.max_tokens is None or req.max_tokens > context_left  # the context, not the client, set `budget`
        reason = "context" if run.stop_reason == "length" and capped else run.stop_reason
        job.emit("done", {"finish_reason": FINISH_REASON.get(reason, "stop"),
                          "usage": {"prompt_tokens": len(req.prompt_ids), "completion_tokens": len(run.token_ids),
                                    "total_tokens": len(req.prompt_ids) + len(run.token_ids)},
                          "flashllm": {"stop_reason": reason, "stats": model.stats}})

    def submit(self, req: Params) -> Job:
        job = self.queue.submit(lambda job: self.decode(req, job))
        if job is None:
            c = self.queue.counts()
            raise APIError(503, f"the server is busy: {c['running']} request decoding and {c['queued']} queued "
                           f"(the most it holds; one decode at a time); retry shortly",
                           kind="server_error", code="overloaded", headers={"Retry-After": "1"})
        return job

    # -- response shapes ---------------------------------------------------------------------------
    def head(self, kind: str) -> dict:
        prefix, obj = ("chatcmpl", "chat.completion") if kind == "chat" else ("cmpl", "text_completion")
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()), "model": self.name}

    @staticmethod
    def choice(kind: str, text: str | None, finish_reason, stream: bool) -> dict:
        if kind == "chat":
            key = "delta" if stream else "message"
            body = {} if text is None else {"content": text} if stream else {"role": "assistant", "content": text}
            return {"index": 0, key: body, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}

    def complete(self, kind: str, text: str, done: dict) -> dict:
        return {**self.head(kind), "choices": [self.choice(kind, text, done["finish_reason"], False)],
                "usage": done["usage"], "flashllm": done["flashllm"]}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.name, "object": "model", "created": self.created,
                                            "owned_by": "flashllm"}]}

    def health(self) -> dict:
        return {"status": "ok", "model": self.name, "mode": self.model.mode, "context": self.model.context,
                "chat_template": self.template.origin if self.template else None, "queue": self.queue.counts()}

    def authorized(self, headers) -> bool:
        if self.api_key is None:
            return True
        given = headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode())


def create_app(server: Server):
    """The Starlette application for `server` (routes, JSON errors, the API-key check)."""
    anyio = require()
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    class SSEResponse(StreamingResponse):
        """Server-sent events that cancel their job however the response ends (a client gone included)."""

        def __init__(self, job: Job, content, **kw):
            super().__init__(content, **kw)
            self.job = job

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.job.cancel()

    async def read_json(request) -> dict:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > server.max_body_bytes:
            raise APIError(413, f"the request body has {declared} bytes; the most accepted is {server.max_body_bytes}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > server.max_body_bytes:
                raise APIError(413, f"the request body exceeds {server.max_body_bytes} bytes")
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, ValueError) as exc:
            raise APIError(400, f"the request body is not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        return data

    async def generate(request, kind: str):
        req = server.prepare(kind, await read_json(request))
        job = server.submit(req)
        if req.stream:
            return SSEResponse(job, sse_events(job, req, kind), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})
        text, done, error = [], None, None
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(cancel_on_disconnect, request, job)
            try:
                async for kind_, value in events(job):
                    if kind_ == "text":
                        text.append(value)
                    elif kind_ == "done":
                        done = value
            except APIError as exc:  # raised after the task group, which would wrap it in an ExceptionGroup
                error = exc
            finally:
                tasks.cancel_scope.cancel()
        if error is not None:
            raise error
        return JSONResponse(server.complete(kind, "".join(text), done))

    async def sse_events(job: Job, req: Params, kind: str):
        head = server.head(kind)
        obj = head["object"] + (".chunk" if kind == "chat" else "")

        def chunk(choices, **extra) -> str:
            return "data: " + json.dumps({**head, "object": obj, "choices": choices, **extra}) + "\n\n"

        if kind == "chat":
            yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        try:
            async for kind_, value in events(job):
                if kind_ == "text":
                    yield chunk([server.choice(kind, value, None, True)])
                elif kind_ == "done":
                    yield chunk([server.choice(kind, None, value["finish_reason"], True)], flashllm=value["flashllm"])
                    if req.include_usage:
                        yield chunk([], usage=value["usage"])
        except APIError as exc:  # headers are sent: the error goes in the stream, as OpenAI does
            yield "data: " + json.dumps(exc.body()) + "\n\n"
        yield "data: [DONE]\n\n"

    async def chat(request):
        return await generate(request, "chat")

    async def completions(request):
        return await generate(request, "completion")

    async def models(request):
        return JSONResponse(server.models())

    async def model(request):
        if request.path_params["name"] != server.name:
            raise APIError(404, f"model {request.path_params['name']!r} is not served here; this server has "
                           f"{server.name!r}", code="model_not_found")
        return JSONResponse(server.models()["data"][0])

    async def health(request):
        return JSONResponse(server.health())

    async def api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def http_error(request, exc: HTTPException):
        return JSONResponse(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}").body(),
                            status_code=exc.status_code, headers=exc.headers)

    async def internal_error(request, exc: Exception):
        return JSONResponse(APIError.internal(exc).body(), status_code=500)

    app = Starlette(routes=[
        Route("/health", health), Route("/v1/models", models), Route("/v1/models/{name:path}", model),
        Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/completions", completions, methods=["POST"]),
    ], exception_handlers={APIError: api_error, HTTPException: http_error, Exception: internal_error})
    return APIKeyCheck(app, server)


async def events(job: Job):
    """The events of `job` until it ends; an error event is raised (as an APIError)."""
    try:
        while (event := await job.events.get())[0] != "end":
            if event[0] == "error":
                exc = event[1]
                raise exc if isinstance(exc, APIError) else APIError.internal(exc)
            yield event
    finally:
        job.cancel()  # a no-op after the end; otherwise (client gone, error) the slot is freed now


async def cancel_on_disconnect(request, job: Job) -> None:
    """Cancel `job` when the client goes away while a non-streaming request waits for its answer."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel()


class APIKeyCheck:
    """ASGI middleware: with an API key set, every request must carry `Authorization: Bearer KEY`."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            from starlette.datastructures import Headers
            from starlette.responses import JSONResponse

            if not self.server.authorized(Headers(scope=scope)):
                error = APIError(401, "missing or wrong API key (send the header Authorization: Bearer KEY)",
                                 code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await JSONResponse(error.body(), status_code=401, headers=error.headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def require():
    """anyio (after checking that starlette and uvicorn are installed), or a clear error saying how
    to install the server's dependencies."""
    try:
        import anyio
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise FlashLLMError(f"flashllm serve needs the 'serve' extra ({exc.name} is missing): in the flashllm "
                            f"checkout, pip install -e \".[serve]\" --config-settings editable_mode=strict") from None
    return anyio


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port, opened before the model loads: a port in use or a bad address is
    a one-line error at once, not uvicorn's log after the load."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except (OSError, OverflowError) as exc:
        raise FlashLLMError(f"cannot listen on {host}:{port}: {getattr(exc, 'strerror', None) or exc}") from None


def run(server: Server, sock: socket.socket, log_level: str = "info") -> None:
    """Serve on the listening socket until interrupted (Ctrl-C stops uvicorn cleanly)."""
    import uvicorn

    config = uvicorn.Config(create_app(server), log_level=log_level, timeout_graceful_shutdown=2)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        server.queue.close()
