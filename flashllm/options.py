"""How a model is loaded: one frozen options object shared by the Python API, the CLI and bench."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from flashllm.budget import parse_budget
from flashllm.errors import FlashLLMError

BACKENDS = ("torch", "mlx")
DTYPES = ("float32", "float16", "bfloat16")
ON_OVERFLOW = ("drop", "error")
KERNELS = ("tuned", "plain")
QUANTIZE_RESIDENT = ("none", "int8", "int4")
KV_BITS = (8, 16)
# The names of the registries the runtime builds from (tests check each registry against its names).
MODES = ("dense", "naive", "hybrid", "sparse")  # modes.registry.MODES; MoE models take dense and sparse
EXPERT_POLICIES = ("lru", "lfu", "window")  # modes.moe: which cached expert a new one replaces
PREDICTORS = ("auto", "lowrank", "oracle", "gate")  # modes.sparse.predictor.PREDICTORS, and auto
PROMPT_LOOKUP = "prompt-lookup"  # Speculation.draft: n-gram drafting from the text so far (else a draft model's directory)
# Speculation.window_policy: after a verification the sparse window keeps the neurons of the accepted positions
# (the paper's policy), or of every verified position, rejected drafts included
WINDOW_POLICIES = ("accepted", "verified")


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding: draft `num_draft_tokens` tokens, then verify them in one forward pass (one read of
    each layer's weights for all of them); exact at any temperature (docs/speculative.md)."""

    # prompt-lookup, a converted draft model's directory (the same tokenizer), or a drafter object (benchmarks,
    # tests): draft(ids, k, temperature, top_p, rng) -> (up to k ids, their draft distributions or None each)
    draft: object = PROMPT_LOOKUP
    num_draft_tokens: int = 4  # K: tokens drafted per verification
    max_ngram: int = 3  # prompt lookup: the longest suffix matched (then shorter ones, down to min_ngram)
    min_ngram: int = 1
    # after a rejection draft one more than were accepted, after a full acceptance one more (up to
    # num_draft_tokens); False: always num_draft_tokens. The defaults (K 4, adaptive): fewer bytes per token and as
    # fast or faster than fixed lengths on the embedded models (docs/speculative.md, "Measured")
    adaptive: bool = True
    window_policy: str = "accepted"  # sparse mode: whose neurons the window keeps after a verification

    def __post_init__(self):
        if not (callable(getattr(self.draft, "draft", None)) or isinstance(self.draft, str) and self.draft):
            raise FlashLLMError(f"speculative draft {self.draft!r}: expected {PROMPT_LOOKUP} or a draft model directory")
        if not isinstance(self.num_draft_tokens, int) or not 1 <= self.num_draft_tokens <= 64:
            raise FlashLLMError(f"num_draft_tokens {self.num_draft_tokens}: expected 1 to 64 tokens drafted per "
                                f"verification")
        if not (isinstance(self.max_ngram, int) and isinstance(self.min_ngram, int) and 1 <= self.min_ngram <= self.max_ngram):
            raise FlashLLMError(f"min_ngram {self.min_ngram}, max_ngram {self.max_ngram}: expected 1 <= min_ngram <= "
                                f"max_ngram (tokens matched by prompt lookup)")
        if self.window_policy not in WINDOW_POLICIES:
            raise FlashLLMError(f"window_policy {self.window_policy!r}: expected one of {', '.join(WINDOW_POLICIES)}")

    @property
    def lookup(self) -> bool:
        """Drafting by prompt lookup (no draft model)."""
        return self.draft == PROMPT_LOOKUP

    @classmethod
    def of(cls, value) -> "Speculation | None":
        """None/False: off; True: prompt lookup; a string: prompt-lookup or a draft model directory; a dict of
        fields; or a Speculation."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(draft=value)
        if isinstance(value, dict):
            unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
            if unknown:
                raise FlashLLMError(f"speculative: unknown field(s) {', '.join(unknown)}; expected "
                                    f"{', '.join(f.name for f in dataclasses.fields(cls))}")
            return cls(**value)
        if hasattr(value, "__fspath__"):
            return cls(draft=str(value))
        raise FlashLLMError(f"speculative {value!r}: expected True, {PROMPT_LOOKUP!r}, a draft model directory, a "
                            f"dict of Speculation fields, or None")


@dataclass(frozen=True)
class LoadOptions:
    """Everything `flashllm.load` takes besides the model directory; validated on construction.

    Budgets are parsed by `budget.parse_budget` (None: unlimited, the default everywhere).
    """

    backend: str = "torch"
    device: str | None = None  # None: torch cpu, mlx Metal where present
    mode: str = "dense"  # one of MODES
    # sparse mode: auto, one of PREDICTORS, or a builder; auto: the resident gate rows for a
    # gated FFN with calibrated thresholds (when the budget holds them), else the low-rank predictors
    predictor: str | Callable = "auto"
    dram_budget: float | int | str | None = None
    gpu_budget: float | int | str | None = None
    window: int = 4  # sparse: tokens whose neurons stay cached
    threads: int = 32  # flash reads in flight
    # > 0: native AIO with this many reads in flight; 0: blocking reads in `threads` threads; None: native AIO
    # for sparse mode's FFN reads (measured faster: docs/architecture.md, "Defaults"), threads otherwise
    aio_depth: int | None = None
    gap_bytes: int | None = 0  # read through file gaps up to this size (None: the disk profile's cost model)
    # read-ahead: read layer l+1's weights (sparse: the neurons predicted from layer l's residual stream) while
    # layer l computes; None: on for naive and hybrid, and for sparse where the reads land in cache rows through
    # native AIO (the measured default: docs/architecture.md, "Defaults")
    read_ahead: bool | None = None
    # sparse read-ahead: a layer reads ahead only the neurons above the lowest score cut whose running precision
    # (share of the lookahead's neurons the layer then needs) is at least this; 0: always the lowest cut; above 1:
    # none (every layer paused, the lookahead still measured); None: the runtime's default (ReadAhead.PRECISION)
    read_ahead_precision: float | None = None
    dtype: str | None = None  # compute dtype; None: the storage dtype
    context: int | None = None  # KV cache length; None: min(model, 4096)
    verify: bool | None = None  # checksums at load: None small files (FFN layers verified on first full read)
    hybrid_fraction: float | None = None  # hybrid: resident share of each FFN (None: sized by the budget)
    cache_rows: tuple[int, ...] | None = None  # sparse: neuron cache rows per layer (None: sized by the budget)
    # sparse: keep each layer's most frequently active neurons cached for good (PowerInfer), as many as the
    # cache holds beside the window's expected need (needs the frequencies `predictors train` saves)
    pin_hot: bool = True
    on_overflow: str = "drop"  # sparse: when a token's predicted set exceeds a cache, drop (warned) or error
    expert_policy: str = "lru"  # MoE sparse: which cached expert a new one replaces (EXPERT_POLICIES)
    expert_read_ahead: bool = False  # MoE sparse: read layer l+1's predicted experts while layer l computes
    # MoE: (layer, router logits [T, n_experts], early) -> expert ids [T, top_k] chosen instead of the router's
    # top-k (e.g. routing replayed from a trace; `early`: a read-ahead guess); None: the router decides
    expert_routing: Callable | None = None
    # tuned: projections fused at load and the kernel per dtype measured
    # fastest (same math); plain: the file's tensors as they are with torch's default kernels (reference)
    kernels: str = "tuned"
    # intra-op threads of the math (torch CPU); None: every core the process may run on (backends.base.compute_threads)
    compute_threads: int | None = None
    quantize_resident: str = "none"  # hold attention, embedding and lm_head matrices as int8/int4 (at load)
    kv_bits: int = 16  # 8: KV cache in int8 groups along the head dim; 16: the compute dtype
    batch_size: int = 1  # sequences decoded together (Model.generate_batch), each with its own KV cache
    # speculative decoding for generate/stream/chat (Speculation.of: True, "prompt-lookup", a draft model dir, ...)
    speculative: Speculation | None = None

    def __post_init__(self):
        def check(ok: bool, what: str):
            if not ok:
                raise FlashLLMError(what)

        check(self.backend in BACKENDS, f"backend {self.backend!r}: expected one of {', '.join(BACKENDS)}")
        check(self.mode in MODES, f"mode {self.mode!r}: expected one of {', '.join(MODES)}")
        check(callable(self.predictor) or self.predictor in PREDICTORS,
              f"predictor {self.predictor!r}: expected one of {', '.join(PREDICTORS)}")
        check(self.dtype is None or self.dtype in DTYPES, f"dtype {self.dtype!r}: expected one of {', '.join(DTYPES)}")
        check(self.expert_policy in EXPERT_POLICIES,
              f"expert_policy {self.expert_policy!r}: expected one of {', '.join(EXPERT_POLICIES)}")
        check(self.expert_routing is None or callable(self.expert_routing),
              f"expert_routing {self.expert_routing!r}: expected None or a function (layer, logits, early) -> ids")
        check(self.quantize_resident in QUANTIZE_RESIDENT,
              f"quantize_resident {self.quantize_resident!r}: expected one of {', '.join(QUANTIZE_RESIDENT)}")
        check(self.kv_bits in KV_BITS, f"kv_bits {self.kv_bits!r}: expected 8 (int8 KV cache) or 16 (compute dtype)")
        check(self.kernels in KERNELS, f"kernels {self.kernels!r}: expected tuned or plain")
        check(self.on_overflow in ON_OVERFLOW, f"on_overflow {self.on_overflow!r}: expected drop or error")
        check(isinstance(self.window, int) and self.window >= 1,
              f"window {self.window}: must be at least 1 (tokens whose neurons stay cached)")
        check(isinstance(self.threads, int) and self.threads >= 1, f"threads {self.threads}: must be at least 1")
        check(self.compute_threads is None or isinstance(self.compute_threads, int) and self.compute_threads >= 1,
              f"compute_threads {self.compute_threads}: must be at least 1 (or None: by the machine's load)")
        check(self.aio_depth is None or isinstance(self.aio_depth, int) and self.aio_depth >= 0,
              f"aio_depth {self.aio_depth}: must be >= 0 (or None: native AIO for sparse read-ahead)")
        check(self.gap_bytes is None or isinstance(self.gap_bytes, int) and self.gap_bytes >= 0,
              f"gap_bytes {self.gap_bytes}: must be >= 0 (or None: from the disk profile)")
        check(isinstance(self.batch_size, int) and self.batch_size >= 1,
              f"batch_size {self.batch_size}: must be at least 1 (sequences decoded together)")
        check(self.context is None or self.context >= 1, f"context {self.context}: must be at least 1")
        check(self.read_ahead_precision is None or isinstance(self.read_ahead_precision, (int, float)) and
              0 <= self.read_ahead_precision <= 2,
              f"read_ahead_precision {self.read_ahead_precision}: expected a share in [0, 1] (above 1, up to 2: "
              f"never read ahead), or None for the default")
        check(self.hybrid_fraction is None or 0 <= self.hybrid_fraction <= 1,
              f"hybrid_fraction {self.hybrid_fraction}: expected a value in [0, 1]")
        check(self.cache_rows is None or (len(self.cache_rows) > 0 and all(isinstance(r, int) and r >= 1
                                                                          for r in self.cache_rows)),
              f"cache_rows {self.cache_rows}: expected one whole number of at least 1 per layer")
        check(self.cache_rows is None or self.mode == "sparse",
              f"cache_rows (--cache-rows) sizes the neuron caches of sparse mode; mode {self.mode!r} has none "
              f"(drop it, or use mode sparse)")
        for name in ("dram_budget", "gpu_budget"):
            object.__setattr__(self, name, parse_budget(getattr(self, name)))
        object.__setattr__(self, "speculative", Speculation.of(self.speculative))
        check(self.speculative is None or self.batch_size == 1,
              f"speculative decoding verifies one sequence's drafts; batch_size {self.batch_size} decodes several "
              f"(drop one of them)")

    def replace(self, **changes) -> "LoadOptions":
        return dataclasses.replace(self, **changes)

    @classmethod
    def of(cls, options: "LoadOptions | None" = None, **changes) -> "LoadOptions":
        """`options` (or the defaults) with keyword changes; unknown names are a clear error."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(changes) - fields)
        if unknown:
            raise FlashLLMError(f"unknown load option(s) {', '.join(unknown)}; expected {', '.join(sorted(fields))}")
        return dataclasses.replace(options or cls(), **changes)
