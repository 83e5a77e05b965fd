"""Continuous batching in the server: concurrent requests decode together, each exactly as it would alone."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

import flashllm
from flashllm.serve.app import Server
from serving import Running

openai = pytest.importorskip("openai")

PROMPTS = ["the quick brown fox", "def main():", "from flash memory one", "a small model streams its neurons",
           "x", "the lazy dog while"]
CASES = {"dense": ("opt", {}), "sparse": ("opt", dict(mode="sparse", predictor="oracle", window=2)),
         "moe": ("mixtral", dict(mode="sparse"))}  # experts streamed through the expert cache


def ask(running: Running, i: int, prompt: str, max_tokens: int, **kw) -> tuple[str, dict]:
    """(text, flashllm extension) of one completion, streamed for odd i."""
    client = running.client(timeout=120)
    if i % 2:
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, stream=True, **kw))
        return "".join(c.choices[0].text for c in chunks), chunks[-1].model_extra["flashllm"]
    resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, **kw)
    return resp.choices[0].text, resp.model_extra["flashllm"]


@pytest.mark.parametrize("case", list(CASES))
def test_concurrent_requests_decode_together_and_equal_each_alone(tiny_models, case):
    """Six requests at once (different prompts and lengths) through a batch of 4 with 3-token prefill chunks:
    each text equals the library's greedy text for its prompt alone, and steps carried several sequences."""
    family, options = CASES[case]
    model_dir = tiny_models(family).model_dir
    alone = flashllm.load(model_dir, **options)
    lengths = [12, 5, 9, 16, 7, 10]
    want = [alone.generate(p, max_new_tokens=n) for p, n in zip(PROMPTS, lengths)]
    running = Running(Server(flashllm.load(model_dir, batch_size=4, **options), name="tiny", max_batch=4,
                             prefill_chunk=3))
    try:
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda i: ask(running, i, PROMPTS[i], lengths[i], temperature=0),
                                range(len(PROMPTS)), timeout=300))
        assert [text for text, _ in got] == want
        assert max(ext["stats"]["batch"] for _, ext in got) > 1  # some steps decoded several requests together
        assert all(ext["stats"]["decode_tokens"] <= n - 1 for (_, ext), n in zip(got, lengths))
        assert running.server.scheduler.counts()["running"] == 0
    finally:
        running.stop()


def test_seeded_sampling_in_a_batch_equals_it_alone(tiny_models):
    """Each sequence has its own sampler: a seeded request sampled beside others gives its text alone."""
    model_dir = tiny_models("opt").model_dir
    alone = flashllm.load(model_dir)
    want = [alone.generate(p, max_new_tokens=10, temperature=1.2, top_p=0.9, seed=i) for i, p in enumerate(PROMPTS)]
    running = Running(Server(flashllm.load(model_dir, batch_size=6), name="tiny", max_batch=6))
    try:
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda i: ask(running, i, PROMPTS[i], 10, temperature=1.2, top_p=0.9, seed=i)[0],
                                range(len(PROMPTS)), timeout=300))
        assert got == want
    finally:
        running.stop()


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(tiny_models):
    """A request arriving while another decodes is prefilled a chunk per step: the running sequence's decode
    steps go on between the chunks (its stream does not stall for the whole prompt)."""
    model_dir = tiny_models("opt").model_dir
    model = flashllm.load(model_dir, batch_size=2)
    server = Server(model, name="tiny", max_batch=2, prefill_chunk=4)
    calls, step = [], model.step

    def logged(ids, pos, slot=0):
        time.sleep(0.01)  # the first request is still decoding when the second arrives
        calls.append(("prefill", len(ids)) if isinstance(pos, int) and slot == 1 else ("decode", slot))
        return step(ids, pos, slot)

    model.step = logged
    running = Running(server)
    try:
        first = iter(running.client().completions.create(model="tiny", prompt="x", max_tokens=50, temperature=0,
                                                         stream=True))
        next(first)  # decoding
        prompt = "the quick brown fox jumps over the lazy dog"
        resp = running.client().completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
        list(first)
        chunks = [i for i, c in enumerate(calls) if c[0] == "prefill"]
        assert len(chunks) >= 3 and all(n <= 4 for _, n in (calls[i] for i in chunks)), calls
        assert all(calls[i + 1][0] == "decode" for i in chunks[:-1]), calls  # a decode step after every chunk
        assert resp.choices[0].text == flashllm.load(model_dir).generate(prompt, max_new_tokens=4)
    finally:
        running.stop()
