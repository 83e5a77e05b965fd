"""The OpenAI request fields flashllm serves, checked one by one, and OpenAI-style errors.

A field of the wrong type or out of range is a 400 naming the field; a feature flashllm does not
implement (several choices, log-probabilities, tools, penalties) is a 400 saying so, rather than
being silently ignored, while its explicit "off" value (false, 0, [], "none", {"type": "text"}) is
accepted. Unknown fields are ignored, as OpenAI-compatible servers commonly do.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from flashllm.text.chat_template import check_messages
from flashllm.errors import FlashLLMError

MAX_STOP = 4  # OpenAI's limit on stop strings
MAX_STOP_CHARS = 256  # the longest stop string accepted (text is held back while it could still become one)
SEED_RANGE = 2 ** 64  # seeds are integers in [0, 2**64), as numpy's generators take them
# field -> the values that mean "off"; anything else asks for something not implemented
UNSUPPORTED = {"n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (False,), "top_logprobs": (0,),
               "suffix": ("",), "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},),
               "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
               "response_format": ({"type": "text"},)}


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}} with a status."""

    def __init__(self, status: int, message: str, kind: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.kind = kind or ("authentication_error" if status == 401 else "not_found_error" if status == 404
                             else "server_error" if status >= 500 else "invalid_request_error")

    @classmethod
    def internal(cls, exc: Exception) -> "APIError":
        """A bug on our side: the client learns only its kind; the traceback goes to the server log."""
        return cls(500, f"internal error ({type(exc).__name__}); see the server log")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Params:
    """One completion or chat request, checked."""

    max_tokens: int | None  # None: until an end token or the context is full
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    messages: list[dict] | None = None  # chat
    prompt: str | None = None  # completion, as text
    prompt_ids: list[int] | None = field(default=None)  # completion as token ids, or the encoded prompt


def parse_request(kind: str, body: dict, served: str) -> Params:
    """Check the fields of a /v1/chat/completions (`kind` "chat") or /v1/completions body."""
    name = _get(body, "model", str, None)
    if name is None:
        raise APIError(400, "model: required (GET /v1/models lists the one this server has)", param="model")
    if name != served:
        raise APIError(404, f"model {name!r} is not served here; this server has {served!r}", param="model",
                       code="model_not_found")
    for key, offs in UNSUPPORTED.items():
        value = body.get(key)
        if value is not None and not any(is_off(value, off) for off in offs):
            shown = " or ".join(json.dumps(off) for off in offs)
            raise APIError(400, f"{key}: not supported by flashllm (only null or {shown})", param=key)
    max_tokens = _get(body, "max_completion_tokens", int, None) if kind == "chat" else None
    max_tokens = _get(body, "max_tokens", int, max_tokens if kind == "chat" else 16)
    if max_tokens is not None and max_tokens < 0:
        raise APIError(400, f"max_tokens: {max_tokens} is negative", param="max_tokens")
    temperature = _get(body, "temperature", float, 1.0)
    if not 0 <= temperature <= 2:
        raise APIError(400, f"temperature: {temperature} is outside [0, 2]", param="temperature")
    top_p = _get(body, "top_p", float, 1.0)
    if not 0 < top_p <= 1:
        raise APIError(400, f"top_p: {top_p} is outside (0, 1]", param="top_p")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOP:
        raise APIError(400, f"stop: expected a string or a list of at most {MAX_STOP} strings", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise APIError(400, f"stop: a stop string has {max(map(len, stop))} characters; the most accepted is "
                       f"{MAX_STOP_CHARS}", param="stop")
    seed = _get(body, "seed", int, None)
    if seed is not None and not 0 <= seed < SEED_RANGE:
        raise APIError(400, f"seed: {seed} is outside [0, 2**64)", param="seed")
    options = _get(body, "stream_options", dict, {})
    params = Params(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                    stop=[s for s in stop if s], stream=_get(body, "stream", bool, False),
                    include_usage=_get(options, "include_usage", bool, False, "stream_options.include_usage"))
    if kind == "chat":
        try:
            params.messages = check_messages(body.get("messages"))
        except FlashLLMError as exc:
            raise APIError(400, str(exc), param="messages") from None
    else:
        _prompt(body.get("prompt"), params)
    return params


def is_off(value, off) -> bool:
    """`value` equals the "off" value `off` (and is no bool standing for a number, or a number for a bool)."""
    return value == off and isinstance(value, bool) == isinstance(off, bool)


def bad_text_field(body) -> str | None:
    """The path of the first string in a JSON value that is not valid Unicode text (a lone surrogate such as
    "\\ud83d", which JSON can spell but UTF-8 cannot), or None."""
    todo = [("", body)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                todo.append((f"{path}.{k}" if path else k, v))
                todo.append((path or "body", k))
        elif isinstance(value, list):
            todo.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
    return None


def _prompt(prompt, params: Params) -> None:
    """A completion prompt: text, token ids, or a list holding one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        params.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        params.prompt_ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, "prompt: one prompt per request (send several requests instead)", param="prompt")
    else:
        raise APIError(400, "prompt: expected a string or a non-empty list of token ids", param="prompt")


def _get(body: dict, key: str, kind: type, default, name: str | None = None):
    """body[key] as `kind` (null or absent: `default`); a value of another type is a 400 naming the field."""
    value = body.get(key)
    if value is None:
        return default
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if kind is float and ok and not math.isfinite(value):
        ok = False
    if not ok:
        what = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "an object"}[kind]
        raise APIError(400, f"{name or key}: expected {what}, got {type(value).__name__} {value!r}"[:200],
                       param=name or key)
    return value
