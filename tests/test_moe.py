"""Mixture-of-experts beyond the parity runner (tests/test_parity.py: dense == transformers, streamed == dense):
prefill reads, quantized experts, prefetch, routing, layout and budget errors."""

import json

import numpy as np
import pytest
import torch

import flashllm
from flashllm.format import manifest as fmt
from flashllm.errors import FlashLLMError
from flashllm.modes.experts import ExpertCache, by_expert, route
from tiny import hf_logits

IDS = [1, 17, 33, 5, 60, 8, 21, 90, 44, 12, 3, 71]


def _budget_for_slots(model_dir, slots: int, **load) -> int:
    """A DRAM budget in bytes that leaves exactly `slots` expert slots per layer."""
    probe = flashllm.load(model_dir, mode="sparse", dram_budget=None, **load)
    plan, spec = probe.mode_impl, probe.spec
    base = probe.charged(plan.host_bytes(), probe.backend.nbytes())
    return base + spec.n_layers * slots * plan.slot_bytes


def test_moe_prefill_reads_each_expert_of_the_union_once(tiny_models):
    tiny = tiny_models("mixtral")
    model = flashllm.load(tiny.model_dir, mode="sparse", dram_budget=_budget_for_slots(tiny.model_dir, 2))
    model.logits(IDS, prefill=len(IDS))
    prompt = model.token_stats[0]
    assert prompt["experts_missed"] == prompt["bytes_read"] // model.layout.stride
    assert prompt["experts_hit"] == 0
    # the union of a 12-token prompt's top-2 experts covers more than the 2 slots of each layer
    assert prompt["experts_missed"] > 2 * model.spec.n_layers


def test_moe_budget_below_one_expert_slot_is_a_clear_error(tiny_models):
    tiny = tiny_models("olmoe")
    smallest = _budget_for_slots(tiny.model_dir, 1)
    flashllm.load(tiny.model_dir, mode="sparse", dram_budget=smallest)
    with pytest.raises(FlashLLMError, match="too small: resident weights, KV cache and 1 expert slot per layer need"):
        flashllm.load(tiny.model_dir, mode="sparse", dram_budget=smallest - 1)
    with pytest.raises(FlashLLMError, match="mode 'naive' is not supported for this olmoe model"):
        flashllm.load(tiny.model_dir, mode="naive")


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized_moe(request, tiny_models, tmp_path_factory):
    from flashllm.converters import convert

    tiny = tiny_models("qwen2_moe")
    out = convert(tiny.ckpt, tmp_path_factory.mktemp("qmoe") / request.param, dtype="float32",
                  quantize=request.param, group_size=32, progress=False)
    return tiny, out, request.param


def test_moe_quantized_expert_bundles_are_aligned_and_within_bounds(quantized_moe):
    """Each stored expert row dequantizes to within half a group step of the checkpoint's weights."""
    from flashllm.modes.experts import expert_values
    from flashllm.format.quant import QuantScheme

    tiny, out, name = quantized_moe
    manifest, plain = fmt.read_manifest(out), fmt.read_manifest(tiny.model_dir)
    lay, spec = manifest.layout, manifest.spec
    q = QuantScheme.named(name, 32)
    assert lay.quant == q and manifest.data["quantization"] == name
    assert lay.stride % 4096 == 0 and all(o % 4096 == 0 for o in lay.layer_offsets)
    assert lay.bundle_bytes == 3 * spec.d_ffn * q.part_bytes(spec.d_model) < plain.layout.bundle_bytes
    model = flashllm.load(out, mode="dense")
    experts = tiny.hf.model.layers[1].mlp.experts
    raw = np.fromfile(manifest.path("ffn"), dtype=np.uint8, count=lay.stride, offset=lay.layer_offsets[1] + 5 * lay.stride)
    values = expert_values(model, raw)
    gate, up = experts.gate_up_proj[5].detach().chunk(2, dim=0)
    # gate and up rows are grouped along d_model; the down projection W_down along d_ffn (its input)
    for k, want in enumerate((gate, up, experts.down_proj[5].detach())):
        got = np.asarray(values[k]).T if k == 2 else np.asarray(values[k])
        groups = want.float().numpy().reshape(want.shape[0], -1, 32)
        step = ((groups.max(-1) - groups.min(-1)) / ((1 << q.bits) - 1))[..., None]
        err = np.abs(got.reshape(groups.shape) - groups)
        assert (err <= step / 2 * (1 + 1e-3) + 1e-7).all()
        assert err.max() > 0  # it is quantized


def test_moe_quantized_streamed_equals_dense_and_transformers_on_the_dequantized_weights(quantized_moe):
    """Parity: the quantized model (dense, and streamed through 2 slots) computes what transformers computes
    with every expert replaced by its dequantized weights; against the float weights int8 stays close.
    (The plain kernels: dequantized experts; the int4 kernel slots are checked against them below.)"""
    import copy

    from flashllm.modes.experts import expert_values

    tiny, out, name = quantized_moe
    dense_model = flashllm.load(out, mode="dense", kernels="plain")
    lay = dense_model.layout
    hf = copy.deepcopy(tiny.hf)
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            ex = layer.mlp.experts
            for e in range(lay.n_experts):
                raw = np.fromfile(dense_model.manifest.path("ffn"), dtype=np.uint8, count=lay.stride,
                                  offset=lay.layer_offsets[i] + e * lay.stride)
                gate, up, down = (torch.from_numpy(np.asarray(v)) for v in expert_values(dense_model, raw))
                ex.gate_up_proj[e] = torch.cat((gate, up))
                ex.down_proj[e] = down.t()
    dense = dense_model.logits(IDS, prefill=4)
    np.testing.assert_allclose(dense, hf_logits(hf, IDS), atol=1e-4, rtol=1e-4)
    budget = _budget_for_slots(out, 2, kernels="plain")
    model = flashllm.load(out, mode="sparse", dram_budget=budget, kernels="plain")
    assert model.stats["expert_slots"] != "in place (as stored)" and model.stats["cache_capacity"] == [2] * model.spec.n_layers
    np.testing.assert_allclose(model.logits(IDS, prefill=4), dense, atol=1e-5, rtol=1e-5)
    stats = model.stats
    assert stats["expert_slots"] == "dequantized on insert" and stats["expert_misses"] > 0
    assert stats["dram_bytes"] <= budget
    ref = hf_logits(tiny.hf, IDS)
    rel = np.abs(dense - ref).max() / np.abs(ref).max()
    assert 0 < rel < (0.01 if name == "int8" else 1.0)


def test_moe_quantized_slots_when_top_k_dequantized_experts_do_not_fit(quantized_moe):
    """Below top-k dequantized experts per layer the slots keep experts as stored (more of them) and
    dequantize at each use (no int4 kernel layout: the plain kernels); still exactly the dense result."""
    tiny, out, name = quantized_moe
    dense = flashllm.load(out, mode="dense", kernels="plain").logits(IDS, prefill=4)
    probe = flashllm.load(out, mode="sparse", kernels="plain")
    L, stride = probe.spec.n_layers, probe.layout.stride
    budget = probe.charged(0, probe.backend.nbytes()) + L * 3 * stride
    assert L * 3 * stride < L * probe.spec.top_k * probe.stats["expert_slot_bytes"]  # 2 dequantized experts do not fit
    model = flashllm.load(out, mode="sparse", dram_budget=budget, kernels="plain")
    assert model.stats["cache_capacity"] == [3] * L and model.stats["expert_slot_bytes"] == stride
    np.testing.assert_allclose(model.logits(IDS, prefill=4), dense, atol=1e-5, rtol=1e-5)
    assert model.stats["expert_slots"] == "quantized as stored (dequantized at each use)"
    assert model.stats["dram_bytes"] <= budget and model.stats["expert_misses"] > 0


def test_moe_int4_kernel_slots_equal_dense_and_stay_close_to_dequantized(quantized_moe):
    """Int4 experts kept in torch's int4 kernel layout (repacked on insert): streamed through 2 slots
    equals dense (both use the kernel), and both stay within bfloat16 rounding of the dequantized
    experts (the plain kernels); int8 experts have no kernel layout and are dequantized."""
    tiny, out, name = quantized_moe
    plain = flashllm.load(out, mode="dense", kernels="plain").logits(IDS, prefill=4)
    dense_model = flashllm.load(out, mode="dense")
    dense = dense_model.logits(IDS, prefill=4)
    kw = dict(expert_read_ahead=name == "int4")  # prefetched experts are inserted from the second staging buffer
    budget = _budget_for_slots(out, 2, **kw)
    model = flashllm.load(out, mode="sparse", dram_budget=budget, **kw)
    assert model.stats["cache_capacity"] == [2] * model.spec.n_layers
    np.testing.assert_allclose(model.logits(IDS, prefill=4), dense, atol=1e-5, rtol=1e-5)
    stats = model.stats
    assert stats["expert_misses"] > 0 and stats["dram_bytes"] <= budget
    if name == "int8":
        assert stats["expert_slots"] == "dequantized on insert"
        np.testing.assert_allclose(dense, plain, atol=1e-5, rtol=1e-5)
        return
    assert stats["expert_slots"] == "int4 kernel layout (repacked on insert)"
    lay = model.layout
    assert stats["expert_slot_bytes"] <= lay.bundle_bytes * 1.01 < 3 * lay.d_ffn * lay.d_model * 4  # stays int4
    rel = np.abs(dense - plain).max() / np.abs(plain).max()
    assert 0 < rel < 0.05  # bfloat16 activations, scales and zeros; not the same numbers, close ones
    assert (dense.argmax(-1) == plain.argmax(-1)).mean() >= 0.75


def test_moe_mlx_quantized_slots_equal_dense_and_the_dequantized_experts(quantized_moe):
    """MLX keeps int4 and int8 experts in its affine format (copied on insert, mx.quantized_matmul at use):
    streamed through 2 slots (prefetched ones inserted from the second staging buffer) equals MLX dense
    exactly, and both equal torch on the dequantized experts (the plain kernels) within float32 rounding."""
    pytest.importorskip("mlx.core")
    tiny, out, name = quantized_moe
    plain = flashllm.load(out, mode="dense", kernels="plain").logits(IDS, prefill=4)
    kw = dict(backend="mlx", device="cpu", expert_read_ahead=True)
    dense = flashllm.load(out, mode="dense", **kw).logits(IDS, prefill=4)
    np.testing.assert_allclose(dense, plain, atol=1e-4, rtol=1e-4)
    budget = _budget_for_slots(out, 2, **kw)
    model = flashllm.load(out, mode="sparse", dram_budget=budget, **kw)
    assert model.stats["cache_capacity"] == [2] * model.spec.n_layers
    np.testing.assert_array_equal(model.logits(IDS, prefill=4), dense)
    stats, lay = model.stats, model.layout
    assert stats["expert_slots"] == "MLX affine format (copied on insert)"
    assert stats["expert_misses"] > 0 and stats["dram_bytes"] <= budget
    assert stats["expert_slot_bytes"] <= lay.bundle_bytes * 1.2 < 3 * lay.d_ffn * lay.d_model * 4  # stays quantized


def test_int4_kernel_packing_matches_torchs_converter():
    """The nibble permutation that repacks int4 codes equals torch's own converter (or falls back to it)."""
    from flashllm.backends.torch.quant import pack_int4

    codes = torch.randint(0, 16, (192, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    want = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    stored = (codes[:, 0::2] | (codes[:, 1::2] << 4)).numpy()
    for blocks in ([stored], [stored[:128], stored[128:]], [stored[:48], stored[48:]]):  # 48: not whole blocks
        out = torch.zeros_like(want)
        pack_int4(blocks, out)
        assert torch.equal(out, want)
    assert not torch.equal(want, torch.from_numpy(stored))  # a real permutation


def test_quantized_experts_of_an_older_layout_are_refused(quantized_moe, tmp_path):
    import shutil

    _, out, _ = quantized_moe
    old = tmp_path / "old"
    shutil.copytree(out, old)
    data = json.loads((old / fmt.MANIFEST).read_text())
    del data["ffn"]["part_shapes"]
    (old / fmt.MANIFEST).write_text(json.dumps(data))
    with pytest.raises(FlashLLMError, match="older layout .*convert the model again"):
        fmt.read_manifest(old)


def test_expert_layout_is_aligned_and_validated(tiny_models, tmp_path):
    import shutil

    tiny = tiny_models("qwen3_moe")
    manifest = fmt.read_manifest(tiny.model_dir)
    lay, spec = manifest.layout, manifest.spec
    assert (spec.n_experts, spec.top_k, spec.d_ffn) == (8, 2, 32)
    assert lay.stride % 4096 == 0 and all(o % 4096 == 0 for o in lay.layer_offsets)
    assert manifest.path("ffn").stat().st_size == spec.n_layers * spec.n_experts * lay.stride
    # expert 3 of layer 1 holds the checkpoint's gate rows, up rows and down columns
    raw = np.fromfile(manifest.path("ffn"), dtype=np.uint8, count=lay.bundle_bytes, offset=lay.layer_offsets[1] + 3 * lay.stride)
    values = torch.from_numpy(raw).view(torch.float32)
    experts = tiny.hf.model.layers[1].mlp.experts
    gate, up = experts.gate_up_proj[3].detach().chunk(2, dim=0)
    for part, want in (("gate", gate), ("up", up), ("down", experts.down_proj[3].detach().t())):
        torch.testing.assert_close(values[lay.part_slice(part)].view(32, spec.d_model), want)
    bad = tmp_path / "bad"
    shutil.copytree(tiny.model_dir, bad)
    data = json.loads((bad / fmt.MANIFEST).read_text())
    data["ffn"]["bundle_stride"] += 4096
    (bad / fmt.MANIFEST).write_text(json.dumps(data))
    with pytest.raises(FlashLLMError, match="layout in the manifest does not match"):
        fmt.read_manifest(bad)


def test_routing_math():
    class Spec:
        top_k, router_softmax, norm_topk_prob = 2, "before_topk", False

    logits = np.array([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 2.5]], dtype=np.float32)
    ids, w = route(logits, Spec)
    assert ids.tolist() == [[1, 2], [0, 3]]
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    np.testing.assert_allclose(w, np.take_along_axis(p, ids, -1), rtol=1e-6)
    Spec.norm_topk_prob = True
    _, w = route(logits, Spec)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
    Spec.router_softmax = "after_topk"
    _, w2 = route(logits, Spec)
    np.testing.assert_allclose(w2, w, rtol=1e-6)  # renormalised softmax == softmax of the top-k logits
    groups = by_expert(ids, w)
    assert sorted(groups) == [0, 1, 2, 3] and groups[1][0].tolist() == [0]


@pytest.mark.parametrize("policy", ["lru", "lfu", "window"])
def test_expert_cache_policies(policy):
    cache = ExpertCache(capacity=3, n_experts=6, window=2, policy=policy)

    def step(experts):
        active = cache.start(np.array([experts]))
        missing = np.array([e for e in active if cache.slot_of[e] < 0], dtype=np.int64)
        cache.commit(missing, cache.place(missing, keep=active))
        return set(map(int, cache.expert_in[cache.expert_in >= 0]))

    assert step([0, 1]) == {0, 1}
    assert step([0, 2]) == {0, 1, 2}
    held = step([0, 3])  # full: one of 1, 2 goes, never 0 or 3
    assert {0, 3} <= held and len(held) == 3
    if policy != "lfu":
        assert held == {0, 2, 3}  # 1 is the least recently used
    cache.window = 1  # the window policy drops every expert the last token did not use, even with free slots
    assert step([4]) == ({4} if policy == "window" else {0, 3, 4})


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_moe_prefetch_is_exact_and_measured(tiny_models, dtype):
    """Prefetch reads layer l+1's predicted experts during layer l (into slots, or into a staging buffer
    when slots hold converted experts); wrong guesses cost reads, never results."""
    tiny = tiny_models("mixtral")
    kw = dict(dtype=dtype)
    dense = flashllm.load(tiny.model_dir, mode="dense", **kw).logits(IDS, prefill=3)
    budget = _budget_for_slots(tiny.model_dir, 3, expert_read_ahead=True, **kw)
    model = flashllm.load(tiny.model_dir, mode="sparse", dram_budget=budget, expert_read_ahead=True, **kw)
    assert (model.stats["expert_slots"] == "in place (as stored)") == (dtype is None)
    np.testing.assert_array_equal(model.logits(IDS, prefill=3), dense)  # float32 sums of top-2 (see above)
    stats, spec = model.stats, model.spec
    assert 0 < stats["expert_read_ahead_recall"] <= 1 and stats["experts_read_ahead"] <= spec.top_k * (spec.n_layers - 1)
    routed = sum(t["experts_routed"] for t in model.token_stats[1:])
    assert routed == (len(IDS) - 3) * spec.top_k * (spec.n_layers - 1)
    plain = flashllm.load(tiny.model_dir, mode="sparse", dram_budget=budget, **kw)
    plain.logits(IDS, prefill=3)
    assert "expert_read_ahead_recall" not in plain.stats
    # a decode token reads its misses (on demand or ahead) plus the wasted guesses, one stride per expert
    assert stats["bytes_read"] == pytest.approx((stats["expert_misses"] + stats["experts_read_ahead_unused"]) * model.layout.stride)


def test_moe_expert_routing_option_replaces_the_routers_choice(tiny_models):
    """A routing trace replayed through `expert_routing`: the plans follow it (streamed = dense), prefetch
    asks it with early=True, and bad ids are a clear error."""
    tiny = tiny_models("qwen3_moe")
    calls = []

    def replay(layer, logits, early):
        calls.append((layer, logits.shape[0], early))
        return np.tile([[3, 5]], (logits.shape[0], 1))

    dense = flashllm.load(tiny.model_dir, mode="dense", expert_routing=replay).logits(IDS, prefill=4)
    assert np.abs(dense - flashllm.load(tiny.model_dir, mode="dense").logits(IDS, prefill=4)).max() > 1e-3
    calls.clear()
    model = flashllm.load(tiny.model_dir, mode="sparse", dram_budget=_budget_for_slots(tiny.model_dir, 2),
                          expert_routing=replay, expert_read_ahead=True)
    np.testing.assert_allclose(model.logits(IDS, prefill=4), dense, atol=1e-5, rtol=1e-5)
    assert model.stats["expert_hit_rate"] == 1.0  # experts 3 and 5, cached since the prompt
    L, decode = model.spec.n_layers, len(IDS) - 4
    assert sorted(calls) == sorted([(layer, 4, False) for layer in range(L)] +
                                   [(layer, 1, False) for layer in range(L)] * decode +
                                   [(layer, 1, True) for layer in range(1, L)] * decode)
    bad = flashllm.load(tiny.model_dir, mode="dense", expert_routing=lambda layer, logits, early: np.zeros((len(logits), 2)))
    with pytest.raises(FlashLLMError, match="expert_routing gave layer 0 expert ids of shape"):
        bad.logits(IDS[:3])
