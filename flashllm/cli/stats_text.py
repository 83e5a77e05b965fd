"""The per-token stats as a few lines a person reads (`--stats` of generate and chat)."""

from __future__ import annotations


def format_stats(stats: dict) -> str:
    """A few human-readable lines of the per-token stats."""
    predictor = f"  predictor {stats['predictor']}" if stats.get("predictor") else ""
    lines = [f"mode {stats['mode']}{predictor}  backend {stats['backend']}  decode tokens {stats['decode_tokens']}  "
             f"DRAM {stats['dram_bytes'] / 2**20:.1f} MiB"]
    if stats.get("kernels"):
        lines.append(f"kernels: {stats['kernels']}")
    lines.append("per decode token: " + "  ".join(
        f"{k.removesuffix('_ms')} {stats[k]:.2f} ms" for k in ("total_ms", "io_ms", "mem_ms", "compute_ms", "predictor_ms")))
    reads = stats["reads"]  # a mean: 0.45 reads per token where most tokens find their neurons cached
    lines.append(f"flash read per token: {stats['bytes_read'] / 2**20:.3f} MiB in "
                 f"{f'{reads:.0f}' if reads >= 100 else f'{reads:.3g}'} reads")
    q = stats.get("quantization") or {}
    if any(q.get(k) not in (None, "none", 16) for k in ("ffn", "resident", "kv_bits")):
        lines.append(f"quantized: FFN bundles {q['ffn']}, resident matrices {q['resident']}, KV cache "
                     f"{'int8' if q['kv_bits'] == 8 else 'unquantized'} (lossy; measured cost: docs/quantization.md)")
    if stats.get("expert_hit_rate") is not None:
        lines.append(f"experts per token: {stats['expert_hits']:.2f} cached, {stats['expert_misses']:.2f} read "
                     f"(hit rate {stats['expert_hit_rate']:.3f})")
    if "draft_tokens" in stats:
        rate = stats["acceptance_rate"]
        lines.append(f"speculative: {stats['accepted_tokens']} of {stats['draft_tokens']} drafted tokens accepted"
                     f"{'' if rate is None else f' ({rate:.0%})'}, {stats['forward_passes']} forward passes for "
                     f"{stats['decode_tokens']} tokens; flash read per generated token "
                     f"{stats['bytes_per_generated_token'] / 2**20:.3f} MiB")
    if stats.get("activation_sparsity"):
        sp = stats["activation_sparsity"]
        lines.append(f"calibrated activation sparsity: {sp['sparsity']:.0%} of FFN neurons skipped per token on "
                     f"calibration text, FFN output error {sp['ffn_error']:.1%} ({sp['method']} {sp['target']:g}; "
                     f"sparsity.json)")
    if stats.get("neurons_dropped"):
        n, share = stats["neurons_dropped"], stats.get("dropped_mass_share")
        count = f"{n:.0f}" if n >= 10 else f"{n:.2g}"  # a few drops over many tokens: 0.13, not 0
        mass = "unknown share" if share is None else "<0.1%" if 0 < share < 0.0005 else f"{share:.1%}"
        lines.append(f"neurons dropped per token: {count} (caches too small for the predicted set; {mass} of the "
                     f"predicted score mass)")
    return "\n".join(lines)
