"""The one tiny-model factory every test uses: random HF checkpoints of each supported family."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
FATRELU_THRESHOLD = 0.05

# family id -> (transformers config class, model class, config overrides)
FAMILIES = {
    "opt": ("OPTConfig", "OPTForCausalLM", dict(ffn_dim=128, word_embed_proj_dim=64, activation_function="relu")),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=96, num_key_value_heads=2)),
    "llama-relu": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=96, hidden_act="relu")),
    "llama-fatrelu": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=96, hidden_act="relu")),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(intermediate_size=96, num_key_value_heads=2, sliding_window=8)),
    "falcon-mq": ("FalconConfig", "FalconForCausalLM",
                  dict(new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=False)),
    "falcon-seq": ("FalconConfig", "FalconForCausalLM",
                   dict(new_decoder_architecture=False, multi_query=False, parallel_attn=False, bias=True)),
    "falcon-new": ("FalconConfig", "FalconForCausalLM",
                   dict(new_decoder_architecture=True, num_kv_heads=2, bias=False, ffn_hidden_size=128)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(intermediate_size=128, partial_rotary_factor=0.5)),
    "persimmon": ("PersimmonConfig", "PersimmonForCausalLM",
                  dict(intermediate_size=128, qk_layernorm=True, partial_rotary_factor=0.5)),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=96, num_key_value_heads=2, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(intermediate_size=96, num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=96, num_key_value_heads=2, head_dim=32)),
    # soft-caps small enough to bite on random weights (Gemma 3 has none); window 8 < the 16-token sequences
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        intermediate_size=96, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
        attn_logit_softcapping=2.0, final_logit_softcapping=5.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        intermediate_size=96, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], rope_parameters=dict(
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
            full_attention=dict(rope_type="linear", factor=4.0, rope_theta=1e6)))),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        intermediate_size=96, num_key_value_heads=2, partial_rotary_factor=0.5, original_max_position_embeddings=16,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                             short_factor=[1.0, 1.1, 1.3, 1.6], long_factor=[1.0, 2.0, 4.0, 8.0]))),
}
_MOE = dict(num_experts_per_tok=2, num_key_value_heads=2)
# mixture-of-experts families: 8 experts, top-2 (kept out of FAMILIES so that only the MoE tests run them)
MOE_FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_MOE, num_local_experts=8, intermediate_size=32)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(_MOE, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(_MOE, num_experts=8, moe_intermediate_size=32, norm_topk_prob=True, head_dim=16)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(_MOE, num_experts=8, intermediate_size=32)),
}
TEXT = ("the quick brown fox jumps over the lazy dog while a small model streams its neurons "
        "from flash memory one token at a time def main(): return sum(x * x for x in range(10))\n") * 4


def make_tokenizer(path: Path) -> None:
    """A small character-level BPE tokenizer (ids < VOCAB) saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>", "<unk>"])
    tok.train_from_iterator([TEXT], trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "bos_token": "<s>",
                                                            "eos_token": "</s>"}))


def make_hf_model(family: str, seed: int = 0, **overrides):
    """A random HF model of `family` with weights large enough that logits differ meaningfully."""
    import transformers

    cfg_cls, model_cls, extra = {**FAMILIES, **MOE_FAMILIES}[family]
    cfg = getattr(transformers, cfg_cls)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm = "norm" in name or "ln_" in name or "layer_norm" in name
            p.copy_(1 + 0.1 * torch.randn_like(p) if is_norm and name.endswith("weight") else 0.15 * torch.randn_like(p))
    if family == "llama-fatrelu":
        for layer in model.model.layers:
            layer.mlp.act_fn = FatReLU()
    return model


class FatReLU(torch.nn.Module):
    """ProSparse's activation (x if x > threshold else 0), which transformers does not ship."""

    def forward(self, x):
        return x * (x > FATRELU_THRESHOLD)


def hf_logits(hf, ids, prefill: int | None = None):
    """transformers' logits for a prompt of `prefill` ids (None: all), then one token at a time through its KV
    cache, as flashllm computes them (scaled rope, e.g. Phi-3's longrope, switches as the sequence grows)."""
    prefill = len(ids) if prefill is None else prefill
    with torch.no_grad():
        out = hf(torch.tensor([ids[:prefill]]), use_cache=True)
        rows = [out.logits[0]]
        for t in ids[prefill:]:
            out = hf(torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
            rows.append(out.logits[0])
    return torch.cat(rows).float().numpy()


def save_checkpoint(model, family: str, path: Path, **save_kw) -> Path:
    """Save as an HF checkpoint directory with a tokenizer (fatrelu gets its ProSparse-style config)."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, **save_kw)
    make_tokenizer(path)
    if family == "llama-fatrelu":
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(hidden_act="fatrelu", hidden_act_param=FATRELU_THRESHOLD)
        (path / "config.json").write_text(json.dumps(cfg))
    return path


def write_random_predictors(model_dir: Path, rank: int = 8, seed: int = 0, trained_for: str | None = None,
                            frequencies: bool = False) -> None:
    """Random low-rank predictors in the runtime's predictor format (a stand-in for trained ones); with
    `frequencies`, random activation frequencies too (the runtime then pins hot neurons)."""
    from flashllm.format import manifest as fmt
    from flashllm.modes.sparse.predictor import PREDICTOR_FILE, PREDICTOR_FORMAT, PREDICTOR_META, PREDICTOR_VERSION
    from flashllm.format.safetensors_io import write_safetensors

    spec = fmt.read_manifest(model_dir).spec
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(spec.n_layers):
        tensors[f"layers.{i}.A"] = torch.randn(rank, spec.d_model, generator=g) / spec.d_model ** 0.5
        tensors[f"layers.{i}.B"] = torch.randn(spec.d_ffn, rank, generator=g)
        tensors[f"layers.{i}.b"] = torch.randn(spec.d_ffn, generator=g) * 0.1
        if frequencies:
            tensors[f"layers.{i}.freq"] = torch.rand(spec.d_ffn, generator=g) ** 3
    write_safetensors(model_dir / PREDICTOR_FILE, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()],
                      tensors.__getitem__)
    meta = {"format": PREDICTOR_FORMAT, "format_version": PREDICTOR_VERSION,
            "layers": [{"rank": rank, "threshold": 0.5} for _ in range(spec.n_layers)]}
    if trained_for:
        meta["model"] = {"sha256": {"ffn": trained_for}}
    (model_dir / PREDICTOR_META).write_text(json.dumps(meta))

