"""`flashllm serve`: an OpenAI-compatible HTTP server over one loaded model.

Starlette routes. The model is loaded once; requests decode together in one running batch (see
scheduler), behind a bounded queue. A request is checked on the event loop only as far as that is
cheap (fields, sizes); tokenizing runs in a worker thread, after a place in the batch or queue is
reserved, so a full server answers 503 at once and a large prompt never pauses the event loop.
Every error a client can cause is an OpenAI-style JSON error; anything else is logged here and
answered with a JSON 500.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

from flashllm.errors import FlashLLMError
from flashllm.serve.guard import Guard
from flashllm.serve.openai_api import APIError, Params, bad_text_field, parse_request
from flashllm.serve.scheduler import Job, Scheduler

MAX_BODY_BYTES = 4 << 20
READ_TIMEOUT = 30.0  # seconds a client may take to send a request's headers, and then its body


class Server:
    """The state behind the routes: the model, its name, its chat template, the scheduler and the limits."""

    def __init__(self, model, name: str | None = None, max_queue: int = 64, api_key: str | None = None,
                 chat_template: str | None = None, max_body_bytes: int = MAX_BODY_BYTES, max_batch: int = 1,
                 allow_origins: tuple[str, ...] = (), read_timeout: float = READ_TIMEOUT, prefill_chunk: int = 128):
        if api_key is not None and not api_key.strip():
            raise FlashLLMError("the API key is empty (--api-key or $FLASHLLM_API_KEY): set a key, or unset "
                                "FLASHLLM_API_KEY to serve without one")
        if max_batch > len(model.backend.kvs):
            raise FlashLLMError(f"max_batch {max_batch}: the model was loaded with KV caches for "
                                f"{len(model.backend.kvs)} sequences (load it with batch_size={max_batch})")
        self.model, self.api_key, self.max_body_bytes = model, api_key, max_body_bytes
        self.allow_origins, self.read_timeout = tuple(allow_origins), read_timeout
        self.name = name or Path(model.manifest.root).name
        self.created = int(time.time())
        tok = model.tokenizer  # loaded now, not in the first request
        # no prompt of more characters than the context times the longest token's can fit: one of 4x that is
        # refused before tokenizing it (the slack keeps the exact message, in tokens, for prompts nearer the limit)
        self.max_prompt_chars = 4 * model.context * max(map(len, tok.tok.get_vocab()), default=1)
        try:
            model.chat_template = chat_template
            self.template, self.no_template = model.chat_template, None
        except FlashLLMError as exc:  # the model has none: completions still work, chat requests get this
            if chat_template is not None:
                raise
            self.template, self.no_template = None, str(exc)
        self.scheduler = Scheduler(model, max_batch, max_queue, prefill_chunk)

    # -- one request, start to end ---------------------------------------------------------------
    def prepare(self, kind: str, body: dict) -> Params:
        """A request body checked and tokenized (raises APIError): `check`, then `tokenize`."""
        req = self.check(kind, body)
        self.tokenize(kind, req)
        return req

    def check(self, kind: str, body: dict) -> Params:
        """Validate a request body as far as that is cheap (raises APIError); `tokenize` does the rest."""
        req = parse_request(kind, body, self.name)
        if kind == "chat" and self.template is None:
            raise APIError(400, self.no_template, param="messages", code="no_chat_template")
        chars = len(req.prompt or "") + sum(len(m["content"]) for m in req.messages or ())
        if chars > self.max_prompt_chars:
            raise APIError(400, f"the prompt has {chars} characters, far more than the context of "
                           f"{self.model.context} tokens can hold with this tokenizer (at most "
                           f"{self.max_prompt_chars} are accepted); shorten it",
                           param="messages" if kind == "chat" else "prompt", code="context_length_exceeded")
        if req.prompt_ids is not None:
            self.check_ids(kind, req)
        return req

    def tokenize(self, kind: str, req: Params) -> None:
        """In a worker thread: the prompt's token ids (a chat's rendered by its template), checked."""
        if kind == "chat":
            try:
                req.prompt_ids = self.model.chat_ids(req.messages)
            except FlashLLMError as exc:
                raise APIError(400, str(exc), param="messages") from None
            req.stop = req.stop + list(self.template.stop)
        elif req.prompt_ids is None:
            req.prompt_ids = self.model.tokenizer.encode(req.prompt)
        self.check_ids(kind, req)

    def check_ids(self, kind: str, req: Params) -> None:
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

    def busy(self) -> APIError:
        c, wait = self.scheduler.counts(), self.scheduler.retry_after()
        return APIError(503, f"the server is busy: {c['running']} requests decoding (at most {c['max_batch']} "
                        f"together) and {c['queued']} queued (the most it holds); retry in about {wait} s",
                        kind="server_error", code="overloaded", headers={"Retry-After": str(wait)})

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
                "chat_template": self.template.origin if self.template else None, "queue": self.scheduler.counts()}


def create_app(server: Server):
    """The Starlette application for `server` (routes, JSON errors, the origin, API-key and content checks)."""
    anyio = require()
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    tokenizing = anyio.CapacityLimiter(1)  # CPU work off the event loop, one request at a time

    class SSEResponse(StreamingResponse):
        """Server-sent events that cancel their job however the response ends (a client gone included)."""

        def __init__(self, job: Job, content, **kw):
            super().__init__(content, **kw)
            self.job = job

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            except OSError:  # the client went away mid-stream: nothing to answer, nothing to log
                pass
            finally:
                self.job.cancel()

    async def read_json(request) -> dict:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > server.max_body_bytes:
            raise APIError(413, f"the request body has {declared} bytes; the most accepted is {server.max_body_bytes}")
        body = bytearray()
        try:
            with anyio.fail_after(server.read_timeout):
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > server.max_body_bytes:
                        raise APIError(413, f"the request body exceeds {server.max_body_bytes} bytes")
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {server.read_timeout:g} s",
                           code="request_timeout") from None
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise APIError(400, f"the request body is not valid JSON ({str(exc)[:200]})") from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        if (where := bad_text_field(data)) is not None:
            raise APIError(400, f"{where}: not valid Unicode text (a lone surrogate such as \\ud83d)", param=where)
        return data

    async def generate(request, kind: str):
        req = server.check(kind, await read_json(request))
        if not server.scheduler.reserve():
            raise server.busy()
        try:
            await anyio.to_thread.run_sync(server.tokenize, kind, req, limiter=tokenizing)
            job = server.scheduler.submit(req)
        except BaseException:
            server.scheduler.unreserve()
            raise
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
        if done is None:  # the client left and its job was cancelled: nobody to answer
            return Response(status_code=499)
        return JSONResponse(server.complete(kind, "".join(text), done))

    async def sse_events(job: Job, req: Params, kind: str):
        head = server.head(kind)
        obj = head["object"] + (".chunk" if kind == "chat" else "")
        usage = {"usage": None} if req.include_usage else {}  # OpenAI: null on every chunk but the last

        def chunk(choices, **extra) -> str:
            return "data: " + json.dumps({**head, "object": obj, "choices": choices, **usage, **extra}) + "\n\n"

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

    async def client_gone(request, exc: ClientDisconnect):
        return Response(status_code=499)  # the client left while sending its request: nobody to answer

    async def internal_error(request, exc: Exception):
        return JSONResponse(APIError.internal(exc).body(), status_code=500)

    app = Starlette(routes=[
        Route("/health", health), Route("/v1/models", models), Route("/v1/models/{name:path}", model),
        Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/completions", completions, methods=["POST"]),
    ], exception_handlers={APIError: api_error, HTTPException: http_error, ClientDisconnect: client_gone,
                           Exception: internal_error})
    return Guard(app, server.api_key, server.allow_origins)


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
