"""A GGUF file's tokenizer metadata -> tokenizer.json and tokenizer_config.json (what generate, chat and serve read).

`tokenizer.ggml.model` gpt2 is byte-level BPE (tokens, merges, and the pre-tokenizer split named by
`tokenizer.ggml.pre`); llama is SentencePiece BPE (tokens, scores; merges rebuilt from the scores, byte
fallback). Control tokens become special tokens and user-defined ones added tokens, so that both are matched
whole. BOS is added as `tokenizer.ggml.add_bos_token` says (flashllm/text/tokenizer.py reads it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from flashllm.errors import FlashLLMError

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split its merges were learned on; absent: GPT-2's own (ByteLevel's regex)
PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
              "dbrx": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
GPT2_PRES = ("gpt-2", "default", None)


def write_gguf_tokenizer(meta: dict, dest: Path) -> list[str]:
    """Write tokenizer.json and tokenizer_config.json into `dest`; returns the names written (none when the
    file has no vocabulary)."""
    kind, tokens = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.tokens")
    if not tokens:
        return []
    if kind == "gpt2":
        tok = _byte_level(meta, tokens)
    elif kind == "llama":
        tok = _sentencepiece(meta, tokens)
    else:
        raise FlashLLMError(f"GGUF tokenizer {kind!r} is not supported (supported: gpt2, llama)")
    _add_special(tok, meta, tokens)
    _atomic_write(dest / "tokenizer.json", tok.to_str())
    config = {"add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
              "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False))}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                      ("pad_token", "padding_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= token_id < len(tokens):
            config[name] = tokens[token_id]
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    _atomic_write(dest / "tokenizer_config.json", json.dumps(config, indent=1))
    return ["tokenizer.json", "tokenizer_config.json"]


def _byte_level(meta: dict, tokens: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = meta.get("tokenizer.ggml.pre")
    if pre not in PRE_SPLITS and pre not in GPT2_PRES:
        raise FlashLLMError(f"GGUF tokenizer.ggml.pre {pre!r}: this pre-tokenizer is not supported (supported: "
                            f"{', '.join(sorted(PRE_SPLITS))}, gpt-2)")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=pre in PRE_SPLITS
                               and PRE_SPLITS[pre] is _LLAMA3_SPLIT))
    if pre in PRE_SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRE_SPLITS[pre]), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(meta: dict, tokens: list[str]):
    """SentencePiece BPE as transformers' Llama tokenizer: "▁" for spaces, prepended once, byte fallback."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab, _merges_from_scores(vocab, dict(zip(tokens, scores))), byte_fallback=True,
                               fuse_unk=True, unk_token=tokens[unk] if unk is not None else None))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]) \
        if meta.get("tokenizer.ggml.add_space_prefix", True) else normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens of the vocabulary, best-scored merged token first (the order
    SentencePiece applies them in)."""
    merges = []
    for token, score in scores.items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        merges += [(score, vocab[a], vocab[b], a, b) for a, b in pairs]
    merges.sort(key=lambda m: (-m[0], m[1], m[2]))
    return [(a, b) for _, _, _, a, b in merges]


def _add_special(tok, meta: dict, tokens: list[str]) -> None:
    from tokenizers import AddedToken

    types = meta.get("tokenizer.ggml.token_type") or []
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
