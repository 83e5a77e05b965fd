"""What the server tests share: a Server run by uvicorn in a thread on a free loopback port, and a slowed model."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest

from flashllm.serve.app import Server
from flashllm.serve.http import uvicorn_server

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
USER = [{"role": "user", "content": "the quick brown fox"}]


class Running:
    """A Server on a free loopback port, served by uvicorn in a thread."""

    def __init__(self, server: Server):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.server, self.port = server, sock.getsockname()[1]
        self.uv = uvicorn_server(server, log_level="warning", grace=0)
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.uv.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=kw.pop("api_key", "none"),
                             max_retries=0, timeout=kw.pop("timeout", 60), **kw)

    def raw(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        """(status, parsed JSON body) of one plain HTTP request."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())
        finally:
            conn.close()

    def post(self, path: str, payload, **kw):
        return self.raw("POST", path, json.dumps(payload).encode(), **kw)

    def wait_idle(self, seconds: float) -> float:
        """Seconds until no request is decoding or queued (fails after `seconds`)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            q = self.raw("GET", "/health")[1]["queue"]
            if q["running"] == 0 and q["queued"] == 0:
                return time.monotonic() - t0
            time.sleep(0.02)
        pytest.fail(f"server still busy after {seconds} s: {q}")

    def stop(self):
        self.uv.should_exit = True
        self.thread.join(10)
        self.server.scheduler.close()


def slow(model, seconds: float):
    """Make every forward take at least `seconds` (so queues fill and cancellation is observable)."""
    forward, calls = model.forward, []

    def slowed(ids, pos, slot=0):
        calls.append(pos)
        time.sleep(seconds)
        return forward(ids, pos, slot)

    model.forward = slowed
    return calls


