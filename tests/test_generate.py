"""Stop conditions (every eos id, stop strings, length, context) and streamed text."""

import json
import shutil

import numpy as np
import pytest

import flashllm
from flashllm.converters import convert
from flashllm.errors import FlashLLMError
from flashllm.generate import Generation, TextStream, generate_tokens
from flashllm.text.tokenizer import Tokenizer
from tiny import make_hf_model, save_checkpoint

PROMPT = "the quick brown"


class CharTokenizer:
    """One character per id (ids are code points): makes stop-string holding easy to see."""

    def decode(self, ids):
        return "".join(map(chr, ids))


def constant_forward(token: int, vocab: int = 8):
    def forward(ids, pos):
        logits = np.zeros((len(ids), vocab), dtype=np.float32)
        logits[:, token] = 1.0
        return logits
    return forward


def test_stop_reasons_length_context_eos():
    run = Generation()
    assert list(generate_tokens(constant_forward(3), [1, 1, 1], 100, 4, record=run)) == [3] * 4
    assert run.stop_reason == "length" and run.token_ids == [3] * 4
    run = Generation()
    assert len(list(generate_tokens(constant_forward(3), [1, 1, 1], 5, 100, record=run))) == 3
    assert run.stop_reason == "context"
    run = Generation()
    assert list(generate_tokens(constant_forward(3), [1], 100, 100, eos_token_ids=[7, 3], record=run)) == [3]
    assert run.stop_reason == "eos"


@pytest.mark.parametrize("bad", [dict(max_new_tokens=-1), dict(temperature=-0.5), dict(top_p=0.0),
                                 dict(top_p=1.5), dict(temperature=float("nan"))])
def test_sampling_options_out_of_range(bad):
    options = dict(max_new_tokens=4, temperature=0.0, top_p=1.0) | bad
    with pytest.raises(FlashLLMError, match=next(iter(bad))):
        list(generate_tokens(constant_forward(3), [1], 100, options["max_new_tokens"],
                             options["temperature"], options["top_p"]))


def feed(stream, text):
    return [stream.add(ord(c)) for c in text]


def test_stop_string_is_held_back_until_resolved():
    s = TextStream(CharTokenizer(), [], stop=["abc", "zz"])
    assert feed(s, "xab") == ["x", "", ""]  # "ab" could start "abc"
    assert feed(s, "d") == ["abd"]  # resolved: not a stop string
    assert not s.stopped
    s = TextStream(CharTokenizer(), [], stop=["abc"])
    assert feed(s, "xyab") == ["x", "y", "", ""]
    assert feed(s, "c") == [""] and s.stopped and s.text == "xy"
    assert s.flush() == ""
    s = TextStream(CharTokenizer(), [], stop=["abc"])
    feed(s, "ab")
    assert s.flush() == "ab"  # generation ended: the held text is shown


def test_first_word_keeps_its_leading_space_with_metaspace(tiny_models):
    tok = Tokenizer(tiny_models("llama").model_dir, bos_token_id=1)
    prompt_ids = tok.encode(PROMPT)
    new_ids = tok.tok.encode("fox jumps").ids  # Metaspace: "▁fox", "▁jumps"
    assert tok.decode(new_ids) == "fox jumps"  # plain decoding drops the space before "fox"
    stream = TextStream(tok, prompt_ids)
    assert "".join(stream.add(t) for t in new_ids) + stream.flush() == " fox jumps"
    assert tok.decode(prompt_ids) + stream.text == tok.decode(prompt_ids + new_ids)


def test_model_stream_matches_full_decode_and_stops_at_stop_string(tiny_models):
    model = flashllm.load(tiny_models("llama").model_dir)
    text = model.generate(PROMPT, max_new_tokens=16)
    ids = model.last_generation.token_ids
    prompt_ids = model.tokenizer.encode(PROMPT)
    assert model.tokenizer.decode(prompt_ids) + text == model.tokenizer.decode(prompt_ids + ids)
    assert model.last_stop_reason in ("eos", "length")
    stop = text.strip()[2:5]
    assert len(stop) == 3
    cut = text.index(stop)
    pieces = list(model.stream(PROMPT, max_new_tokens=16, stop=["never seen", stop]))
    assert "".join(pieces) == text[:cut] and model.last_stop_reason == "stop"
    assert model.generate(PROMPT, max_new_tokens=16, stop=stop) == text[:cut]


def llama_with_eos(tmp_path, eos):
    hf = make_hf_model("llama")
    hf.config.eos_token_id = eos
    return convert(save_checkpoint(hf, "llama", tmp_path / "hf"), tmp_path / "flash", progress=False)


def test_every_eos_id_in_config_stops_generation(tiny_models, tmp_path):
    prompt = [1, 5, 9, 13]
    free = list(flashllm.load(tiny_models("llama").model_dir).generate_ids(prompt, 12))
    assert 2 not in free[:4]
    later = free[3]  # a token the model emits; make it the second eos id, as Llama-3 lists <|eot_id|>
    model_dir = llama_with_eos(tmp_path, [2, later])
    spec = flashllm.format.manifest.read_manifest(model_dir).spec
    assert spec.eos_token_id == 2 and spec.eos_token_ids == (2, later)
    model = flashllm.load(model_dir)
    got = list(model.generate_ids(prompt, 12))
    assert got == free[:free.index(later) + 1] and model.last_stop_reason == "eos"


def test_generation_config_eos_ids_stop_generation(tiny_models, tmp_path):
    """Llama-3 Instruct: config.json names one eos id, generation_config.json adds <|eot_id|>."""
    prompt = [1, 5, 9, 13]
    free = list(flashllm.load(tiny_models("llama").model_dir).generate_ids(prompt, 12))
    later = free[3]
    ckpt = tmp_path / "hf"
    shutil.copytree(tiny_models("llama").ckpt, ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, later]}))
    model = flashllm.load(convert(ckpt, tmp_path / "flash", progress=False))
    assert list(model.generate_ids(prompt, 12)) == free[:free.index(later) + 1]
    assert model.last_stop_reason == "eos"


def test_text_generation_is_deterministic_and_streams(tiny_models):
    model = flashllm.load(tiny_models("llama").model_dir)
    text = model.generate("the quick brown", max_new_tokens=10)
    pieces = list(model.stream("the quick brown", max_new_tokens=10))
    assert "".join(pieces) == text
    sampled = [model.generate("the quick", max_new_tokens=10, temperature=0.8, top_p=0.9, seed=3) for _ in range(2)]
    assert sampled[0] == sampled[1]
    stats = model.stats
    for key in ("bytes_read", "reads", "io_ms", "mem_ms", "compute_ms", "predictor_ms", "total_ms", "dram_bytes"):
        assert key in stats
    assert stats["total_ms"] > 0 and stats["dram_bytes"] > 0


def test_sampling_respects_top_p():
    from flashllm.generate import sample

    logits = np.array([5.0, 4.9, -10, -10], dtype=np.float32)
    rng = np.random.default_rng(0)
    seen = {sample(logits, 1.0, 0.5, rng) for _ in range(50)}
    assert seen == {0}
    seen = {sample(logits, 1.0, 1.0, rng) for _ in range(200)}
    assert seen == {0, 1}
