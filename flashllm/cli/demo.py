"""`flashllm demo`: convert the embedded small model, then generate in sparse mode at half its size
and compare with the naive baseline (every layer read from flash per token). `flashllm demo --moe`:
the embedded small mixture-of-experts model, its experts streamed at half its size, against dense."""

from __future__ import annotations

import json
import sys
import warnings

from flashllm.cli.args import count
from flashllm.embedded import EMBEDDED_SWIGLU, EMBEDDED_SWIGLU_SPARSITY, prepare, prepare_moe
from flashllm.embedded import EMBEDDED, EMBEDDED_MOE, EMBEDDED_PREDICTORS, ORDER_FILE  # noqa: F401 (benchmarks use them)
from flashllm.errors import DroppedNeuronsWarning, FlashLLMError

PROMPT = "def read_config(path):\n    \"\"\"Read a configuration file and return"


def add_parser(sub) -> None:
    """The `flashllm demo` subcommand."""
    from flashllm.options import BACKENDS, LoadOptions

    d = sub.add_parser("demo", help="convert the embedded small model and run it at half its size",
                       description="Convert the embedded small ReLU model (into $FLASHLLM_CACHE, else "
                       "$XDG_CACHE_HOME/flashllm or ~/.cache/flashllm), generate in sparse mode at a DRAM budget of "
                       "50% of the model, and compare bytes read and latency per token with naive mode (--moe, "
                       "--swiglu: the other embedded models).")
    d.add_argument("--max-new-tokens", type=count, default=48, help="tokens to generate in sparse mode, at "
                   "least 2 (default: %(default)s)")
    d.add_argument("--json", action="store_true", help="print one JSON object: model_dir, text, stats "
                   "(default: off)")
    d.add_argument("--backend", default=LoadOptions.backend, choices=BACKENDS, help="array library: torch (CPU), "
                   "or mlx (Metal on Apple silicon; on Linux its CPU build, 10-30x slower than torch) "
                   "(default: %(default)s)")
    which = d.add_mutually_exclusive_group()
    which.add_argument("--moe", action="store_true", help="the embedded mixture-of-experts model instead (4 layers, "
                   "16 experts, top-2): experts streamed at 50%% of its size, compared with dense (default: off)")
    which.add_argument("--swiglu", action="store_true", help="the embedded SwiGLU (Llama-style) model instead, "
                   "sparse through its shipped thresholds (--sparsity 0.4), at 50%% of its size (default: off)")
    d.set_defaults(func=command)


def command(args) -> None:
    if args.max_new_tokens < 2:  # the first new token comes from the prompt's forward: no decode token to compare
        raise FlashLLMError(f"--max-new-tokens {args.max_new_tokens}: the demo compares decode tokens, so it needs at "
                            "least 2 (the first new token comes from the prompt)")
    if args.moe:
        result = run_moe(max_new_tokens=args.max_new_tokens, backend=args.backend)
        print(json.dumps(result) if args.json else report_moe(result))
        return
    result = run(max_new_tokens=args.max_new_tokens, swiglu=args.swiglu, backend=args.backend)
    print(json.dumps(result) if args.json else report(result))
    note = dropped_note(result)
    if args.json and note:  # the report ends with it; with --json it goes to stderr
        print(f"flashllm: warning: {note}", file=sys.stderr)


# The embedded model is stored as float32 on flash; computing in bfloat16 halves what the resident
# part (embeddings and attention: 47% of this small model) holds in DRAM, so 50% fits.
SETTINGS = dict(dtype="bfloat16", context=256)


def run(prompt: str = PROMPT, max_new_tokens: int = 48, naive_tokens: int = 16, budget: float = 0.5,
        swiglu: bool = False, backend: str = "torch") -> dict:
    """Sparse generation at `budget` of the model size, and a short naive run to compare with, on `backend`.
    The SwiGLU model is sparse through its shipped thresholds; `auto` picks its resident gate rows as the
    predictor."""
    from flashllm import load

    if swiglu:
        model_dir, predictor = prepare(embedded=EMBEDDED_SWIGLU, extras=EMBEDDED_SWIGLU_SPARSITY), "auto"
    else:
        model_dir, predictor = prepare(), "lowrank"
    with warnings.catch_warnings():  # their advice names options the demo lacks: `dropped_note` says it instead
        warnings.simplefilter("ignore", DroppedNeuronsWarning)
        sparse = load(model_dir, mode="sparse", predictor=predictor, dram_budget=budget, window=4, backend=backend,
                      **SETTINGS)
        ids = sparse.tokenizer.encode(prompt)
        new = list(sparse.generate_ids(ids, max_new_tokens))
    text = sparse.tokenizer.decode(new)
    sparse_stats = sparse.stats
    naive = load(model_dir, mode="naive", dram_budget=budget, backend=backend, **SETTINGS)
    list(naive.generate_ids(ids, naive_tokens))
    return {"model_dir": str(model_dir), "prompt": prompt, "text": text, "token_ids": new,
            "stats": {"sparse": sparse_stats, "naive": naive.stats}}


def report(result: dict) -> str:
    """The demo's human-readable output: the text, then sparse vs naive per decode token."""
    s, n = result["stats"]["sparse"], result["stats"]["naive"]
    rows = [("flash read / token (KiB)", s["bytes_read"] / 1024, n["bytes_read"] / 1024),
            ("reads / token", s["reads"], n["reads"]),
            ("I/O / token (ms)", s["io_ms"], n["io_ms"]),
            ("latency / token (ms)", s["total_ms"], n["total_ms"]),
            ("DRAM held (MiB)", s["dram_bytes"] / 2**20, n["dram_bytes"] / 2**20),
            ("neurons dropped / token", s.get("neurons_dropped", 0), n.get("neurons_dropped", 0))]
    lines = _page(f"model: {result['model_dir']} ({s['model_bytes'] / 2**20:.1f} MiB on flash as float32, "
                  f"computed in bfloat16 on {s['backend']}; DRAM budget {s['dram_budget'] / s['model_bytes']:.0%} = "
                  f"{s['dram_budget'] / 2**20:.1f} MiB, window 4)",
                  result, ("sparse", "naive"), rows)
    lines.append(f"sparse vs naive: flash bytes {compare(s['bytes_read'], n['bytes_read'], 'fewer', 'more')}; "
                 f"latency {compare(s['total_ms'], n['total_ms'], 'faster', 'slower')}")
    note = dropped_note(result)
    return "\n".join(lines + ([f"note: {note}"] if note else []))


def dropped_note(result: dict) -> str | None:
    """What sparse mode dropped at the demo's budget and how to measure its cost or pick another budget (the
    runtime's own warning names `--dram-budget` and `--on-overflow`, which the demo does not take); None: none."""
    s = result["stats"]["sparse"]
    if not s.get("neurons_dropped"):
        return None
    share = s.get("dropped_mass_share")
    mass = f" ({share:.1%} of the predicted score mass)" if share is not None else ""
    budget = f"{s['dram_budget'] / s['model_bytes']:.0%}"
    return (f"sparse mode dropped {s['neurons_dropped']:.1f} predicted neurons per decode token{mass}: the demo's "
            f"{budget} budget holds fewer than its predictor selects. `flashllm predictors eval {result['model_dir']} "
            f"--data TEXT --dtype bfloat16 --context 256 --dram-budget {budget}` measures the quality cost; "
            f"`flashllm generate {result['model_dir']} --dram-budget ...` runs another budget")


def _page(header: str, result: dict, columns: tuple[str, str], rows: list) -> list[str]:
    """The demo page's lines: model line, prompt and text, then a per-decode-token table of two columns."""
    return [header, "", result["prompt"] + result["text"], "", f"{'per decode token':<26}{columns[0]:>12}{columns[1]:>12}",
            *(f"{name:<26}{a:>12.2f}{b:>12.2f}" for name, a, b in rows)]


def compare(ours: float, base: float, better: str, worse: str) -> str:
    """'2.1x fewer' or '1.2x more' (lower is better): a ratio of at least 1, in plain words."""
    if ours <= base:
        return f"{base / max(ours, 1e-12):.2f}x {better}"
    return f"{ours / max(base, 1e-12):.2f}x {worse}"


# The MoE model computes in float16 (its storage dtype), so expert reads land in the slots themselves.
MOE_SETTINGS = dict(dtype="float16", context=256)


def run_moe(prompt: str = PROMPT, max_new_tokens: int = 48, budget: float = 0.5, backend: str = "torch") -> dict:
    """Experts streamed at `budget` of the model size (LRU slots, router read-ahead), against all resident, on
    `backend`."""
    from flashllm import load

    model_dir = prepare_moe()
    sparse = load(model_dir, mode="sparse", dram_budget=budget, expert_read_ahead=True, backend=backend, **MOE_SETTINGS)
    ids = sparse.tokenizer.encode(prompt)
    new = list(sparse.generate_ids(ids, max_new_tokens))
    dense = load(model_dir, mode="dense", backend=backend, **MOE_SETTINGS)
    same = list(dense.generate_ids(ids, max_new_tokens)) == new
    return {"model_dir": str(model_dir), "prompt": prompt, "text": sparse.tokenizer.decode(new), "token_ids": new,
            "same_as_dense": same, "stats": {"sparse": sparse.stats, "dense": dense.stats}}


def report_moe(result: dict) -> str:
    """`demo --moe`'s output: the text, then streamed vs dense per decode token, hit rates, exactness."""
    s, d = result["stats"]["sparse"], result["stats"]["dense"]
    rows = [("flash read / token (KiB)", s["bytes_read"] / 1024, d["bytes_read"] / 1024),
            ("experts read / token", s["expert_misses"], 0.0),
            ("latency / token (ms)", s["total_ms"], d["total_ms"]),
            ("DRAM held (MiB)", s["dram_bytes"] / 2**20, d["dram_bytes"] / 2**20)]
    lines = _page(f"model: {result['model_dir']} ({s['model_bytes'] / 2**20:.1f} MiB on flash as float16, "
                  f"computed on {s['backend']}, {len(s['cache_capacity'])} layers; DRAM budget 50% = "
                  f"{s['dram_budget'] / 2**20:.1f} MiB: "
                  f"{s['cache_capacity'][0]} expert slots per layer)", result, ("streamed", "dense"), rows)
    lines.append(f"expert cache hit rate {s['expert_hit_rate']:.3f}; read-ahead recall {s['expert_read_ahead_recall']:.3f}; "
                 f"same tokens as dense: {'yes' if result['same_as_dense'] else 'NO'}")
    return "\n".join(lines)
