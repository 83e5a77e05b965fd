"""What a request must show before any route sees it: an allowed origin, the API key, a JSON body.

A browser sends `Origin` with every cross-site request, and a page may POST `text/plain` to any
address without asking first; so a request from a web page on another origin is refused (403)
unless `--allow-origin` names that origin, and a POST must declare `Content-Type: application/json`
(415), which no page can send cross-site without a preflight that this server answers only for the
allowed origins. With an API key set, every request must carry `Authorization: Bearer KEY`
(the scheme in any case, as RFC 9110 says).
"""

from __future__ import annotations

import hmac

from flashllm.serve.openai_api import APIError

CORS_HEADERS = {"access-control-allow-methods": "GET, POST, OPTIONS",
                "access-control-allow-headers": "Authorization, Content-Type", "access-control-max-age": "600",
                "vary": "Origin"}


class Guard:
    """ASGI middleware: origin, API key and content type, checked in that order."""

    def __init__(self, app, api_key: str | None, allow_origins: tuple[str, ...] = ()):
        self.app, self.api_key = app, api_key
        self.allow_origins = {o.rstrip("/").lower() for o in allow_origins}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from starlette.datastructures import Headers

        headers = Headers(scope=scope)
        origin = headers.get("origin")
        cross = origin is not None and origin.rstrip("/").lower() not in same_origins(headers.get("host", ""))
        if cross and not self.allowed(origin):
            return await refuse(APIError(403, f"requests from the web page origin {origin!r} are refused (a page on "
                                         f"another site must not drive this server); start the server with "
                                         f"--allow-origin {origin} to allow that origin", code="origin_not_allowed"),
                                scope, receive, send)
        extra = {"access-control-allow-origin": origin, **CORS_HEADERS} if cross else {}
        if cross and scope["method"] == "OPTIONS":  # the preflight of an allowed origin
            from starlette.responses import Response

            return await Response(status_code=204, headers=extra)(scope, receive, send)
        if not self.authorized(headers.get("authorization", "")):
            error = APIError(401, "missing or wrong API key (send the header Authorization: Bearer KEY)",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer", **extra})
            return await refuse(error, scope, receive, send)
        media = headers.get("content-type", "").split(";")[0].strip().lower()
        if scope["method"] == "POST" and media != "application/json":
            error = APIError(415, f"the request body must be JSON, sent with Content-Type: application/json (got "
                             f"{media or 'none'!r})"[:300], code="unsupported_media_type", headers=extra)
            return await refuse(error, scope, receive, send)
        if not extra:
            return await self.app(scope, receive, send)

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + \
                    [(k.encode(), v.encode("latin-1", "replace")) for k, v in extra.items()]
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def allowed(self, origin: str) -> bool:
        return "*" in self.allow_origins or origin.rstrip("/").lower() in self.allow_origins

    def authorized(self, header: str) -> bool:
        if self.api_key is None:
            return True
        scheme, _, token = header.strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())


def same_origins(host: str) -> set[str]:
    """The origins of pages served by this server itself (the Host the request was sent to)."""
    host = host.strip().lower()
    return {f"http://{host}", f"https://{host}"} if host else set()


async def refuse(error: APIError, scope, receive, send) -> None:
    from starlette.responses import JSONResponse

    await JSONResponse(error.body(), status_code=error.status, headers=error.headers)(scope, receive, send)
