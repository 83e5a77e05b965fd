"""`flashllm demo`: convert the embedded small model, then generate in sparse mode at half its size
and compare with the naive baseline (every layer read from flash per token). `flashllm demo --moe`:
the embedded small mixture-of-experts model, its experts streamed at half its size, against dense."""

from __future__ import annotations

import hashlib
import shutil
import warnings
from pathlib import Path

from flashllm.format import manifest as fmt
from flashllm.errors import DroppedNeuronsWarning, FlashLLMError
from flashllm.paths import cache_home
from flashllm.modes.sparse.predictor import PREDICTOR_META

DATA = Path(__file__).resolve().parents[1] / "data"  # flashllm/data: the embedded models
EMBEDDED = DATA / "tiny-opt"
EMBEDDED_PREDICTORS = DATA / "tiny-opt-predictors"
EMBEDDED_MOE = DATA / "tiny-moe"
# The embedded SwiGLU model and what `flashllm predictors train --sparsity 0.4` wrote for it: calibrated
# thresholds (sparsity.json) and low-rank predictors. It is sparse only through those thresholds.
EMBEDDED_SWIGLU = DATA / "tiny-swiglu"
EMBEDDED_SWIGLU_SPARSITY = DATA / "tiny-swiglu-sparsity"
PROMPT = "def read_config(path):\n    \"\"\"Read a configuration file and return"


# Each layer's neurons in co-activation order (`flashllm predictors order` on the stdlib corpus' train split,
# written by `python bench/neuron_order.py --ship`): neurons the predictors select together are adjacent on
# flash, so a token's missing bundles take fewer reads. A permutation: the model's function is unchanged.
ORDER_FILE = "neuron_order.safetensors"


def prepare(out: Path | None = None, embedded: Path = EMBEDDED, extras: Path = EMBEDDED_PREDICTORS,
            order: bool = True) -> Path:
    """The converted embedded model with its shipped predictors (and thresholds, if any: every file of
    `extras`) and, with `order`, in the neuron order `extras` ships, if any; converted once, then reused
    (again when the shipped order differs from the directory's)."""
    from flashllm.converters import convert

    out = out or cache_home() / embedded.name
    if not (embedded / "config.json").is_file():
        raise FlashLLMError(f"{embedded}: the embedded model is missing from this installation")
    shipped = extras / ORDER_FILE if order and (extras / ORDER_FILE).is_file() else None
    want = hashlib.sha256(shipped.read_bytes()).hexdigest() if shipped else None
    try:
        have = fmt.read_manifest(out).data.get("neuron_order", {}).get("shipped_sha256")
        ready = (out / PREDICTOR_META).is_file() and have == want
    except FlashLLMError:
        ready = False
    if not ready:
        convert(embedded, out, dtype="float32", force=True)
        names = sorted(f.name for f in extras.iterdir() if f.name not in (PREDICTOR_META, ORDER_FILE))
        for name in names + [PREDICTOR_META]:  # the file that marks the directory ready comes last
            shutil.copyfile(extras / name, out / name)
        if shipped:
            from flashllm.predictors.reorder import apply_order
            from flashllm.format.safetensors_io import SafetensorsFile

            st = SafetensorsFile(shipped)
            perms = [st.read(f"layers.{i}.perm") for i in range(len(st.entries))]
            apply_order(out, perms, {"method": "coactivation", "shipped_sha256": want,
                                     "source": f"{shipped.name} shipped with the embedded model"}, progress=False)
    return out


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


def prepare_moe(out: Path | None = None) -> Path:
    """The converted embedded MoE model (converted once per checkpoint, then reused: the cache directory
    is named by the checkpoint's hash, so a newer embedded model is converted again)."""
    from flashllm.converters import convert

    weights = EMBEDDED_MOE / "model.safetensors"
    if not (EMBEDDED_MOE / "config.json").is_file() or not weights.is_file():
        raise FlashLLMError(f"{EMBEDDED_MOE}: the embedded MoE model is missing from this installation")
    out = out or cache_home() / f"tiny-moe-{hashlib.sha256(weights.read_bytes()).hexdigest()[:12]}"
    try:
        fmt.read_manifest(out)
    except FlashLLMError:
        convert(EMBEDDED_MOE, out, dtype="float16", force=True)
    return out


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
