"""Mixture-of-experts adapters (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) and the expert-file writer.

The router and the shared expert are resident tensors named through `Family.layer`; the routed
experts go to the expert file, one contiguous bundle per expert (flashllm.format.experts).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flashllm.errors import FlashLLMError
from flashllm.format.experts import ExpertLayout, packing_block
from flashllm.format.spec import ArchSpec
from flashllm.format.safetensors_io import storage_bytes

from flashllm.converters.checkpoint import Checkpoint
from flashllm.converters.families.common import LLAMA_GLOBALS, LLAMA_LAYER, Family, llama_spec


@dataclass(frozen=True)
class MoEFamily(Family):
    """A family whose FFN is routed experts: per-expert HF modules, or transformers 5's fused tensors."""

    experts: str = "mlp.experts"  # per-expert modules: {experts}.{e}.{expert_parts[part]}.weight
    expert_parts: tuple[tuple[str, str], ...] = (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"))
    fused_experts: str = "mlp.experts"  # fused: {fused}.gate_up_proj [E, 2f, d] and {fused}.down_proj [E, d, f]

    def streamed_sources(self, ckpt: Checkpoint, spec: ArchSpec) -> list[str]:
        """The HF tensors of the routed experts (fused per layer, or one per expert and part)."""
        names = []
        for i in range(spec.n_layers):
            p = self.layer_prefix.format(i=i)
            fused = f"{p}{self.fused_experts}."
            if ckpt.has(fused + "gate_up_proj"):
                names += [fused + "gate_up_proj", fused + "down_proj"]
            else:
                names += [f"{p}{self.experts}.{e}.{hf}.weight" for e in range(spec.n_experts) for _, hf in self.expert_parts]
        return names

    def expert_rows(self, ckpt: Checkpoint, spec: ArchSpec, i: int) -> list[dict[str, np.ndarray]]:
        """Per expert of layer i: gate, up and down^T, each [d_ffn, d_model] (row j = neuron j)."""
        p, f, d, E = self.layer_prefix.format(i=i), spec.d_ffn, spec.d_model, spec.n_experts
        fused = f"{p}{self.fused_experts}."
        if ckpt.has(fused + "gate_up_proj"):
            gate_up, down = ckpt.get(fused + "gate_up_proj", (E, 2 * f, d)), ckpt.get(fused + "down_proj", (E, d, f))
            return [{"gate": gate_up[e, :f], "up": gate_up[e, f:], "down": down[e].T} for e in range(E)]
        names = dict(self.expert_parts)
        out = []
        for e in range(E):
            base = f"{p}{self.experts}.{e}."
            out.append({"gate": ckpt.get(base + names["gate"] + ".weight", (f, d)),
                        "up": ckpt.get(base + names["up"] + ".weight", (f, d)),
                        "down": ckpt.get(base + names["down"] + ".weight", (d, f)).T})
        return out


def _all_layers_moe(cfg: dict) -> None:
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise FlashLLMError("config.json: MoE models with dense layers (mlp_only_layers, decoder_sparse_step) "
                            "are not supported yet")


def _moe(cfg: dict, family: str, d_expert: int, **kw) -> ArchSpec:
    """A Llama-style spec with routed experts (softmax over all experts, then top-k)."""
    # hub configs say num_experts (Mixtral: num_local_experts); transformers 5 may save either
    n_experts = cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]
    moe = dict(d_ffn=d_expert, n_experts=n_experts, top_k=cfg["num_experts_per_tok"],
               norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    return dataclasses.replace(llama_spec(cfg, family), **{**moe, **kw})


def _mixtral_spec(cfg: dict) -> ArchSpec:
    # transformers: softmax over all experts, top-k, always renormalised (= softmax over the top-k logits)
    return _moe(cfg, "mixtral", cfg["intermediate_size"], norm_topk_prob=True)


def _qwen2_moe_spec(cfg: dict) -> ArchSpec:
    _all_layers_moe(cfg)
    if cfg.get("use_sliding_window"):
        raise FlashLLMError("config.json: Qwen2-MoE with use_sliding_window is not supported yet")
    shared = cfg.get("shared_expert_intermediate_size") or 0
    bias = cfg.get("qkv_bias", True)
    return _moe(cfg, "qwen2_moe", cfg["moe_intermediate_size"], d_shared_expert=shared,
                shared_expert_gate=bool(shared), qkv_bias=bias, o_bias=False, sliding_window=0)


def _qwen3_moe_spec(cfg: dict) -> ArchSpec:
    _all_layers_moe(cfg)
    if cfg.get("use_sliding_window"):
        raise FlashLLMError("config.json: Qwen3-MoE with use_sliding_window is not supported yet")
    return _moe(cfg, "qwen3_moe", cfg["moe_intermediate_size"], qk_norm=True, sliding_window=0)


def _olmoe_spec(cfg: dict) -> ArchSpec:
    if cfg.get("clip_qkv") is not None:
        raise FlashLLMError("config.json: OLMoE with clip_qkv is not supported yet")
    return _moe(cfg, "olmoe", cfg["intermediate_size"], qk_norm=True, qk_norm_full=True)


_QK_NORM = {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
_ROUTER = {"router": "mlp.gate"}
_SHARED = {"shared_gate": "mlp.shared_expert.gate_proj", "shared_up": "mlp.shared_expert.up_proj",
           "shared_down": "mlp.shared_expert.down_proj", "shared_expert_gate": "mlp.shared_expert_gate"}

MOE_FAMILIES = [
    MoEFamily(("mixtral",), _mixtral_spec, LLAMA_GLOBALS, "model.layers.{i}.",
              {**LLAMA_LAYER, "router": ("block_sparse_moe.gate", "mlp.gate")}, {},
              experts="block_sparse_moe.experts", expert_parts=(("gate", "w1"), ("up", "w3"), ("down", "w2"))),
    MoEFamily(("qwen2_moe",), _qwen2_moe_spec, LLAMA_GLOBALS, "model.layers.{i}.",
              {**LLAMA_LAYER, **_ROUTER, **_SHARED}, {}),
    MoEFamily(("qwen3_moe",), _qwen3_moe_spec, LLAMA_GLOBALS, "model.layers.{i}.",
              {**LLAMA_LAYER, **_ROUTER, **_QK_NORM}, {}),
    MoEFamily(("olmoe",), _olmoe_spec, LLAMA_GLOBALS, "model.layers.{i}.",
              {**LLAMA_LAYER, **_ROUTER, **_QK_NORM}, {}),
]


def expert_bundles(layout: ExpertLayout, experts, dtype: str):
    """Per expert (part -> [d_ffn, d_model] float values, down transposed) its stored bundle: uint8
    [stride], each part stored as `dtype`, or group-wise quantized (layout.quant) in its
    `layout.part_shape` (a quantized down projection as W_down), zero padded to the stride; packed
    when `layout.packing` says so."""
    if layout.packing:
        yield from packed_bundles(layout, expert_bundles(dataclasses.replace(layout, packing=None), experts, dtype))
        return
    for parts in experts:
        bundle = np.zeros(layout.stride, dtype=np.uint8)
        for part in layout.parts:
            w = parts[part]
            if layout.quant and layout.part_shape(part) != w.shape:
                w = w.T
            if hasattr(w, "encode"):  # GGUF blocks (converters/gguf_quant.py), mapped exactly where they can be
                raw = w.encode(layout.quant, dtype)
            else:
                raw = layout.quant.quantize(np.ascontiguousarray(w, dtype=np.float32)) if layout.quant else \
                    storage_bytes(w, dtype)
            bundle[layout.part_range(part)] = raw.reshape(-1)
        yield bundle


EXPERT_LAYOUTS = ("portable", "torch-cpu")  # --expert-layout choices


def expert_packing(expert_layout: str, spec: ArchSpec, quant) -> str | None:
    """The packing `--expert-layout` asks for: None (flashllm/format/quant.py's rows, which every backend reads as they
    are) or `torch-cpu`, this torch build's int4 kernel layout on this CPU (torch reads experts straight
    into its cache slots; other backends and CPUs unpack them on insert)."""
    if expert_layout not in EXPERT_LAYOUTS:
        raise FlashLLMError(f"--expert-layout {expert_layout}: expected one of {', '.join(EXPERT_LAYOUTS)}")
    if expert_layout == "portable":
        return None
    from flashllm.backends.torch.quant import INT4_GROUPS, int4_packing

    if not spec.is_moe or quant is None or quant.bits != 4 or quant.group_size not in INT4_GROUPS or quant.symmetric:
        raise FlashLLMError(f"--expert-layout torch-cpu: stores the int4 experts of an MoE model, asymmetric groups "
                            f"of {', '.join(map(str, INT4_GROUPS))} (use --quantize int4, or --expert-layout portable; "
                            f"a GGUF file's symmetric Q4_0 experts are stored portable)")
    packing = int4_packing()
    if packing is None:
        raise FlashLLMError("--expert-layout torch-cpu: this torch build's int4 layout on this CPU is not one "
                            "flashllm knows; use --expert-layout portable")
    return packing


def packed_bundles(layout: ExpertLayout, bundles):
    """Bundles stored as rows (e.g. from `expert_bundles` of the same layout without packing) -> bundles
    packed as `layout.packing` says, the bytes torch's int4 expert slots hold."""
    rows, block = dataclasses.replace(layout, packing=None), packing_block(layout.packing)
    for bundle in bundles:
        out = np.zeros(layout.stride, dtype=np.uint8)
        rows.pack(bundle, out, block)
        yield out


def write_experts(path: Path, layout: ExpertLayout, bundles_of_layer, on_layer=None) -> tuple[str, list[str]]:
    """Write every layer's expert bundles; `bundles_of_layer(i)` yields the layer's stored bundles
    (uint8 [stride] each, e.g. from `expert_bundles`). Returns the sha256 of the file and of each layer."""
    file_sha, layer_sha = hashlib.sha256(), []
    with open(path, "wb") as f:
        for i in range(len(layout.layer_offsets)):
            layer, n = hashlib.sha256(), 0
            for bundle in bundles_of_layer(i):
                if bundle.dtype != np.uint8 or bundle.shape != (layout.stride,):
                    raise ValueError(f"layer {i}: expert bundle of {bundle.dtype} {bundle.shape}, expected "
                                     f"uint8 ({layout.stride},)")
                data = memoryview(bundle)
                f.write(data)
                file_sha.update(data)
                layer.update(data)
                n += 1
            if n != layout.n_experts:
                raise ValueError(f"layer {i}: {n} expert bundles written, expected {layout.n_experts}")
            layer_sha.append(layer.hexdigest())
            if on_layer:
                on_layer(1)
    return file_sha.hexdigest(), layer_sha
