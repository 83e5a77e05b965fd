"""Train flashllm's own small models: an OPT-style ReLU decoder (or, with ``--arch llama``, a
Llama-style SwiGLU one) on the Python standard library.

The predictors (and the demo) need a *trained* model with real FFN activation sparsity, small
enough to commit and to run on a laptop CPU. This script makes one from scratch, offline:

1. corpus: the stdlib's own sources (bench/models/stdlib_corpus.py), split by file into train/heldout;
2. a byte-level BPE tokenizer (vocab 4096, ``</s>`` = bos/eos, ``<pad>``) trained on train;
3. an OPT decoder with ReLU FFNs (6 layers, d 256, FFN 1024, 4 heads, pre-LN, tied embeddings),
   or with ``--arch llama`` a Llama decoder (RMSNorm, rotary, SwiGLU FFN of ``--ffn`` neurons,
   no biases, tied embeddings; ``--ffn 704`` gives about the ReLU model's FFN parameters), trained
   from random init with AdamW, warmup + cosine decay and bf16 autocast, for a time
   budget (``--minutes``) or a number of steps (``--steps``);
4. held-out perplexity of the init and of the trained model on a fixed token budget, and FFN
   activation sparsity per layer (fraction of fc1 outputs, or SwiGLU gate pre-activations, > 0 per token; fraction of neurons
   new relative to the union of the previous ``--window`` tokens);
5. a normal HF checkpoint (config.json, model.safetensors, tokenizer files,
   generation_config.json, training.json) written atomically to ``--out``, then reloaded with
   ``transformers`` to check it generates and that the tokenizer round-trips text.

    python -m bench models train-dense --steps 1200 --out flashllm/data/tiny-opt
    nice -n 19 python -m bench models train-dense --arch llama --layers 4 --ffn 704 --lr 3e-3 --warmup 100 \
        --batch-size 8 --threads 1 --autocast none --schedule wsd --steps 1650 \
        --checkpoint swiglu-state --out flashllm/data/tiny-swiglu

With ``--checkpoint DIR`` the training state is saved every ``--checkpoint-every`` steps and a
run started again with the same arguments resumes from it (bit for bit: tested).
"""
import argparse
import json
import math
import os
import platform
import random
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.models import stdlib_corpus

BOS = "</s>"  # OPT convention: </s> starts every sequence and ends generation
PAD = "<pad>"
SPECIAL_TOKENS = [PAD, BOS]  # ids 0 and 1
MAX_FLOAT32_BYTES = 30 * 1024 * 1024
PROMPTS = ["def ", "import os\n", "class ", "    def __init__(self"]


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ----------------------------------------------------------------------------- tokenizer

def train_tokenizer(train_texts, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(train_texts, trainer=trainer, length=len(train_texts))
    bos_id = tok.token_to_id(BOS)
    # Like OPT's tokenizer: encode() puts </s> in front of the text.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return tok


def hf_tokenizer(tok, max_len):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=BOS,
                                   pad_token=PAD, model_max_length=max_len,
                                   clean_up_tokenization_spaces=False)


def token_stream(tok, texts):
    """All documents as one int32 stream, each starting with </s> (added by the tokenizer)."""
    ids = [np.asarray(e.ids, dtype=np.int32) for e in tok.encode_batch(texts)]
    return np.concatenate(ids) if ids else np.zeros(0, np.int32)


# ----------------------------------------------------------------------------- model

def make_model(vocab_size, tok, args):
    if args.arch == "llama":
        return make_llama(vocab_size, tok, args)
    from transformers import OPTConfig, OPTForCausalLM
    cfg = OPTConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
        ffn_dim=args.ffn, num_attention_heads=args.heads, max_position_embeddings=args.max_pos,
        do_layer_norm_before=True, word_embed_proj_dim=args.hidden, tie_word_embeddings=True,
        activation_function="relu", dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        layerdrop=0.0, enable_bias=True, init_std=0.02,
        pad_token_id=tok.token_to_id(PAD), bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(BOS))
    model = OPTForCausalLM(cfg)
    model.tie_weights()
    return model


def make_llama(vocab_size, tok, args):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
        intermediate_size=args.ffn, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        max_position_embeddings=args.max_pos, hidden_act="silu", rms_norm_eps=1e-5, rope_theta=10000.0,
        attention_bias=False, mlp_bias=False, tie_word_embeddings=True, initializer_range=0.02,
        pad_token_id=tok.token_to_id(PAD), bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(BOS))
    model = LlamaForCausalLM(cfg)
    model.tie_weights()
    return model


def fc1_modules(model):
    """Per layer, the module whose output > 0 counts as an active neuron (OPT fc1, Llama gate_proj)."""
    if hasattr(model.model, "decoder"):
        return [layer.fc1 for layer in model.model.decoder.layers]
    return [layer.mlp.gate_proj for layer in model.model.layers]


def lm_loss(model, batch):
    """Mean next-token cross entropy (float32) over a [B, T] batch."""
    logits = model(input_ids=batch).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))


def eval_batches(stream, n_seqs, seq_len):
    """A fixed held-out budget: n_seqs windows of seq_len evenly spaced over the stream."""
    if len(stream) < seq_len:
        raise SystemExit(f"held-out text too short: {len(stream)} tokens < {seq_len}")
    starts = np.linspace(0, len(stream) - seq_len, n_seqs).astype(np.int64)
    return torch.from_numpy(np.stack([stream[s:s + seq_len] for s in starts]).astype(np.int64))


@torch.no_grad()
def evaluate(model, seqs, batch_size=16, window=4):
    """Held-out loss/perplexity (float32) plus per-layer FFN activity on the same tokens:
    active = mean fraction of fc1 outputs > 0 per token; new = fraction of the FFN active now
    but in none of the previous `window` tokens of the same sequence; union = fraction active
    in any of the previous `window` tokens (what a sliding-window cache holds)."""
    was_training = model.training
    model.eval()
    n_layers = len(fc1_modules(model))
    sums = {k: np.zeros(n_layers) for k in ("active", "new", "union")}
    counts = {"active": 0, "new": 0}
    shape = {}
    acts = [None] * n_layers

    def hook(i):
        def fn(_mod, _inp, out):
            acts[i] = (out > 0).reshape(shape["B"], shape["T"], -1)
        return fn

    handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(fc1_modules(model))]
    total_loss, total_tokens = 0.0, 0
    try:
        for b in range(0, len(seqs), batch_size):
            batch = seqs[b:b + batch_size]
            shape["B"], shape["T"] = batch.shape
            loss = lm_loss(model, batch)
            n = batch.numel() - batch.size(0)
            total_loss += loss.item() * n
            total_tokens += n
            for i, a in enumerate(acts):
                a = a.float()
                sums["active"][i] += a.mean(-1).sum().item()
                T = a.size(1)
                if T > window:
                    prev = torch.zeros_like(a[:, window:])
                    for k in range(1, window + 1):
                        prev = torch.maximum(prev, a[:, window - k:T - k])
                    cur = a[:, window:]
                    sums["new"][i] += (cur * (1 - prev)).mean(-1).sum().item()
                    sums["union"][i] += prev.mean(-1).sum().item()
            counts["active"] += batch.size(0) * batch.size(1)
            counts["new"] += batch.size(0) * max(batch.size(1) - window, 0)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    loss = total_loss / total_tokens
    layers = []
    for i in range(n_layers):
        layers.append({
            "layer": i,
            "active": round(sums["active"][i] / counts["active"], 5),
            f"new_w{window}": round(sums["new"][i] / max(counts["new"], 1), 5),
            f"union_prev{window}": round(sums["union"][i] / max(counts["new"], 1), 5)})
    return {"loss": round(loss, 5), "ppl": round(math.exp(loss), 3), "tokens": total_tokens,
            "layers": layers,
            "mean_active": round(float(np.mean([l["active"] for l in layers])), 5),
            f"mean_new_w{window}": round(float(np.mean([l[f"new_w{window}"] for l in layers])), 5),
            f"mean_union_prev{window}":
                round(float(np.mean([l[f"union_prev{window}"] for l in layers])), 5)}


# ----------------------------------------------------------------------------- training

def lr_at(step, progress, args):
    """Linear warmup over --warmup steps, then down to lr*min_lr_ratio at progress 1: cosine over
    the whole run, or (wsd) constant until 1 - decay_frac, then cosine over the last decay_frac.
    With wsd and --steps, the lr before the decay does not depend on the step count, so a resumed
    run may change --steps until the decay starts and still equal a run with that count from scratch."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if args.schedule == "wsd":
        progress = max(0.0, (progress - (1 - args.decay_frac)) / args.decay_frac)
    cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cos)


def save_training_state(path, model, opt, gen, state):
    """Everything a resumed run needs, atomically: parameters and AdamW moments (safetensors),
    batch RNG state and progress (json). Tied parameters are stored once."""
    from safetensors.torch import save_file
    path.mkdir(parents=True, exist_ok=True)
    tensors = {f"param.{n}": p.detach().contiguous() for n, p in model.named_parameters()}
    for idx, st in opt.state_dict()["state"].items():
        for key, value in st.items():
            tensors[f"opt.{idx}.{key}"] = torch.as_tensor(value).contiguous()
    tensors["rng"] = gen.get_state()
    for name, payload in (("state.safetensors", None), ("state.json", state)):
        tmp = path / f".{name}.tmp"
        if payload is None:
            save_file(tensors, str(tmp))
        else:
            tmp.write_text(json.dumps(payload) + "\n")
        os.replace(tmp, path / name)


def load_training_state(path, model, opt, gen):
    """Restore what save_training_state wrote; returns its progress dict."""
    from safetensors.torch import load_file
    tensors = load_file(str(path / "state.safetensors"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(tensors[f"param.{n}"])
    sd = opt.state_dict()
    sd["state"] = {}
    for key, value in tensors.items():
        if key.startswith("opt."):
            _, idx, name = key.split(".", 2)
            sd["state"].setdefault(int(idx), {})[name] = value
    opt.load_state_dict(sd)
    gen.set_state(tensors["rng"])
    return json.loads((path / "state.json").read_text())


def train(model, stream, args, heldout_small):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed)
    stream_t = torch.from_numpy(stream.astype(np.int64))
    budget = args.minutes * 60.0 if args.steps is None else None
    pre_relu = []
    if args.l1 > 0:  # optional activation penalty: mean ReLU output of every FFN
        handles = [m.register_forward_hook(lambda _m, _i, out: pre_relu.append(out))
                   for m in fc1_modules(model)]
    model.train()
    step, losses, curve, done_before = 0, [], [], 0.0
    ckpt = Path(args.checkpoint) if args.checkpoint else None
    if ckpt is not None and (ckpt / "state.json").exists():
        saved = load_training_state(ckpt, model, opt, gen)
        step, losses, curve, done_before = (saved["step"], saved["losses"], saved["curve"],
                                            saved["seconds"])
        log(f"resumed from {ckpt} at step {step} ({done_before:.0f} s trained)")
    t0 = time.time() - done_before
    while True:
        elapsed = time.time() - t0
        if args.steps is not None and step >= args.steps:
            break
        if budget is not None and elapsed >= budget:
            break
        progress = step / args.steps if args.steps is not None else elapsed / budget
        lr = lr_at(step, progress, args)
        for g in opt.param_groups:
            g["lr"] = lr
        pre_relu.clear()
        starts = torch.randint(0, len(stream_t) - args.seq_len, (args.batch_size,), generator=gen)
        batch = torch.stack([stream_t[s:s + args.seq_len] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast == "bf16"):
            loss = lm_loss(model, batch)
            total = loss
            if args.l1 > 0:
                total = loss + args.l1 * sum(torch.relu(a.float()).mean() for a in pre_relu)
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        losses.append(loss.item())
        step += 1
        if step % args.log_every == 0 or step == 1:
            ev = evaluate(model, heldout_small, window=args.window)
            rate = (time.time() - t0) / step
            curve.append({"step": step, "seconds": round(time.time() - t0, 1),
                          "train_loss": round(float(np.mean(losses[-args.log_every:])), 4),
                          "heldout_loss": ev["loss"], "mean_active": ev["mean_active"]})
            log(f"step {step} lr {lr:.2e} train {curve[-1]['train_loss']:.3f} "
                f"heldout {ev['loss']:.3f} (ppl {ev['ppl']:.1f}) active {ev['mean_active']:.3f} "
                f"{rate:.2f} s/step")
        if ckpt is not None and (step % args.checkpoint_every == 0):
            save_training_state(ckpt, model, opt, gen, {
                "step": step, "losses": losses[-max(50, args.log_every):], "curve": curve,
                "seconds": round(time.time() - t0, 1)})
    if args.l1 > 0:
        for h in handles:
            h.remove()
    wall = time.time() - t0
    return {"steps": step, "wall_seconds": round(wall, 1),
            "seconds_per_step": round(wall / max(step, 1), 3),
            "tokens_seen": step * args.batch_size * args.seq_len,
            "final_train_loss": round(float(np.mean(losses[-50:])), 4) if losses else None,
            "last_step_train_loss": round(losses[-1], 4) if losses else None,
            "curve": curve}


# ----------------------------------------------------------------------------- saving

def write_checkpoint(model, hf_tok, out):
    """A normal HF checkpoint: float32 weights if they fit in 30 MB, else float16."""
    from transformers import GenerationConfig
    n_bytes = sum(p.numel() for p in model.parameters()) * 4
    dtype = torch.float32 if n_bytes <= MAX_FLOAT32_BYTES else torch.float16
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id, do_sample=False)
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    model.float()
    hf_tok.save_pretrained(out)
    # Name the class every transformers version knows (5.x writes its own alias), and keep the
    # classic special_tokens_map.json beside it.
    cfg_path = Path(out) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    (Path(out) / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": BOS, "pad_token": PAD}, indent=2) + "\n")
    os.chmod(out, 0o755)
    for f in Path(out).iterdir():
        os.chmod(f, 0o644)
    return str(dtype).replace("torch.", "")


def swap_into_place(tmp, out):
    """Replace `out` by the finished directory `tmp` (same parent) with renames only."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old)


def verify(out, heldout_text, prompts, max_new_tokens):
    """Reload with transformers alone: generation from prompts, tokenizer round trip."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
    model = AutoModelForCausalLM.from_pretrained(out)
    model.eval()
    tok = AutoTokenizer.from_pretrained(out)
    tok2 = PreTrainedTokenizerFast(tokenizer_file=str(Path(out) / "tokenizer.json"))
    sample = heldout_text[:20000]
    ids = tok(sample)["input_ids"]
    roundtrip = (tok.decode(ids, skip_special_tokens=True) == sample
                 and tok2.decode(tok2(sample)["input_ids"], skip_special_tokens=True) == sample
                 and ids[0] == model.config.bos_token_id)
    samples = []
    for prompt in prompts:
        enc = tok(prompt, return_tensors="pt")
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
        samples.append({"prompt": prompt,
                        "text": tok.decode(gen[0], skip_special_tokens=True)})
    return {"tokenizer_roundtrip_ok": bool(roundtrip), "roundtrip_chars": len(sample),
            "samples": samples}


# ----------------------------------------------------------------------------- main

def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="flashllm/data/tiny-opt")
    ap.add_argument("--arch", choices=["opt", "llama"], default="opt",
                    help="opt: ReLU FFN with biases; llama: SwiGLU FFN, RMSNorm, rotary (default opt)")
    ap.add_argument("--minutes", type=float, default=20.0, help="training time budget")
    ap.add_argument("--steps", type=int, default=None, help="train this many steps instead")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--max-pos", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--schedule", choices=["cosine", "wsd"], default="cosine",
                    help="after warmup: cosine over the whole run, or wsd: constant, then cosine over "
                    "the last --decay-frac (default cosine)")
    ap.add_argument("--decay-frac", type=float, default=0.25, help="wsd: decayed fraction (default 0.25)")
    ap.add_argument("--checkpoint", default=None,
                    help="directory for the training state (safetensors); saved every --checkpoint-every "
                    "steps and resumed from when it exists (default: none)")
    ap.add_argument("--checkpoint-every", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--l1", type=float, default=0.0,
                    help="weight of a mean-ReLU-activation penalty (0 = off)")
    ap.add_argument("--eval-seqs", type=int, default=64)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--autocast", choices=["bf16", "none"], default="bf16",
                    help="bf16 autocast for training steps (default); none: float32 (measured 9x faster per step "
                    "for the Llama model on this CPU, which has no native bfloat16)")
    return ap


def main(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.steps is None and args.minutes <= 0:
        ap.error("--minutes must be positive")

    torch.set_num_threads(args.threads)
    set_seed(args.seed)
    command = "python " + " ".join(shlex.quote(a) for a in
                                    [os.path.relpath(__file__)] + (argv or sys.argv[1:]))
    t_start = time.time()

    corpus = stdlib_corpus.describe()
    train_texts = [t for _, t in stdlib_corpus.texts("train")]
    heldout_texts = [t for _, t in stdlib_corpus.texts("heldout")]
    log(f"corpus: {corpus['train']['files']} train files ({corpus['train']['bytes']} B), "
        f"{corpus['heldout']['files']} held-out files ({corpus['heldout']['bytes']} B)")

    saved_tok = Path(args.checkpoint) / "tokenizer.json" if args.checkpoint else None
    if saved_tok is not None and saved_tok.exists():  # a resumed run keeps its token ids
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(saved_tok))
    else:
        tok = train_tokenizer(train_texts, args.vocab)
        if saved_tok is not None:
            saved_tok.parent.mkdir(parents=True, exist_ok=True)
            tok.save(str(saved_tok))
    train_stream = token_stream(tok, train_texts)
    heldout_stream = token_stream(tok, heldout_texts)
    corpus["train"]["tokens"] = int(len(train_stream))
    corpus["heldout"]["tokens"] = int(len(heldout_stream))
    log(f"tokenizer: vocab {tok.get_vocab_size()}; train {len(train_stream)} tokens, "
        f"heldout {len(heldout_stream)} tokens")

    heldout = eval_batches(heldout_stream, args.eval_seqs, args.seq_len)
    heldout_small = heldout[:: max(1, args.eval_seqs // 16)]  # for progress logging only
    model = make_model(tok.get_vocab_size(), tok, args)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters")

    init_eval = evaluate(model, heldout, window=args.window)
    log(f"init: heldout loss {init_eval['loss']:.3f} ppl {init_eval['ppl']:.1f}")
    result = train(model, train_stream, args, heldout_small)
    final_eval = evaluate(model, heldout, window=args.window)
    log(f"trained: {result['steps']} steps in {result['wall_seconds']} s; heldout loss "
        f"{final_eval['loss']:.3f} ppl {final_eval['ppl']:.2f}")
    for l in final_eval["layers"]:
        log(f"  layer {l['layer']}: active {l['active']:.3f}  new(w{args.window}) "
            f"{l[f'new_w{args.window}']:.3f}  union(prev{args.window}) "
            f"{l[f'union_prev{args.window}']:.3f}")

    import tokenizers
    import transformers
    info = {
        "command": command,
        "model": {"family": args.arch, "parameters": n_params, "layers": args.layers,
                  "hidden": args.hidden, "ffn_dim": args.ffn, "heads": args.heads,
                  "vocab": tok.get_vocab_size(), "max_position_embeddings": args.max_pos,
                  "activation": "silu (SwiGLU)" if args.arch == "llama" else "relu",
                  "tied_embeddings": True},
        "data": {**corpus, "tokenizer": f"byte-level BPE, vocab {args.vocab}, trained on the "
                 f"train split; {BOS} = bos/eos (prepended to every document), {PAD} = pad"},
        "training": {"seed": args.seed, "batch_size": args.batch_size, "seq_len": args.seq_len,
                     "optimizer": "AdamW(betas=(0.9, 0.95), eps=1e-8)", "lr": args.lr,
                     "warmup_steps": args.warmup, "min_lr_ratio": args.min_lr_ratio,
                     "schedule": "linear warmup, cosine decay over the step or time budget",
                     "weight_decay": args.weight_decay, "grad_clip": args.clip,
                     "l1_activation_penalty": args.l1, "autocast": "bfloat16 (CPU)" if args.autocast == "bf16" else "none (float32)",
                     "threads": args.threads, "minutes_budget": None if args.steps else args.minutes,
                     "steps_budget": args.steps, **result},
        "heldout_eval": {"budget": f"{args.eval_seqs} sequences x {args.seq_len} tokens, evenly "
                                   "spaced over the held-out token stream; float32",
                         "window": args.window, "init": init_eval, "trained": final_eval},
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": transformers.__version__,
                        "tokenizers": tokenizers.__version__, "machine": platform.machine(),
                        "cpus": os.cpu_count()},
    }
    hf_tok = hf_tokenizer(tok, args.max_pos)
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        info["saved_dtype"] = write_checkpoint(model, hf_tok, tmp)
        check = verify(tmp, heldout_texts[0], PROMPTS, 64)
        info["verify"] = check
        info["total_seconds"] = round(time.time() - t_start, 1)
        (tmp / "training.json").write_text(json.dumps(info, indent=2) + "\n")
        os.chmod(tmp / "training.json", 0o644)
        if check["tokenizer_roundtrip_ok"]:
            swap_into_place(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"tokenizer round trip ok: {check['tokenizer_roundtrip_ok']}")
    for sample in check["samples"]:
        log(f"sample {sample['prompt']!r} ->\n{sample['text']}\n---")
    if not check["tokenizer_roundtrip_ok"]:
        raise SystemExit(f"tokenizer round trip failed; {out} left unchanged")
    log(f"saved {out}")


if __name__ == "__main__":
    main()
