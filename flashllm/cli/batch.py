"""`flashllm generate --batch-file`: several prompts decoded together (FlexGen's throughput setting).

Each decode step obtains every layer's weights once for all unfinished sequences (sparse mode: the
union of their predicted neurons), so flash reads per generated token fall as the batch grows, while
each sequence keeps its own KV cache and position (Model.generate_batch)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from flashllm.cli.args import load_options
from flashllm.cli.stats_text import format_stats
from flashllm.errors import FlashLLMError


def read_batch_file(path: str) -> list[str]:
    """The prompts of a batch file: one per line, blank lines skipped ("-" reads stdin)."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise FlashLLMError(f"--batch-file {path}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise FlashLLMError(f"--batch-file {path}: no prompts (expected one prompt per line)")
    return prompts


def batch_context(model_dir: str, prompts: list[str], max_new_tokens: int) -> int:
    """A KV cache length that holds the longest prompt and its new tokens (each sequence has its own)."""
    from flashllm.format import manifest as fmt
    from flashllm.text.tokenizer import Tokenizer

    manifest = fmt.read_manifest(model_dir, verify=False)
    tokenizer = Tokenizer(manifest.root, manifest.spec.bos_token_id)
    return min(max(len(tokenizer.encode(p)) for p in prompts) + max_new_tokens, manifest.spec.context_limit)


def generate_batch(args) -> None:
    """Decode the prompts of --batch-file in batches of --batch-size (default: all at once)."""
    from flashllm import load

    prompts = read_batch_file(args.batch_file)
    size = args.batch_size = args.batch_size or len(prompts)
    if args.context is None:
        args.context = batch_context(args.model_dir, prompts, args.max_new_tokens)
    model = load(args.model_dir, load_options(args))
    results, stats = [], []
    for k in range(0, len(prompts), size):
        group = prompts[k:k + size]
        texts = model.generate_batch(group, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                     top_p=args.top_p, seed=args.seed, stop=args.stop)
        results += [{"prompt": p, "text": t, "token_ids": r.token_ids, "stop_reason": r.stop_reason}
                    for p, t, r in zip(group, texts, model.last_generations)]
        stats.append(model.stats)
    if args.json:
        print(json.dumps({"results": results, "batch_size": size, "stats": stats[0] if len(stats) == 1 else stats}))
        return
    for i, r in enumerate(results):
        print(f"### {i + 1}: {r['prompt']}\n{r['text']}")
    if args.stats:
        for s in stats:
            print(f"batch of {size}: {s['decode_tokens']} tokens at {s['tokens_per_s'] or 0:.2f} tokens/s\n"
                  + format_stats(s), file=sys.stderr)
