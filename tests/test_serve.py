"""`flashllm serve` driven by the official openai client (and raw HTTP for bad requests) on loopback."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import shutil
import socket
import time

import pytest

import flashllm

from flashllm.serve.app import Server
from serving import TEMPLATE, USER, Running, slow

openai = pytest.importorskip("openai")

@pytest.fixture(scope="module")
def model_dir(tiny_models, tmp_path_factory):
    """The tiny opt model with a chat template beside it (as transformers 5 saves one)."""
    out = tmp_path_factory.mktemp("serve") / "tiny-chat"
    shutil.copytree(tiny_models("opt").model_dir, out)
    (out / "chat_template.jinja").write_text(TEMPLATE)
    return out


@pytest.fixture(scope="module")
def reference(model_dir):
    """A second copy of the model to compute what the server should answer."""
    return flashllm.load(model_dir)


@pytest.fixture(scope="module")
def served(model_dir):
    running = Running(Server(flashllm.load(model_dir), name="tiny", max_queue=4))
    yield running
    running.stop()


def test_models_and_health(served):
    client = served.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    status, health = served.raw("GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["model"] == "tiny"
    assert health["queue"] == {"running": 0, "queued": 0, "max_batch": 1, "max_queued": 4}


def test_chat_answers_like_the_api(served, reference):
    resp = served.client().chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=0)
    want = reference.chat(USER, max_new_tokens=8)
    assert resp.choices[0].message.content == want and resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == {"length": "length", "eos": "stop"}[reference.last_stop_reason]
    assert resp.usage.prompt_tokens == len(reference.chat_ids(USER))
    assert resp.usage.completion_tokens == len(reference.last_generation.token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    ext = resp.model_extra["flashllm"]
    assert ext["stop_reason"] == reference.last_stop_reason
    assert ext["stats"]["decode_tokens"] == resp.usage.completion_tokens - 1  # the first comes from the prompt
    assert ext["stats"]["total_ms"] > 0 and ext["stats"]["mode"] == "dense"


def test_completion_answers_like_generate(served, reference):
    prompt = "the lazy dog"
    resp = served.client().completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
    assert resp.choices[0].text == reference.generate(prompt, max_new_tokens=6)
    assert resp.usage.prompt_tokens == len(reference.tokenizer.encode(prompt))
    assert resp.usage.completion_tokens == 6 and resp.choices[0].finish_reason == "length"
    ids = served.client().completions.create(model="tiny", prompt=reference.tokenizer.encode(prompt), max_tokens=6,
                                             temperature=0)
    assert ids.choices[0].text == resp.choices[0].text


def test_streaming_gives_the_same_text_and_ends_with_done(served, reference):
    client = served.client()
    chunks = list(client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference.chat(USER, max_new_tokens=8)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(reference.last_generation.token_ids)
    pieces = list(client.completions.create(model="tiny", prompt="the lazy dog", max_tokens=6, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in pieces) == reference.generate("the lazy dog", max_new_tokens=6)
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)  # the raw event stream
    conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "the", "max_tokens": 3,
                                                        "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    events = [e for e in resp.read().decode().split("\n\n") if e]
    conn.close()
    assert resp.getheader("content-type").startswith("text/event-stream")
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_stop_strings_end_the_text(served, reference):
    full = reference.generate("the lazy dog", max_new_tokens=12)
    stop = next(full[i:i + 2] for i in range(len(full) // 3, len(full) - 1) if " " not in full[i:i + 2])
    client = served.client()
    resp = client.completions.create(model="tiny", prompt="the lazy dog", max_tokens=12, temperature=0, stop=[stop])
    assert resp.choices[0].text == full[:full.index(stop)] and resp.choices[0].finish_reason == "stop"
    assert resp.model_extra["flashllm"]["stop_reason"] == "stop"
    streamed = client.completions.create(model="tiny", prompt="the lazy dog", max_tokens=12, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full[:full.index(stop)]


def test_sampling_with_a_seed_repeats(served):
    client = served.client()
    runs = [client.completions.create(model="tiny", prompt="the", max_tokens=8, temperature=1.5, top_p=0.9,
                                      seed=7).choices[0].text for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("payload, status, param, words", [
    ({"model": "other", "prompt": "x"}, 404, "model", "'other' is not served here"),
    ({"prompt": "x"}, 400, "model", "model: required"),
    ({"model": "tiny", "prompt": "x", "temperature": "hot"}, 400, "temperature", "expected a number"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 2.5}, 400, "max_tokens", "expected an integer"),
    ({"model": "tiny", "prompt": "x", "max_tokens": -1}, 400, "max_tokens", "negative"),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p", "outside"),
    ({"model": "tiny", "prompt": "x", "stream": "yes"}, 400, "stream", "true or false"),
    ({"model": "tiny", "prompt": "x", "seed": True}, 400, "seed", "expected an integer"),
    ({"model": "tiny", "prompt": "x", "stop": [1]}, 400, "stop", "list of at most 4 strings"),
    ({"model": "tiny", "prompt": "x", "n": 2}, 400, "n", "not supported"),
    ({"model": "tiny", "prompt": ["a", "b"]}, 400, "prompt", "one prompt per request"),
    ({"model": "tiny", "prompt": {"text": "x"}}, 400, "prompt", "expected a string"),
    ({"model": "tiny", "prompt": [100000]}, 400, "prompt", "token ids must lie in"),
    ({"model": "tiny", "prompt": "the quick brown fox " * 20}, 400, "prompt", "but the context holds 64"),
])
def test_bad_completion_requests_get_openai_errors(served, payload, status, param, words):
    got, body = served.post("/v1/completions", payload)
    assert got == status, body
    assert words in body["error"]["message"] and body["error"]["param"] == param
    assert body["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


@pytest.mark.parametrize("payload, words", [
    ({"model": "tiny", "messages": "hi"}, "messages: expected a non-empty list"),
    ({"model": "tiny", "messages": [{"role": "user"}]}, "messages[0].content: expected a string"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "fox " * 40}]}, "but the context holds 64"),
])
def test_bad_chat_requests_get_openai_errors(served, payload, words):
    status, body = served.post("/v1/chat/completions", payload)
    assert status == 400 and words in body["error"]["message"], body
    assert body["error"]["param"] == "messages"


def test_prompt_too_long_names_the_numbers_through_the_client(served, reference):
    prompt = "the quick brown fox " * 20
    with pytest.raises(openai.BadRequestError) as err:
        served.client().completions.create(model="tiny", prompt=prompt, max_tokens=4)
    n = len(reference.tokenizer.encode(prompt))
    assert f"the prompt has {n} tokens but the context holds 64" in err.value.message
    assert err.value.code == "context_length_exceeded"
    # 64 is the model's limit: a larger --context cannot help, and the message does not suggest it
    assert "no more positions" in err.value.message and "larger --context" not in err.value.message


def test_prompt_too_long_below_the_models_limit_suggests_a_larger_context(model_dir):
    from flashllm.serve.openai_api import APIError

    server = Server(flashllm.load(model_dir, context=16), name="tiny")
    with pytest.raises(APIError) as err:
        server.prepare("completion", {"model": "tiny", "prompt": "the quick brown fox " * 12})
    assert "but the context holds 16" in err.value.message and err.value.code == "context_length_exceeded"
    assert "restart the server with a larger --context (the model has 64 positions)" in err.value.message


def test_malformed_bodies_and_routes(served):
    status, body = served.raw("POST", "/v1/completions", b'{"model": "tiny", "prompt": ')
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = served.raw("POST", "/v1/completions", b"[1, 2]")
    assert status == 400 and "JSON object" in body["error"]["message"]
    status, body = served.raw("POST", "/v1/completions", b"\xff\xfe")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    big = json.dumps({"model": "tiny", "prompt": "x" * (5 << 20)}).encode()
    status, body = served.raw("POST", "/v1/completions", big)
    assert status == 413 and f"most accepted is {4 << 20}" in body["error"]["message"]
    status, body = served.raw("GET", "/v1/nothing")
    assert status == 404 and body["error"]["type"] == "not_found_error"
    status, body = served.raw("GET", "/v1/completions")
    assert status == 405 and "Method Not Allowed" in body["error"]["message"]
    assert served.raw("GET", "/health")[0] == 200  # still serving


def test_api_key_is_checked_on_every_request(model_dir):
    running = Running(Server(flashllm.load(model_dir), name="tiny", api_key="s3cret"))
    try:
        for path in ("/health", "/v1/models"):
            status, body = running.raw("GET", path)
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert running.raw("GET", "/health", headers={"Authorization": "Bearer wrong"})[0] == 401
        with pytest.raises(openai.AuthenticationError):
            running.client(api_key="wrong").completions.create(model="tiny", prompt="the", max_tokens=2)
        resp = running.client(api_key="s3cret").completions.create(model="tiny", prompt="the", max_tokens=2)
        assert resp.usage.completion_tokens >= 1
    finally:
        running.stop()


def test_chat_without_a_template_says_what_to_do(tiny_models):
    running = Running(Server(flashllm.load(tiny_models("opt").model_dir), name="tiny"))
    try:
        with pytest.raises(openai.BadRequestError) as err:
            running.client().chat.completions.create(model="tiny", messages=USER, max_tokens=2)
        assert "no chat template" in err.value.message and "--chat-template" in err.value.message
        assert running.client().completions.create(model="tiny", prompt="the", max_tokens=2).choices[0].text
    finally:
        running.stop()


def test_sixteen_clients_complete_or_get_a_clean_503(model_dir):
    model = flashllm.load(model_dir)
    slow(model, 0.02)
    running = Running(Server(model, name="tiny", max_queue=3))
    try:
        def ask(i):
            client = running.client(timeout=60)
            try:
                if i % 2:
                    return "ok", client.chat.completions.create(model="tiny", messages=USER, max_tokens=6,
                                                                temperature=0).choices[0].message.content
                return "ok", "".join(c.choices[0].text for c in client.completions.create(
                    model="tiny", prompt="the", max_tokens=6, temperature=0, stream=True))
            except openai.APIStatusError as exc:
                return exc.status_code, exc.body

        with concurrent.futures.ThreadPoolExecutor(16) as pool:  # the timeout: a hang fails, not a slow machine
            results = list(pool.map(ask, range(16), timeout=120))
        oks = [r for r in results if r[0] == "ok"]
        busy = [r for r in results if r[0] == 503]
        assert len(oks) + len(busy) == 16, results
        assert oks and busy, results  # 16 at once cannot fit in 1 decoding + 3 queued
        assert all("server is busy" in body["message"] and body["code"] == "overloaded" for _, body in busy)
        assert len({text for _, text in oks if text}) <= 2  # greedy: one answer per endpoint
        running.wait_idle(5)
        again = running.client().completions.create(model="tiny", prompt="the", max_tokens=2, temperature=0)
        assert again.choices[0].text
    finally:
        running.stop()


def test_a_client_that_leaves_frees_the_slot_at_once(model_dir):
    model = flashllm.load(model_dir)
    calls = slow(model, 0.05)
    running = Running(Server(model, name="tiny", max_queue=0))
    try:
        for stream in (True, False):
            calls.clear()
            sock = socket.create_connection(("127.0.0.1", running.port))
            body = json.dumps({"model": "tiny", "prompt": "the", "max_tokens": 60, "stream": stream}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            if stream:
                seen = b""
                while b"data: " not in seen:  # it is generating
                    seen += sock.recv(65536)
            else:
                while len(calls) < 3:
                    time.sleep(0.01)
            sock.close()
            running.wait_idle(2)  # 60 tokens would take 3 s; freed within a token or two
            made = len(calls)
            time.sleep(0.3)
            # no further tokens for the client that left: at most the one whose forward the worker had begun
            # when the cancel came (it checks between tokens; under load that window is wide)
            assert len(calls) <= made + 1 and made < 40, calls
            resp = running.client().completions.create(model="tiny", prompt="the", max_tokens=2, temperature=0)
            assert resp.choices[0].finish_reason == "length"  # the only slot is free again
    finally:
        running.stop()


def test_a_bug_answers_a_json_500_and_the_server_goes_on(model_dir, capfd):
    model = flashllm.load(model_dir)
    running = Running(Server(model, name="tiny"))
    try:
        step = model.step
        model.step = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError if not stream else openai.APIError) as err:
                out = running.client().completions.create(model="tiny", prompt="the", max_tokens=2, stream=stream)
                list(out)
            assert "internal error (RuntimeError)" in err.value.message
        assert "RuntimeError: boom" in capfd.readouterr().err  # the traceback is in the server's log
        model.step = step
        assert running.client().completions.create(model="tiny", prompt="the", max_tokens=2).choices[0].text
    finally:
        running.stop()


def test_the_serve_command_listens_where_it_says_and_stops_on_ctrl_c(model_dir):
    """`flashllm serve --port 0` binds a free port before loading, names it in its first line, answers there,
    and a Ctrl-C ends it with status 0."""
    import re
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "import sys; from flashllm.cli.main import main; sys.exit(main())",
                             "serve", str(model_dir), "--port", "0"], stderr=subprocess.PIPE, text=True)
    try:
        banner = proc.stderr.readline()
        port = int(re.search(r"on http://127\.0\.0\.1:(\d+)/v1", banner).group(1))
        assert port > 0, banner
        deadline = time.monotonic() + 30
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                conn.request("GET", "/health")
                health = json.loads(conn.getresponse().read())
                conn.close()
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline, "the server did not answer"
                time.sleep(0.05)
        assert health["status"] == "ok" and health["model"] == model_dir.name
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        proc.kill()
        proc.stderr.close()


def test_a_port_in_use_is_a_one_line_error_before_the_model_loads(tmp_path, capsys):
    from flashllm.cli.main import main

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        capsys.readouterr()
        # the model directory does not exist: the port is checked first, so that is not what is reported
        assert main(["serve", str(tmp_path / "no-model"), "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"flashllm: error: cannot listen on 127.0.0.1:{port}: ") and err.count("\n") == 1, err
    assert "in use" in err, err


@pytest.mark.parametrize("max_tokens", [50, None])
def test_a_reply_cut_by_the_context_says_context_not_length(served, reference, max_tokens):
    """A prompt that fits but leaves less room than max_tokens (or than no limit): the reply ends at the context,
    and the server says so (stop_reason context; finish_reason length, as OpenAI's API names it). It said
    "length", as if the client's max_tokens had ended it."""
    room = 10
    ids = (reference.tokenizer.encode("the quick brown fox ") * reference.context)[:reference.context - room]
    resp = served.client().completions.create(model="tiny", prompt=ids, temperature=0,
                                              **({} if max_tokens is None else {"max_tokens": max_tokens}))
    if max_tokens is None:  # the completions API's default is 16: more than the room left here
        assert room < 16
    assert resp.usage.completion_tokens == room and resp.choices[0].finish_reason == "length"
    assert resp.model_extra["flashllm"]["stop_reason"] == "context"
    limited = served.client().completions.create(model="tiny", prompt=ids, temperature=0, max_tokens=room - 1)
    assert limited.model_extra["flashllm"]["stop_reason"] == "length"  # the client's limit came first
