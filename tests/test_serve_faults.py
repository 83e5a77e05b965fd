"""The server under the faults real clients produce: clients that leave, huge or malformed input, explicit
"off" values, slow senders, a stop signal. Each test pins one defect that is fixed."""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import flashllm
from flashllm.generate import TextStream, held
from flashllm.serve.app import Server
from serving import Running, slow

pytest.importorskip("uvicorn")


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("opt").model_dir


@pytest.fixture(scope="module")
def served(model_dir):
    running = Running(Server(flashllm.load(model_dir), name="tiny", max_queue=4))
    yield running
    running.stop()


def send(port: int, body: bytes, path: str = "/v1/completions") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                 % (path.encode(), len(body)) + body)
    return sock


def test_a_queued_request_whose_client_leaves_ends(model_dir):
    """A non-streamed request whose client leaves while queued is ended (its handler returns), not left
    waiting for events forever."""
    model = flashllm.load(model_dir)
    slow(model, 0.05)
    running = Running(Server(model, name="tiny", max_queue=8))
    try:
        busy = send(running.port, json.dumps({"model": "tiny", "prompt": "the", "max_tokens": 40}).encode())
        time.sleep(0.3)
        leavers = [send(running.port, json.dumps({"model": "tiny", "prompt": "a", "max_tokens": 4}).encode())
                   for _ in range(5)]
        deadline = time.monotonic() + 10
        while running.server.scheduler.counts()["queued"] < 5:
            assert time.monotonic() < deadline, running.server.scheduler.counts()
            time.sleep(0.05)
        for sock in leavers:
            sock.close()
        busy.close()
        running.wait_idle(5)
        deadline = time.monotonic() + 5
        while running.uv.server_state.tasks and time.monotonic() < deadline:  # every request's task has returned
            time.sleep(0.05)
        assert not running.uv.server_state.tasks
    finally:
        running.stop()


def test_stop_strings_are_capped_and_matched_in_bounded_work(served, model_dir):
    status, body = served.post("/v1/completions", {"model": "tiny", "prompt": "x", "stop": "z" * 257})
    assert status == 400 and "the most accepted is 256" in body["error"]["message"] and body["error"]["param"] == "stop"
    rng = random.Random(0)
    for _ in range(2000):  # the hold-back: the longest end of the text that begins a stop string
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        stop = "".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
        want = max((k for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
        assert held(text, stop) == want, (text, stop)
    tok = flashllm.load(model_dir).tokenizer
    lengths, decode = [], tok.decode
    tok.decode = lambda ids: (lengths.append(len(ids)), decode(ids))[1]
    ids = [t for t in tok.encode("the quick brown fox jumps over the lazy dog " * 12)][:300]
    stream = TextStream(tok, ids[:5], stop=["zzzz" * 60])
    shown = "".join(stream.add(t) for t in ids[5:]) + stream.flush()
    assert shown == decode(ids[5:]) or shown == decode(ids)[len(decode(ids[:5])):]
    assert max(lengths) <= TextStream.WINDOW + TextStream.PROMPT_TAIL  # not the whole text on every token


def test_tokenizing_runs_off_the_event_loop_after_the_queue_check(model_dir):
    """Tokenizing a large prompt never pauses /health; a full server answers 503 without tokenizing; a prompt
    far beyond what the context can hold is refused before tokenizing."""
    model = flashllm.load(model_dir)
    slow(model, 0.05)
    running = Running(Server(model, name="tiny", max_queue=0))
    encode, encoded = model.tokenizer.encode, []

    def slow_encode(text, special=True):
        encoded.append(len(text))
        time.sleep(1.5)  # a few MB of text
        return encode(text, special)

    model.tokenizer.encode = slow_encode
    try:
        worker = threading.Thread(target=running.post, args=("/v1/completions", {"model": "tiny", "prompt": "the",
                                                                                  "max_tokens": 30}))
        worker.start()
        time.sleep(0.3)  # tokenizing now
        t0 = time.monotonic()
        assert running.raw("GET", "/health")[0] == 200
        assert time.monotonic() - t0 < 1.0  # answered while the tokenizer works
        status, body = running.post("/v1/completions", {"model": "tiny", "prompt": "the"})
        assert status == 503 and body["error"]["code"] == "overloaded" and len(encoded) == 1  # not tokenized
        worker.join(30)
        huge = "fox " * (running.server.max_prompt_chars // 4 + 1)
        status, body = running.post("/v1/completions", {"model": "tiny", "prompt": huge})
        assert status == 400 and body["error"]["code"] == "context_length_exceeded" and len(encoded) == 1
    finally:
        model.tokenizer.encode = encode
        running.stop()


@pytest.mark.parametrize("raw, param", [
    (b'{"model": "tiny", "prompt": "x", "seed": -1}', "seed"),
    (b'{"model": "tiny", "prompt": "x", "seed": 18446744073709551616}', "seed"),
    (b'{"model": "tiny", "prompt": "a\\ud83d"}', "prompt"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d"}]}', "messages[0].content"),
    (b'{"model": "tiny", "messages": [{"role": "\\udc00", "content": "hi"}]}', "messages[0].role"),
    (b'[' * 100000, None),
])
def test_client_input_gets_a_4xx_not_a_500(served, raw, param):
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    status, body = served.raw("POST", path, raw)
    assert 400 <= status < 500 and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["param"] == param


def test_explicit_off_values_are_accepted(served):
    off = {"logprobs": False, "top_logprobs": 0, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
           "n": 1, "presence_penalty": 0.0, "logit_bias": {}}
    status, body = served.post("/v1/completions", {"model": "tiny", "prompt": "the", "max_tokens": 2, **off})
    assert status == 200, body
    status, body = served.post("/v1/completions", {"model": "tiny", "prompt": "the", "logprobs": True})
    assert status == 400 and body["error"]["param"] == "logprobs"
    status, body = served.post("/v1/completions", {"model": "tiny", "prompt": "the", "top_logprobs": False})
    assert status == 400  # false is not the number 0


def test_usage_is_null_on_every_chunk_before_the_last(served):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "the", "max_tokens": 4,
                                                         "stream": True, "stream_options": {"include_usage": True}}),
                 {"Content-Type": "application/json"})
    data = conn.getresponse().read().decode()
    conn.close()
    chunks = [json.loads(e[6:]) for e in data.split("\n\n") if e.startswith("data: {")]
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"]["total_tokens"] > 0


def test_slow_senders_time_out(model_dir):
    running = Running(Server(flashllm.load(model_dir), name="tiny", read_timeout=3))  # loose: a loaded CI host
    try:
        sock = socket.create_connection(("127.0.0.1", running.port))  # a body that never arrives
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\"")
        sock.settimeout(10)
        reply = b""
        while b"}}" not in reply:  # the whole JSON error, however the reply is split
            more = sock.recv(65536)
            assert more, reply
            reply += more
        assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 3 s" in reply
        sock.close()
        sock = socket.create_connection(("127.0.0.1", running.port))  # headers that never end
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        sock.settimeout(20)
        assert sock.recv(65536) == b""  # closed by the server
        sock.close()
    finally:
        running.stop()


def test_clients_that_leave_leave_no_traceback(model_dir, capfd):
    model = flashllm.load(model_dir)
    slow(model, 0.02)
    running = Running(Server(model, name="tiny"))
    try:
        capfd.readouterr()
        sock = send(running.port, json.dumps({"model": "tiny", "prompt": "the", "max_tokens": 30}).encode())
        time.sleep(0.2)
        sock.close()  # a non-streamed request, left while decoding
        sock = socket.create_connection(("127.0.0.1", running.port))  # left while sending its body
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"mod")
        time.sleep(0.2)
        sock.close()
        running.wait_idle(3)
        time.sleep(0.3)
        assert "Traceback" not in capfd.readouterr().err
    finally:
        running.stop()


def test_sigterm_ends_open_streams_with_a_final_chunk(model_dir):
    """A stop signal lets running streams finish (or, past the grace period, ends them with a final chunk and
    [DONE]) rather than cutting them off."""
    import re

    proc = subprocess.Popen([sys.executable, "-m", "flashllm.cli.main", "serve", str(model_dir), "--port", "0",
                             "--max-batch", "2"], stderr=subprocess.PIPE, text=True)
    try:
        port = int(re.search(r":(\d+)/v1", proc.stderr.readline()).group(1))
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port)).close()
                break
            except ConnectionRefusedError:
                time.sleep(0.1)
        sock = send(port, json.dumps({"model": model_dir.name, "prompt": "the",
                                      "max_tokens": 60, "stream": True}).encode())
        data = b""
        while b"data: {" not in data:  # decoding
            data += sock.recv(65536)
        proc.send_signal(signal.SIGTERM)
        sock.settimeout(30)
        while b"data: [DONE]" not in data:
            more = sock.recv(65536)
            assert more, data[-500:]
            data += more
        sock.close()
        assert b'"finish_reason": "length"' in data
        assert proc.wait(30) is not None
    finally:
        proc.kill()
        proc.stderr.close()


def test_a_stop_signal_cuts_long_streams_with_a_final_chunk(model_dir):
    """Past the grace period a running stream ends with finish_reason length, stop_reason shutdown and [DONE];
    a queued one gets an error in its stream and [DONE]."""
    import http.client

    model = flashllm.load(model_dir)
    slow(model, 0.05)
    running = Running(Server(model, name="tiny"))
    results = {}

    def stream(name):
        conn = http.client.HTTPConnection("127.0.0.1", running.port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "the", "max_tokens": 60,
                                                             "stream": True}), {"Content-Type": "application/json"})
        results[name] = conn.getresponse().read().decode()
        conn.close()

    threads = [threading.Thread(target=stream, args=(name,)) for name in ("running", "queued")]
    try:
        for t in threads:
            t.start()
            time.sleep(0.3)
        running.uv.handle_exit(signal.SIGTERM, None)
        for t in threads:
            t.join(30)
        assert results["running"].endswith("data: [DONE]\n\n")
        assert '"finish_reason": "length"' in results["running"] and '"stop_reason": "shutdown"' in results["running"]
        assert '"code": "shutting_down"' in results["queued"] and results["queued"].endswith("data: [DONE]\n\n")
    finally:
        running.stop()
