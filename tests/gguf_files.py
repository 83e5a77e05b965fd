"""GGUF files written from tiny transformers models the way llama.cpp's convert_hf_to_gguf.py lays them out:
gguf's HF -> GGUF tensor names, Llama's q/k rows permuted for its rope, experts merged per layer and part,
Llama 3's rope scaling as rope_freqs factors, metadata under `{arch}.*`, and a byte-level BPE vocabulary
trained with `tokenizers` on Python standard library source."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from tiny import make_hf_model

ARCH = {"llama": "llama", "llama3": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2",
        "qwen3": "qwen3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe", "phi3": "phi3",
        "gemma2": "gemma2", "gemma3": "gemma3"}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def corpus() -> str:
    """Python standard library source: the text the vocabulary is trained on and tokenization compared on."""
    import json
    import textwrap

    return "".join(Path(m.__file__).read_text() for m in (json.encoder, textwrap))


def train_vocab(size: int = 400):
    """A byte-level BPE tokenizer (`tokenizers`) with the special tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([corpus()], trainer)
    return tok


def vocab_metadata(tok) -> dict:
    """What llama.cpp writes for a byte-level BPE vocabulary."""
    import json

    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return {"tokens": tokens, "merges": merges, "types": [3 if t in SPECIALS else 1 for t in tokens]}


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: q/k rows reordered for its rope."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(cfg) -> np.ndarray:
    """llama.cpp's rope_freqs for Llama 3 scaling (what each frequency is divided by)."""
    p = cfg.rope_parameters
    dim = cfg.head_dim
    freqs = 1.0 / (p["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high, old = p["factor"], p["low_freq_factor"], p["high_freq_factor"], \
        p["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def hf_tensors(model, family: str):
    """(GGUF name, float32 values) in llama.cpp's layout."""
    import gguf

    cfg = model.config
    arch = ARCH[family]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    out = []
    for hf_name, t in model.state_dict().items():
        w = t.float().numpy()
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if hf_name.endswith("experts.gate_up_proj"):  # [E, 2f, d] -> ffn_gate_exps, ffn_up_exps [E, f, d]
            layer = hf_name.split(".")[2]
            f = w.shape[1] // 2
            out += [(f"blk.{layer}.ffn_gate_exps.weight", w[:, :f]), (f"blk.{layer}.ffn_up_exps.weight", w[:, f:])]
            continue
        if hf_name.endswith("experts.down_proj"):
            out.append((f"blk.{hf_name.split('.')[2]}.ffn_down_exps.weight", w))
            continue
        module, _, suffix = hf_name.rpartition(".")
        name = names.get_name(module)
        assert name is not None, hf_name
        if arch == "llama" and name.endswith(("attn_q", "attn_k")):
            kv = cfg.num_key_value_heads if name.endswith("attn_k") else cfg.num_attention_heads
            w = permute(w, cfg.num_attention_heads, kv)
        if name.endswith("ffn_gate_inp_shexp"):
            w = w.reshape(-1)
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):  # llama.cpp stores Gemma's 1 + w
            w = w + 1
        out.append((f"{name}.{suffix}", w))
    if family == "llama3":
        out.append(("rope_freqs.weight", llama3_rope_factors(cfg)))
    if family == "phi3":  # longrope: llama.cpp's rope_factors_long / _short
        p = cfg.rope_parameters
        out += [("rope_factors_long.weight", np.asarray(p["long_factor"], np.float32)),
                ("rope_factors_short.weight", np.asarray(p["short_factor"], np.float32))]
    return out


def write_gguf(model, family: str, path: Path, qtype: str = "F32", tok=None, kquant: set[str] = frozenset(),
               pre: str = "qwen2", seed: int = 0) -> Path:
    """Write `model` as a GGUF file: 2-D and expert weights stored as `qtype` (F32, F16, BF16, Q8_0, Q4_0, Q4_1),
    1-D ones as F32; tensors named in `kquant` as Q4_K blocks of random content (gguf cannot quantize to it)."""
    import gguf

    cfg = model.config
    arch = ARCH[family]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {family}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = getattr(cfg, "rope_parameters", None) or {}
    w.add_rope_freq_base(rope.get("full_attention", rope).get("rope_theta", 10000.0))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(int(head_dim * (rope.get("partial_rotary_factor") or 1.0)))
    if family == "phi3":
        orig = rope.get("original_max_position_embeddings") or cfg.original_max_position_embeddings
        w.add_rope_scaling_orig_ctx_len(orig)
        scale = cfg.max_position_embeddings / orig
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_feed_forward_length(getattr(cfg, "intermediate_size", 0) or 0)
    if arch.startswith("gemma"):
        w.add_sliding_window(cfg.sliding_window)
        if family == "gemma2":
            w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        else:  # Gemma 3: global layers' rope base and scaling
            full = rope["full_attention"]
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
    if getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None):
        w.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", None):
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if tok is not None:
        v = vocab_metadata(tok)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(v["tokens"])
        w.add_token_types(v["types"])
        w.add_token_merges(v["merges"])
        w.add_bos_token_id(v["tokens"].index("<|endoftext|>"))
        w.add_eos_token_id(v["tokens"].index("<|im_end|>"))
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(seed)
    for name, values in hf_tensors(model, family):
        kind = qtype if values.ndim >= 2 else "F32"
        if name in kquant:
            w.add_tensor(name, random_q4_k(values.shape, rng), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
        elif kind in ("F32", "F16"):
            w.add_tensor(name, values.astype(np.float32 if kind == "F32" else np.float16))
        else:
            t = gguf.GGMLQuantizationType[kind]
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(values), t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def random_q4_k(shape, rng) -> np.ndarray:
    """Q4_K blocks (144 bytes per 256 values) with random codes and sub-scales, d and dmin small and finite."""
    rows, d = int(np.prod(shape[:-1])), shape[-1]
    blocks = rng.integers(0, 256, size=(rows, d // 256, 144), dtype=np.uint8)
    blocks[..., 0:2] = np.frombuffer(np.float16(0.004).tobytes(), np.uint8)
    blocks[..., 2:4] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    return blocks.reshape(*shape[:-1], d // 256 * 144)


def tiny_gguf(tmp_path: Path, family: str, qtype: str = "F32", tok=None, **kw):
    """(HF model, GGUF path) for a tiny `family` model whose vocabulary is `tok`'s."""
    tok = tok or train_vocab()
    hf = make_hf_model(family, vocab_size=tok.get_vocab_size(), bos_token_id=0, eos_token_id=2, pad_token_id=0,
                       **kw)
    return hf, write_gguf(hf, family, tmp_path / f"{family}-{qtype}.gguf", qtype, tok)
