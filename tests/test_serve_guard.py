"""The server's security defaults: foreign web origins and non-JSON bodies refused, the API key checked
(any case of the Bearer scheme), an empty key refused at start, a warning when reachable without a key."""

from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import sys
import time

import pytest

import flashllm
from flashllm.errors import FlashLLMError
from flashllm.serve.app import Server
from serving import Running

pytest.importorskip("uvicorn")

BODY = json.dumps({"model": "tiny", "prompt": "the", "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("opt").model_dir


def request(running: Running, headers: dict, method: str = "POST", body: bytes | None = BODY):
    conn = http.client.HTTPConnection("127.0.0.1", running.port, timeout=30)
    try:
        conn.request(method, "/v1/completions", body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_a_foreign_origin_or_a_non_json_body_is_refused(model_dir):
    """The local-server CSRF: a page on another site POSTs text/plain (no preflight) with its Origin."""
    running = Running(Server(flashllm.load(model_dir), name="tiny"))
    try:
        status, _, body = request(running, {"Content-Type": "text/plain", "Origin": "http://evil.example"})
        assert status == 403 and json.loads(body)["error"]["code"] == "origin_not_allowed"
        assert "--allow-origin http://evil.example" in json.loads(body)["error"]["message"]
        status, _, body = request(running, {"Content-Type": "application/json", "Origin": "http://evil.example"})
        assert status == 403
        status, _, body = request(running, {"Content-Type": "text/plain"})  # no Origin (curl -d without -H)
        assert status == 415 and "Content-Type: application/json" in json.loads(body)["error"]["message"]
        own = f"http://127.0.0.1:{running.port}"  # a page the server itself would serve: same origin
        assert request(running, {"Content-Type": "application/json", "Origin": own})[0] == 200
        assert request(running, {"Content-Type": "application/json; charset=utf-8"})[0] == 200
    finally:
        running.stop()


def test_allow_origin_lets_that_origin_in_with_cors_headers(model_dir):
    running = Running(Server(flashllm.load(model_dir), name="tiny", allow_origins=("https://app.example",)))
    try:
        status, headers, _ = request(running, {"Origin": "https://app.example",
                                               "Access-Control-Request-Method": "POST"}, "OPTIONS", None)
        assert status == 204 and headers["access-control-allow-origin"] == "https://app.example"
        status, headers, _ = request(running, {"Content-Type": "application/json", "Origin": "https://app.example"})
        assert status == 200 and headers["access-control-allow-origin"] == "https://app.example"
        assert request(running, {"Content-Type": "application/json", "Origin": "https://other.example"})[0] == 403
    finally:
        running.stop()


def test_the_bearer_scheme_is_matched_in_any_case(model_dir):
    running = Running(Server(flashllm.load(model_dir), name="tiny", api_key="s3cret"))
    try:
        for scheme in ("Bearer", "bearer", "BEARER"):
            assert request(running, {"Content-Type": "application/json", "Authorization": f"{scheme} s3cret"})[0] == 200
        assert request(running, {"Content-Type": "application/json", "Authorization": "bearer wrong"})[0] == 401
        assert request(running, {"Content-Type": "application/json", "Authorization": "Basic s3cret"})[0] == 401
    finally:
        running.stop()


def test_an_empty_api_key_is_refused_at_start(model_dir, capsys, monkeypatch):
    """FLASHLLM_API_KEY="" would make every request 401: refused with one line before anything loads."""
    with pytest.raises(FlashLLMError, match="the API key is empty"):
        Server(flashllm.load(model_dir), name="tiny", api_key="")
    from flashllm.cli.main import main

    monkeypatch.setenv("FLASHLLM_API_KEY", "")
    capsys.readouterr()
    assert main(["serve", str(model_dir), "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("flashllm: error: the API key is empty") and err.count("\n") == 1, err


def start(model_dir, *args, env=None):
    """`flashllm serve MODEL --port 0 ARGS` in a subprocess: (process, port, banner lines)."""
    proc = subprocess.Popen([sys.executable, "-m", "flashllm.cli.main", "serve", str(model_dir), "--port", "0", *args],
                            stderr=subprocess.PIPE, text=True, env=env)
    lines = [proc.stderr.readline()]
    port = int(re.search(r"on http://[^:]+:(\d+)/v1", lines[0]).group(1))
    return proc, port, lines


def test_listening_beyond_loopback_without_a_key_warns(model_dir):
    import os

    env = {k: v for k, v in os.environ.items() if k != "FLASHLLM_API_KEY"}
    proc, _, lines = start(model_dir, "--host", "0.0.0.0", env=env)
    try:
        lines.append(proc.stderr.readline())
        assert "warning: listening on 0.0.0.0" in lines[1] and "--api-key" in lines[1], lines
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(20)
        proc.stderr.close()
    proc, _, lines = start(model_dir, "--host", "0.0.0.0", "--api-key", "k", env=env)  # with a key: no warning
    try:
        time.sleep(1)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(20)
        assert "warning" not in proc.stderr.read()
