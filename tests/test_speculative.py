"""Speculative decoding: greedy output equals plain decoding in every mode, rejected drafts leave no trace in the
KV cache, sampling keeps the model's distribution, the window policy after a verification, CLI and errors."""

import json

import numpy as np
import pytest

import flashllm
from flashllm.cli.main import main
from flashllm.errors import FlashLLMError
from flashllm.speculative import PromptLookup, accept, next_draft_length
from tiny import TEXT, make_hf_model, save_checkpoint

NEW = 24  # (the tiny models hold 64 positions)
# (family, load options): dense, sparse with an exact predictor (a small window and cache: rows are evicted and
# read again), MoE with experts streamed through fewer slots than experts
CASES = {"opt-dense": ("opt", dict(mode="dense")),
         "llama-dense": ("llama", dict(mode="dense")),
         "opt-sparse": ("opt", dict(mode="sparse", predictor="oracle", window=2, cache_rows=(100, 100))),
         "llama-relu-sparse": ("llama-relu", dict(mode="sparse", predictor="oracle", window=1)),
         "mixtral-moe": ("mixtral", dict(mode="sparse", dram_budget="75%")),
         "qwen2_moe-moe": ("qwen2_moe", dict(mode="sparse", dram_budget="75%")),
         "llama-relu-sparse-mlx": ("llama-relu", dict(backend="mlx", mode="sparse", predictor="oracle", window=1)),
         "mixtral-moe-mlx": ("mixtral", dict(backend="mlx", mode="sparse", dram_budget="75%"))}


def load(tiny_models, case):
    family, options = CASES[case]
    if options.get("backend") == "mlx":
        pytest.importorskip("mlx.core", reason="mlx is not installed (pip install -e '.[mlx]')")
    return flashllm.load(tiny_models(family).model_dir, **options)


def prompt_ids(model) -> list[int]:
    return model.tokenizer.encode(TEXT)[:12]


class Oracle:
    """Drafts the plain greedy continuation, wrong at its last drafted token on every other call: verifications
    then accept some drafts and reject others (in random models prompt lookup may find only one kind)."""

    def __init__(self, prompt: list[int], plain: list[int]):
        self.prompt, self.plain, self.calls = prompt, plain, 0

    def draft(self, ids, k, temperature, top_p, rng):
        done = len(ids) - len(self.prompt)
        drafts = list(self.plain[done:done + k])
        self.calls += 1
        if drafts and self.calls % 2:
            drafts[-1] = (drafts[-1] + 1) % 90 + 3
        return drafts, [None] * len(drafts)


@pytest.mark.parametrize("case", sorted(CASES))
def test_verification_greedy_equals_plain(tiny_models, case):
    """Verifications with accepted and rejected drafts give plain decoding's tokens (rejected drafts leave no
    trace in the KV cache, the sparse window or the expert cache that changes the output)."""
    model = load(tiny_models, case)
    ids = prompt_ids(model)
    plain = list(model.generate_ids(ids, NEW))
    fast = list(model.generate_ids(ids, NEW, speculative=dict(draft=Oracle(ids, plain), num_draft_tokens=3)))
    stats = model.stats
    assert fast == plain
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"]
    assert stats["forward_passes"] < NEW - 1  # fewer passes than plain decoding's one per token
    assert stats["decode_tokens"] == NEW - 1  # the first token comes from the prompt
    assert stats["acceptance_rate"] == stats["accepted_tokens"] / stats["draft_tokens"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_prompt_lookup_greedy_equals_plain(tiny_models, case):
    model = load(tiny_models, case)
    text = prompt_ids(model)
    ids = text + list(model.generate_ids(text, 10)) + text  # repeats: prompt lookup finds drafts
    plain = list(model.generate_ids(ids, NEW))
    for how in (dict(num_draft_tokens=3), dict(num_draft_tokens=5, adaptive=True)):
        assert list(model.generate_ids(ids, NEW, speculative=how)) == plain
        assert model.stats["draft_tokens"] > 0


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """A tiny OPT model (another family, the same tokenizer): a draft model whose drafts are mostly wrong."""
    from flashllm.converters import convert

    root = tmp_path_factory.mktemp("draft")
    ckpt = save_checkpoint(make_hf_model("opt", seed=1), "opt", root / "hf")
    return convert(ckpt, root / "flash", dtype="float32", progress=False)


def test_draft_model_greedy_equals_plain(tiny_models, other_model):
    """A wrong draft model changes nothing but the acceptance rate; the model itself as its own draft model
    is accepted every time."""
    model_dir = tiny_models("llama").model_dir
    plain_model = flashllm.load(model_dir)
    ids = prompt_ids(plain_model)
    plain = list(plain_model.generate_ids(ids, NEW))
    for draft, accepted_all in ((other_model, False), (model_dir, True)):
        model = flashllm.load(model_dir, speculative=dict(draft=str(draft), num_draft_tokens=4))
        assert list(model.generate_ids(ids, NEW)) == plain
        stats = model.stats
        assert (stats["acceptance_rate"] == 1.0) == accepted_all
        assert stats["draft_model_bytes"] > 0 and stats["dram_bytes"] > plain_model.stats["dram_bytes"]


def test_draft_model_charged_to_the_budget(tiny_models, other_model):
    """The draft model's memory is taken from the budget that sizes the neuron caches."""
    model_dir = tiny_models("opt").model_dir
    options = dict(mode="sparse", predictor="oracle")
    draft_bytes = flashllm.load(other_model).stats["dram_bytes"]
    budget = draft_bytes + flashllm.load(model_dir, **options).stats["dram_bytes"]  # every cache full
    plain = flashllm.load(model_dir, dram_budget=budget, **options)
    drafted = flashllm.load(model_dir, dram_budget=budget, speculative=str(other_model), **options)
    assert sum(drafted.stats["cache_capacity"]) < sum(plain.stats["cache_capacity"])
    assert drafted.stats["dram_bytes"] <= budget
    with pytest.raises(FlashLLMError, match="draft model"):
        flashllm.load(model_dir, dram_budget=draft_bytes, speculative=str(other_model), **options)


def test_rejected_drafts_leave_the_kv_cache_as_plain_decoding(tiny_models):
    """After a verification whose drafts are all rejected, the next logits are those of plain decoding."""
    model = flashllm.load(tiny_models("llama").model_dir)
    ids = prompt_ids(model)
    want = model.logits(ids + [5, 6], prefill=len(ids))[-1]
    model.forward(ids, 0)
    model.forward([5, 40, 41, 42], len(ids), verify=True)  # 40, 41, 42: drafts, rejected
    got = model.forward([6], len(ids) + 1)[-1]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_sampling_keeps_the_distribution():
    """The accept/reject rule yields tokens distributed as the model's p, for a deterministic draft (prompt
    lookup) and for a sampled draft with its own distribution q."""
    rng = np.random.default_rng(0)
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    p = np.exp(logits[0])
    q = np.array([0.1, 0.2, 0.3, 0.4])
    n = 20000
    for sampled in (False, True):
        counts = np.zeros(4)
        for _ in range(n):
            draft = int(rng.choice(4, p=q)) if sampled else 2  # a deterministic draft: an unlikely token
            counts[accept(logits, [draft], [q if sampled else None], 1.0, 1.0, rng)[0]] += 1
        assert np.abs(counts / n - p).max() < 0.015, counts / n  # binomial sd at n=20000: <= 0.0036
    greedy = accept(logits, [1], [None], 0.0, 1.0, rng)
    assert greedy == [0]  # rejected: the argmax instead


def test_prompt_lookup_drafts_what_followed_the_latest_match():
    lookup = PromptLookup(max_ngram=2)
    ids = [1, 2, 3, 4, 9, 2, 3, 7, 8, 5, 2, 3]
    assert lookup.draft(ids, 3, 0.0, 1.0, None)[0] == [7, 8, 5]  # "2 3" last seen before 7 8 5
    assert lookup.draft([1, 2, 3], 3, 0.0, 1.0, None) == ([], [])  # nothing repeats
    assert lookup.draft([4, 1, 2, 1], 3, 0.0, 1.0, None)[0] == [2, 1]  # a 1-gram match, cut at the text's end


def test_prompt_lookup_min_ngram_and_adaptive_length():
    ids = [1, 2, 3, 4, 9, 2, 3, 7, 8, 5, 6, 3]
    assert PromptLookup(3, 1).draft(ids, 2, 0.0, 1.0, None)[0] == [7, 8]  # only "3" matches
    assert PromptLookup(3, 2).draft(ids, 2, 0.0, 1.0, None) == ([], [])  # "6 3" does not
    assert next_draft_length(4, 4, 4, 8) == 5  # all accepted: one more
    assert next_draft_length(8, 8, 8, 8) == 8  # (at most the most)
    assert next_draft_length(5, 5, 1, 8) == 2  # one accepted: two next time
    assert next_draft_length(3, 3, 0, 8) == 1


@pytest.mark.parametrize("policy", ["accepted", "verified"])
def test_window_after_verification(tiny_models, policy):
    """The sparse window counts the kept positions as tokens; "accepted" forgets the neurons only rejected
    positions predicted, "verified" keeps them as the last kept token's."""
    model = flashllm.load(tiny_models("opt").model_dir, mode="sparse", predictor="oracle", window=3)
    ids = prompt_ids(model)
    model.forward(ids, 0)
    caches = model.mode_impl.caches
    before = [c.token for c in caches]
    masks = {}
    with model.hooks.observing("predict", lambda layer, mask: masks.__setitem__(layer, mask.copy())):
        model.forward([5, 40, 41, 42], len(ids), verify=True)
    prior = [c.last_active.copy() for c in caches]
    model.mode_impl.keep_verified(2, policy)  # position 0 and one draft kept, two drafts rejected
    for layer, cache in enumerate(caches):
        assert cache.token == before[layer] + 2
        mask = masks[layer]
        kept, rejected_only = mask[:2].any(axis=0), mask[2:].any(axis=0) & ~mask[:2].any(axis=0)
        assert rejected_only.any()
        assert (cache.last_active[mask[1]] == before[layer] + 2).all()
        later = mask[1:].any(axis=0) if policy == "verified" else mask[1]  # "verified": rejected rows count as row 1
        assert (cache.last_active[mask[0] & ~later] == before[layer] + 1).all()
        if policy == "verified":
            assert (cache.last_active[rejected_only] == before[layer] + 2).all()
        else:
            assert (cache.last_active[rejected_only] <= before[layer]).all()
            assert (cache.last_active[rejected_only] < prior[layer][rejected_only]).all()
        assert kept.any()


def test_cli_generate_with_prompt_lookup(tiny_models, capsys):
    model_dir = str(tiny_models("opt").model_dir)
    prompt = TEXT[:40]
    main(["generate", model_dir, "--prompt", prompt, "--max-new-tokens", "20", "--json"])
    plain = json.loads(capsys.readouterr().out)
    main(["generate", model_dir, "--prompt", prompt, "--max-new-tokens", "20", "--json", "--prompt-lookup",
          "--num-draft-tokens", "3"])
    fast = json.loads(capsys.readouterr().out)
    assert fast["token_ids"] == plain["token_ids"] and fast["text"] == plain["text"]
    for key in ("draft_tokens", "accepted_tokens", "acceptance_rate", "forward_passes", "bytes_per_generated_token"):
        assert key in fast["stats"] and key not in plain["stats"]
    main(["generate", model_dir, "--prompt", prompt, "--max-new-tokens", "8", "--stats", "--prompt-lookup"])
    assert "drafted tokens accepted" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--num-draft-tokens", "3"], "speculative decoding is off"),
    (["--draft-model", "/nonexistent/draft"], "/nonexistent/draft"),
    (["--prompt-lookup", "--num-draft-tokens", "0"], "--num-draft-tokens"),
])
def test_cli_speculative_errors(tiny_models, capsys, argv, message):
    try:
        code = main(["generate", str(tiny_models("opt").model_dir), "--prompt", "hi", *argv])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    err = capsys.readouterr().err
    assert code != 0 and message in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_api_errors(tiny_models, other_model):
    model_dir = tiny_models("opt").model_dir
    with pytest.raises(FlashLLMError, match="unknown field"):
        flashllm.load(model_dir, speculative=dict(drafts=3))
    with pytest.raises(FlashLLMError, match="batch_size"):
        flashllm.load(model_dir, speculative=True, batch_size=2)
    with pytest.raises(FlashLLMError, match="window_policy"):
        flashllm.load(model_dir, speculative=dict(window_policy="newest"))
    model = flashllm.load(model_dir)
    with pytest.raises(FlashLLMError, match="load the model with it"):
        list(model.generate_ids([3, 4, 5], 4, speculative=str(other_model)))


def test_bench_runs_and_checks_the_tokens(tmp_path):
    """bench speculative (tiny sizes): plain and speculative rows, the same tokens as plain checked; the sweep."""
    from bench import speculative

    rows = speculative.main(["--tokens", "6", "--rounds", "1", "--ks", "2", "--prompts", "code-short", "--models", "moe",
                             "--out", str(tmp_path / "t")])
    assert [r["k"] for r in rows] == [0, 2, 2] and all(r["same_as_plain"] for r in rows)
    assert (tmp_path / "t.md").is_file() and (tmp_path / "t.json").is_file()
    sweep = speculative.main(["--tokens", "6", "--ks", "2", "--prompts", "code-short", "--models", "moe",
                              "--sweep", "0,1"])
    assert [r["acceptance_rate"] for r in sweep if r["rate"] == 1] == [1.0, 1.0]  # MoE is exact: all accepted
