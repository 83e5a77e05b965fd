"""All memory-budget arithmetic: parsing `--dram-budget`, what one cached row or layer costs, how
caches are sized, and the "budget too small" error that says what would fit.

A budget is given as
- a fraction of the model's size on flash: a number in (0, 1], or a percentage (`50%`);
- a size with a unit: `6GiB`, `700MiB`, `20M` (K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024;
  KB/MB/GB/TB powers of 1000);
- a plain byte count: a whole number of at least 4096 (one page; nothing smaller holds a layer).
Anything else (`1.5`, `100`, `abc`, `0`, `-1`) is an error. None means unlimited, the default of
both the Python API and the CLI: memory is then sized by the model, not capped.
"""

from __future__ import annotations

import ctypes
import math
import re

from flashllm.errors import FlashLLMError, OptionsError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
MIN_BYTES = 4096
UNITS = {"": 1, "b": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1 << 40, "kib": KiB, "mib": MiB, "gib": GiB,
         "tib": 1 << 40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*|%)\s*$")
FORMS = "a fraction of the model in (0, 1], a percentage (50%), a size (6GiB, 700MiB, 20M) or bytes (>= 4096)"


HEAP_MMAP_THRESHOLD = 1 * MiB  # glibc allocations at least this large get their own mapping


def return_freed_memory() -> bool:
    """Under a DRAM budget: make glibc give every freed block of HEAP_MMAP_THRESHOLD or more back to the
    kernel at once (mallopt M_MMAP_THRESHOLD, which also stops glibc raising that threshold after the
    first large free). By default glibc keeps freed blocks of up to 32 MiB in its heaps, one per
    thread, for reuse: loading a quantized model with 2 compute threads left 450-600 MiB of such
    blocks resident on the opt-1.3b shape, which the budget does not count (and a cgroup limit of the
    budget's size then kills the process). False where the C library has no mallopt."""
    try:
        return bool(ctypes.CDLL(None).mallopt(-3, HEAP_MMAP_THRESHOLD))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def parse_budget(value: str | float | int | None) -> float | int | None:
    """A budget as a fraction (float in (0, 1]) or a byte count (int); None stays None (unlimited)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise FlashLLMError(f"budget {value!r}: expected {FORMS}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        m = _SIZE.match(str(value).lower())
        if not m or m.group(2) not in UNITS and m.group(2) != "%":
            raise FlashLLMError(f"budget {value!r}: expected {FORMS}")
        number, unit = float(m.group(1)), m.group(2)
    if not math.isfinite(number) or number <= 0:
        raise FlashLLMError(f"budget {value!r}: must be positive ({FORMS})")
    if unit == "%":
        if number > 100:
            raise FlashLLMError(f"budget {value!r}: a percentage of the model is at most 100%; give a larger "
                                f"budget as a size (6GiB, 700MiB, 20M)")
        return number / 100
    if unit == "" and number <= 1:
        return number
    nbytes = number * UNITS[unit]
    if unit == "" and (number != int(number) or number < MIN_BYTES):
        raise FlashLLMError(f"budget {value!r}: a plain number above 1 is a byte count and must be a whole "
                            f"number of at least {MIN_BYTES}; expected {FORMS}")
    if nbytes < MIN_BYTES:
        raise FlashLLMError(f"budget {value!r}: {int(nbytes)} bytes is below one page ({MIN_BYTES})")
    return int(nbytes)


def budget_bytes(value: str | float | int | None, model_bytes: int) -> int | None:
    """The budget in bytes (fractions are of `model_bytes`); None: unlimited."""
    parsed = parse_budget(value)
    if parsed is None:
        return None
    return int(parsed * model_bytes) if isinstance(parsed, float) else parsed


def format_size(nbytes: int) -> str:
    """A size `parse_budget` accepts, rounded up (so that a suggested budget really fits)."""
    for unit, mult in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= mult:
            return f"{math.ceil(nbytes / mult * 100) / 100:.2f}{unit}"
    return str(max(nbytes, MIN_BYTES))


class BudgetTooSmall(OptionsError):
    """A budget below what a mode needs; the message names the smallest budget that works and the options
    that lower it, as the Python API's keywords (`str()`) or the CLI's flags (`cli_message()`)."""

    def __init__(self, template: str, needed: int | None = None):
        super().__init__(template)
        self.needed = needed  # the smallest budget, for callers that try several modes (flashllm plan)


def too_small(budget: int, needed: int, what: str, model_bytes: int, hints: list[str], option: str = "dram_budget"):
    """The error for a budget below `needed` bytes, with the smallest budget and what lowers it. `option`
    is the budget's LoadOptions field; `hints` are `errors.name_options` templates."""
    lower = f"; lower it with {' or '.join(hints)}" if hints else ""
    share = f" ({needed / model_bytes:.0%} of the model)" if needed <= model_bytes else \
        (f", more than the model's {format_size(model_bytes)} on flash: {what} fit in no share of the model "
         f"(no fraction or percentage works, only a size)")  # a percentage above 100% is refused by parse_budget
    return BudgetTooSmall(f"{{{option}={format_size(budget)}}} is too small: {what} need {format_size(needed)}; "
                          f"the smallest budget that works here is {{{option}={format_size(needed)}}}{share}{lower}",
                          needed)


def lowering_hints(mode: str, itemsize: int, kv_bytes: int, needed: int,
                   widened: tuple[str, str, str] | None = None) -> list[str]:
    """Options that lower what a mode needs: a 2-byte compute dtype, a shorter context, a leaner mode
    (`errors.name_options` templates). `widened`: (storage dtype, compute dtype, backend) where a 16-bit
    file computes in a wider dtype by default (float16 files on MLX's CPU build), which the hint says."""
    hints = []
    if itemsize > 2 and widened:
        storage, compute, backend = widened
        hints.append(f"{{dtype={storage}}} (this {storage} file computes in {compute} by default with "
                     f"{{backend={backend}}} here, which doubles resident weights and caches)")
    elif itemsize > 2:
        hints.append("{dtype=bfloat16} (halves resident weights and caches)")
    if kv_bytes > needed // 8:
        hints.append("a smaller {context} (the KV cache is sized by it)")
    if mode in ("dense", "hybrid"):
        hints.append("{mode=sparse} or {mode=naive}")
    return hints


def charged(host: int, device: int, on_gpu: bool) -> int:
    """The bytes of (host, device) charged to the budget that sizes the caches: on a GPU only the
    device side (the host side is charged to the DRAM budget separately)."""
    return device if on_gpu else host + device


def row_bytes(layout, reads_in_place: bool, compute_itemsize: int) -> int:
    """DRAM one cached neuron costs: its bundle in the compute dtype plus its per-row biases."""
    elems = len(layout.parts) * layout.d_model  # values per bundle (quantized ones are dequantized)
    row = layout.stride if reads_in_place else elems * compute_itemsize
    return row + 2 * compute_itemsize


def split_rows(total: int, weights: list[float], cap: int) -> list[int]:
    """Share `total` cache rows among layers in proportion to `weights`, at most `cap` each;
    rows a capped layer cannot use go to the others."""
    rows, open_ = [0] * len(weights), list(range(len(weights)))
    while open_ and sum(rows) < total:
        left, wsum = total - sum(rows), sum(weights[i] for i in open_)
        for i in open_:
            rows[i] = min(cap, rows[i] + max(1, int(left * weights[i] / wsum)))
        open_ = [i for i in open_ if rows[i] < cap]
    excess = sum(rows) - total  # the max(1, ...) above may overshoot by a few rows
    for i in sorted(range(len(rows)), key=lambda i: -rows[i])[:max(excess, 0)]:
        rows[i] -= 1
    return rows


def sparse_capacities(avail: int, row: int, n_layers: int, d_ffn: int, need: list[float] | None) -> list[int]:
    """Cache rows per layer from the bytes left for caches (None: unlimited, every neuron)."""
    if avail is None:
        return [d_ffn] * n_layers
    return split_rows(avail // row, need or [1.0] * n_layers, d_ffn)


def given_capacities(rows, avail: int | None, row: int, n_layers: int, d_ffn: int) -> list[int]:
    """Cache rows per layer as given (a plan's choice), checked against the layers and the bytes left."""
    rows = [min(int(r), d_ffn) for r in rows]
    if len(rows) != n_layers:
        raise FlashLLMError(f"cache_rows: {len(rows)} values for a model of {n_layers} layers")
    if avail is not None and sum(rows) * row > avail:
        raise FlashLLMError(f"cache_rows: {sum(rows)} rows need {format_size(sum(rows) * row)} but the budget leaves "
                            f"{format_size(max(avail, 0))} for caches (plan again for this budget)")
    return rows


def hybrid_resident_rows(avail: int | None, row: int, n_layers: int, d_ffn: int, fraction: float | None) -> int:
    """Neurons per layer kept resident by the hybrid mode: `fraction` of the FFN if given, half without
    a budget, else what the bytes left after one streamed layer hold."""
    if fraction is not None:
        rows = int(fraction * d_ffn)
    elif avail is None:
        rows = d_ffn // 2
    else:
        rows = avail // (n_layers * row)
    return max(0, min(d_ffn, rows))
