"""GGUF files (written here as llama.cpp's converter lays them out, tests/gguf_files.py) convert into flashllm
models whose dense logits equal transformers' own GGUF loader, with Q4_0/Q4_1/Q8_0 blocks kept bit for bit."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import flashllm
from flashllm.converters import convert
from flashllm.errors import FlashLLMError
from flashllm.converters.gguf_tokenizer import write_gguf_tokenizer
from flashllm.format import manifest as fmt
from flashllm.text.tokenizer import Tokenizer as TextTokenizer
from gguf_files import corpus, tiny_gguf, train_vocab, write_gguf
from tiny import hf_logits, make_hf_model

IDS = [5, 17, 33, 100, 250, 7, 64, 3, 399, 12]
QWEN3 = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128)  # transformers' GGUF
# loader reads no head_dim for qwen3 and uses its default, 128


@pytest.fixture(scope="module")
def vocab():
    return train_vocab()


def transformers_gguf(path, config=None):
    """transformers' own GGUF load (the independent reference), float32."""
    from transformers import AutoModelForCausalLM

    kw = {"config": config} if config is not None else {}
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kw).eval()


@pytest.mark.parametrize("family,qtype,kw", [("llama", "F32", {}), ("qwen2", "F16", {}), ("qwen3", "F32", QWEN3)])
def test_float_gguf_logits_equal_transformers_gguf_load(tmp_path, vocab, family, qtype, kw):
    """As stored (the norms, F32 in any GGUF, then rounded to the file's F16, the cost said), and as float32."""
    _, path = tiny_gguf(tmp_path, family, qtype, vocab, **kw)
    out = convert(path, tmp_path / "out", progress=False)
    manifest = fmt.read_manifest(out, verify=True)
    assert manifest.data["dtype"] == {"F32": "float32", "F16": "float16"}[qtype]
    source = manifest.data["source"]
    assert source["format"] == "gguf" and source["path"] == str(path.resolve()) and source["architecture"] == family
    rounded = source["conversion"]["rounded"]
    assert [(r["from"], r["to"]) for r in rounded] == ([("F32", "float16")] if qtype == "F16" else [])
    assert all(0 < r["relative_rms_error"] < 1e-3 for r in rounded)
    if qtype != "F32":
        out = convert(path, tmp_path / "f32", dtype="float32", progress=False)
    ours = flashllm.load(out, mode="dense").logits(IDS)
    np.testing.assert_allclose(ours, hf_logits(transformers_gguf(path), IDS), atol=1e-4, rtol=1e-4)


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path, vocab):
    """llama.cpp keeps Llama 3's scaling only as per-frequency factors (transformers' GGUF loader drops them);
    the recovered parameters give the original model's logits past the original context."""
    hf, path = tiny_gguf(tmp_path, "llama3", "F32", vocab)
    out = convert(path, tmp_path / "out", progress=False)
    scaling = fmt.read_manifest(out).spec.rope_scaling
    assert scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 16}
    ids = (IDS * 3)[:24]  # past the original 16 positions
    np.testing.assert_allclose(flashllm.load(out, mode="dense").logits(ids), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


GEMMA = dict(query_pre_attn_scalar=16)  # what llama.cpp uses for a Gemma that is not the 27B: head_dim


@pytest.mark.parametrize("family,kw", [("mixtral", {}), ("qwen2_moe", {}), ("olmoe", {}), ("phi3", {}),
                                       ("gemma2", GEMMA), ("gemma3", dict(GEMMA, num_hidden_layers=6, layer_types=None))])
def test_architectures_transformers_cannot_load_from_gguf_equal_the_original(tmp_path, vocab, family, kw):
    """Mixtral (llama with merged experts), Qwen2-MoE (shared expert), OLMoE, Phi-3 (fused qkv and gate/up,
    longrope factors as tensors), Gemma 2 and 3 (norms stored as 1 + w, soft-caps, windows, Gemma 3's two rope
    bases as llama.cpp fixes them): transformers' GGUF loader gets their config wrong, so the reference is the
    transformers model the lossless F32 file was written from, past Phi-3's original context and the windows."""
    hf, path = tiny_gguf(tmp_path, family, "F32", vocab, **kw)
    out = convert(path, tmp_path / "out", progress=False)
    assert fmt.read_manifest(out).spec.family == family
    ids = (IDS * 3)[:24]
    np.testing.assert_allclose(flashllm.load(out, mode="dense").logits(ids), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def _dense_parts(out, layer: int):
    """part -> [d_ffn, d_model] float32 values of layer `layer` as stored in ffn.bin (dequantized)."""
    m = fmt.read_manifest(out)
    lay, d = m.layout, m.spec.d_model
    raw = np.fromfile(out / fmt.FFN_FILE, dtype=np.uint8)
    rows = raw[lay.layer_offsets[layer]:lay.layer_offsets[layer] + lay.d_ffn * lay.stride].reshape(lay.d_ffn, -1)
    return {p: lay.quant.dequantize(np.ascontiguousarray(rows[:, lay.part_range(p)]), d) for p in lay.parts}


@pytest.mark.parametrize("qtype,quantize,scheme", [("Q4_0", None, "int4 symmetric"), ("Q4_1", None, "int4 asymmetric"),
                                                   ("Q8_0", None, "int8 symmetric"), ("Q4_0", "int8", "int8 symmetric")])
def test_quantized_blocks_are_kept_bit_for_bit(tmp_path, vocab, qtype, quantize, scheme):
    """Up and gate rows are GGUF's blocks as flashllm groups of 32 (no second rounding); a dense down
    projection's blocks span 32 neurons, so it is rounded again, and the manifest says by how much. With that
    down projection put into transformers' GGUF load, the logits are equal."""
    import gguf

    _, path = tiny_gguf(tmp_path, "llama", qtype, vocab)
    out = convert(path, tmp_path / "out", dtype="float32", quantize=quantize, progress=False)
    m = fmt.read_manifest(out, verify=True)
    q = m.layout.quant
    assert (f"int{q.bits} {q.scheme}", q.group_size) == (scheme, 32)
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    ref = transformers_gguf(path)
    for i in range(m.spec.n_layers):
        parts = _dense_parts(out, i)
        for p in ("gate", "up"):
            t = tensors[f"blk.{i}.ffn_{p}.weight"]
            np.testing.assert_array_equal(parts[p], gguf.quants.dequantize(t.data, t.tensor_type))
        ref.model.layers[i].mlp.down_proj.weight.data = torch.from_numpy(parts["down"].T.copy())
    cost = m.data["source"]["conversion"]
    n = m.spec.n_layers * m.spec.d_ffn * m.spec.d_model
    assert cost["exact"] == {qtype: 2 * n}
    down = [r for r in cost["rounded"] if r["to"].startswith("int")]
    assert len(down) == 1 and down[0]["values"] == n and 0 < down[0]["relative_rms_error"] < 0.2
    ours = flashllm.load(out, mode="dense", dtype="float32").logits(IDS)
    np.testing.assert_allclose(ours, hf_logits(ref, IDS), atol=1e-4, rtol=1e-4)


def test_a_k_quant_is_dequantized_or_quantized_again_with_its_cost(tmp_path, vocab):
    """Q4_K (no flashllm group shape) is dequantized by gguf: stored as float32 the logits equal
    transformers'; --quantize int4 rounds it again and the manifest names the error."""
    hf = make_hf_model("llama", vocab_size=vocab.get_vocab_size(), hidden_size=256, intermediate_size=64,
                       num_attention_heads=4, num_key_value_heads=2)
    kq = {f"blk.{i}.ffn_{p}.weight" for i in range(2) for p in ("gate", "up")}
    path = write_gguf(hf, "llama", tmp_path / "k.gguf", "F16", vocab, kquant=kq)
    out = convert(path, tmp_path / "f32", dtype="float32", progress=False)
    m = fmt.read_manifest(out)
    assert m.data["quantization"] == "none"
    assert {r["from"] for r in m.data["source"]["conversion"]["rounded"]} == {"Q4_K"}
    ours = flashllm.load(out, mode="dense").logits(IDS)
    np.testing.assert_allclose(ours, hf_logits(transformers_gguf(path), IDS), atol=1e-4, rtol=1e-4)
    q = fmt.read_manifest(convert(path, tmp_path / "q", quantize="int4", progress=False))
    assert q.layout.quant.group_size == 64 and q.layout.quant.scheme == "asymmetric"
    rounded = {(r["from"], r["to"]): r for r in q.data["source"]["conversion"]["rounded"]}
    assert 0 < rounded[("Q4_K", "int4")]["relative_rms_error"] < 0.2
    assert rounded[("Q4_K", "int4")]["values"] == 2 * 2 * 256 * 64  # 2 layers' gate and up


@pytest.mark.parametrize("qtype,bits", [("Q8_0", 8), ("Q4_0", 4)])
def test_moe_gguf_streams_experts_at_a_budget_with_dense_logits(tmp_path, vocab, qtype, bits):
    """Qwen3-MoE as llama.cpp stores it (experts merged per layer and part): every expert block is kept (down
    projections too: an expert's are stored as W_down, groups along d_ffn), dense logits equal transformers'
    GGUF load, and streaming experts at a budget gives the same logits."""
    hf, path = tiny_gguf(tmp_path, "qwen3_moe", qtype, vocab, **QWEN3)
    out = convert(path, tmp_path / "out", dtype="float32", progress=False)
    m = fmt.read_manifest(out, verify=True)
    s = m.spec
    assert m.layout.quant.bits == bits and m.data["source"]["conversion"]["exact"] == {
        qtype: s.n_layers * s.n_experts * 3 * s.d_ffn * s.d_model}
    # plain kernels: the stored values as they are (torch's int4 kernel rounds activations to bfloat16)
    dense = flashllm.load(out, mode="dense", kernels="plain").logits(IDS)
    np.testing.assert_allclose(dense, hf_logits(transformers_gguf(path, hf.config), IDS), atol=1e-4, rtol=1e-4)
    # the tuned kernels (Q4_0: torch's int4 kernel on symmetric groups, whose packed slots outgrow the bundle)
    np.testing.assert_allclose(flashllm.load(out, mode="dense").logits(IDS), dense, atol=0.1)
    probe = flashllm.load(out, mode="sparse", dram_budget=None, kernels="plain")
    budget = probe.charged(probe.mode_impl.host_bytes(), probe.backend.nbytes()) + \
        s.n_layers * 2 * probe.mode_impl.slot_bytes  # 2 of 8 expert slots per layer
    streamed = flashllm.load(out, mode="sparse", dram_budget=budget, kernels="plain")
    np.testing.assert_allclose(streamed.logits(IDS), dense, atol=1e-5, rtol=1e-5)
    assert sum(t["experts_missed"] for t in streamed.token_stats) > 0


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt-2"])
def test_tokenizer_from_gguf_metadata_equals_transformers(tmp_path, vocab, pre):
    """tokenizer.json / tokenizer_config.json written from the GGUF vocabulary (byte-level BPE, split as
    tokenizer.ggml.pre says) encode like transformers' GGUF tokenizer on standard library source; the chat
    template and special tokens come along."""
    from transformers import AutoTokenizer

    hf = make_hf_model("qwen2", vocab_size=vocab.get_vocab_size(), bos_token_id=0, eos_token_id=2)
    path = write_gguf(hf, "qwen2", tmp_path / "m.gguf", "F16", vocab, pre=pre)
    out = convert(path, tmp_path / "out", progress=False)
    model = flashllm.load(out, mode="dense")
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = corpus()[:6000] + "\n<|im_start|>user\nhi<|im_end|>\n"
    ids = model.tokenizer.encode(text)
    assert ids == ref(text)["input_ids"] and len(ids) > 1000
    assert model.tokenizer.decode(ids) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and "<|im_start|>" in config["chat_template"]
    assert model.chat_template.render([{"role": "user", "content": "hi"}]).startswith("<|im_start|>user\nhi")


def test_split_gguf_converts_from_its_first_part(tmp_path, vocab):
    import gguf

    hf, path = tiny_gguf(tmp_path, "llama", "F32", vocab)
    whole = flashllm.load(convert(path, tmp_path / "whole", progress=False), mode="dense").logits(IDS)
    split_dir = tmp_path / "split"
    split_dir.mkdir()
    reader = gguf.GGUFReader(path)
    names = [t.name for t in reader.tensors]
    parts = [split_dir / f"m-{i:05d}-of-00002.gguf" for i in (1, 2)]
    for k, (part, chosen) in enumerate(zip(parts, (names[:10], names[10:]))):
        _copy_gguf(reader, part, chosen, k, len(parts), with_meta=k == 0)
    out = convert(parts[0], tmp_path / "out", progress=False)
    np.testing.assert_array_equal(flashllm.load(out, mode="dense").logits(IDS), whole)
    assert fmt.read_manifest(out).data["source"]["split_files"] == 2
    with pytest.raises(FlashLLMError, match="part 2 of a split GGUF; give the first part"):
        convert(parts[1], tmp_path / "out2", progress=False)
    parts[1].unlink()
    with pytest.raises(FlashLLMError, match="m-00002-of-00002.gguf missing"):
        convert(parts[0], tmp_path / "out3", progress=False)


def _copy_gguf(reader, path, names, no, count, with_meta):
    """A part of a split GGUF as gguf-split writes it: split.* keys, the metadata in the first part only."""
    import gguf

    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(path), arch)
    if with_meta:
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    w.add_uint16("split.no", no)
    w.add_uint16("split.count", count)
    for t in reader.tensors:
        if t.name in names:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch,needle", [("falcon", "Falcon GGUF files are not supported yet"),
                                         ("bert", "GGUF architecture 'bert' is not supported")])
def test_unsupported_architectures_are_one_clear_line(tmp_path, arch, needle):
    import gguf

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = subprocess.run([sys.executable, "-m", "flashllm.cli.main", "convert", str(path), str(tmp_path / "out")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert needle in r.stderr and "gemma, gemma2, gemma3, llama, olmoe, phi3, qwen2, qwen2moe, qwen3" in r.stderr
    assert not (tmp_path / "out").exists()


def test_a_file_that_is_not_gguf_is_one_clear_line(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    r = subprocess.run([sys.executable, "-m", "flashllm.cli.main", "convert", str(bad), str(tmp_path / "out")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "not a readable GGUF file" in r.stderr


def test_sentencepiece_vocabulary_encodes_like_transformers(tmp_path):
    """tokenizer.ggml.model llama (SentencePiece BPE: tokens, scores, byte tokens; merges rebuilt from the
    scores): the same ids as transformers' GGUF tokenizer on standard library source, BOS added as the file says.
    (After a special token and before leading spaces, flashllm prepends "▁" as llama.cpp and Llama 2's own
    tokenizer.json do; transformers' GGUF tokenizer does not.)"""
    import gguf
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer

    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator([corpus()], trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                                            special_tokens=["<unk>", "<s>", "</s>", *bytes_]))
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    types = [2 if t == "<unk>" else 3 if t in ("<s>", "</s>") else 6 if t in bytes_ else 1 for t in tokens]
    path = tmp_path / "spm.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) if k == 1 else 0.0 for i, k in enumerate(types)])  # merge order
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    out = tmp_path / "tok"
    out.mkdir()
    assert write_gguf_tokenizer({k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()
                                 if not k.startswith("GGUF.")}, out) == ["tokenizer.json", "tokenizer_config.json"]
    ours = TextTokenizer(out, bos_token_id=1)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in (corpus()[:6000], "héllo wörld 日本 🙂 tabs\tand\nnewlines"):
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"] and ids[0] == 1
        assert ours.decode(ids) == text
