"""Train flashllm's small mixture-of-experts model: a Qwen3-MoE decoder on the Python standard library.

Routing traces and expert-cache hit rates need a *trained* router (random routers pick experts
uniformly). This trains one from scratch, offline, the way bench/models/train_dense.py trained the
embedded dense model, and reuses that model's byte-level BPE tokenizer (flashllm/data/tiny-opt):

1. corpus: the stdlib's own sources (bench/models/stdlib_corpus.py), split by file into train/heldout;
2. a Qwen3-MoE decoder (default 4 layers, d 256, 16 experts of 128 neurons, top-2, renormalised
   top-k weights, GQA 4/2 heads, qk-norm, tied embeddings) trained with AdamW, warmup + cosine
   decay and the Switch load-balancing loss (``--aux``) for a time budget, in float32 on one thread
   (on this loaded 2-core machine bf16 autocast was 10x slower and two threads 10x slower than one:
   27 s vs 2.7 s per 8x128-token step, measured);
3. held-out perplexity of the init and the trained model, and routing statistics on held-out text:
   per-layer expert load (share of routed slots per expert), and the fraction of a token's experts
   already used by the previous ``--window`` tokens (what an expert cache can hit);
4. a normal HF checkpoint (float16) written atomically to ``--out``, reloaded with ``transformers``
   to check that it generates.

    nice -n 10 python -m bench models train-moe --minutes 18 --out flashllm/data/tiny-moe
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.models import stdlib_corpus
from bench.models import train_dense as dense  # the same corpus, tokenizer, schedule and checkpoint writer
from bench.harness import ROOT

TOKENIZER = ROOT / "flashllm" / "data" / "tiny-opt"
PROMPTS = ["def ", "import os\n", "class ", "    def __init__(self"]


def make_model(vocab_size: int, tok, args):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    bos = tok.token_to_id(dense.BOS)
    cfg = Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        intermediate_size=args.expert_ffn, moe_intermediate_size=args.expert_ffn, num_experts=args.experts,
        num_experts_per_tok=args.top_k, norm_topk_prob=True, router_aux_loss_coef=args.aux,
        max_position_embeddings=args.max_pos, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attention_dropout=0.0,
        pad_token_id=tok.token_to_id(dense.PAD), bos_token_id=bos, eos_token_id=bos)
    return Qwen3MoeForCausalLM(cfg)


def losses(model, batch, aux_weight: float):
    """(next-token cross entropy, load-balancing loss) of a [B, T] batch."""
    out = model(input_ids=batch, output_router_logits=aux_weight > 0)
    logits = out.logits
    lm = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)),
                                           batch[:, 1:].reshape(-1))
    return lm, (out.aux_loss if aux_weight > 0 else torch.zeros(()))


@torch.no_grad()
def routing(model, seqs: torch.Tensor, top_k: int, window: int, batch_size: int = 8) -> dict:
    """Held-out loss and routing statistics: per layer, the share of routed slots each expert takes and
    the fraction of a token's experts used by one of the previous `window` tokens of its sequence."""
    model.eval()
    total, n, load, reuse, reuse_n = 0.0, 0, None, None, 0
    for b in range(0, len(seqs), batch_size):
        batch = seqs[b:b + batch_size]
        out = model(input_ids=batch, output_router_logits=True)
        logits = out.logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)),
                                                 batch[:, 1:].reshape(-1))
        total += loss.item() * (batch.numel() - batch.size(0))
        n += batch.numel() - batch.size(0)
        B, T = batch.shape
        for i, rl in enumerate(out.router_logits):
            ids = rl.float().topk(top_k, dim=-1).indices.reshape(B, T, top_k)
            onehot = torch.zeros(B, T, rl.shape[-1]).scatter_(2, ids, 1.0)
            if load is None:
                load = np.zeros((len(out.router_logits), rl.shape[-1]))
                reuse = np.zeros(len(out.router_logits))
            load[i] += onehot.sum((0, 1)).numpy()
            prev = torch.zeros_like(onehot[:, window:])
            for k in range(1, window + 1):
                prev = torch.maximum(prev, onehot[:, window - k:T - k])
            reuse[i] += (onehot[:, window:] * prev).sum().item() / top_k
        reuse_n += B * max(T - window, 0)
    model.train()
    load = load / load.sum(axis=1, keepdims=True)
    return {"loss": round(total / n, 5), "ppl": round(math.exp(total / n), 3), "tokens": n,
            "expert_load": [[round(float(v), 4) for v in row] for row in load],
            "max_expert_share": round(float(load.max()), 4),
            f"reused_from_prev{window}": [round(float(r / reuse_n), 4) for r in reuse]}


def train(model, stream: np.ndarray, args, heldout_small) -> dict:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed)
    stream_t = torch.from_numpy(stream.astype(np.int64))
    budget = args.minutes * 60.0
    model.train()
    t0, step, lm_hist, curve = time.time(), 0, [], []
    while time.time() - t0 < budget:
        lr = dense.lr_at(step, (time.time() - t0) / budget, args)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(stream_t) - args.seq_len, (args.batch_size,), generator=gen)
        batch = torch.stack([stream_t[s:s + args.seq_len] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast):
            lm, aux = losses(model, batch, args.aux)
            total = lm + args.aux * aux
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        lm_hist.append(lm.item())
        step += 1
        if step % args.log_every == 0 or step == 1:
            ev = routing(model, heldout_small, args.top_k, args.window)
            curve.append({"step": step, "seconds": round(time.time() - t0, 1),
                          "train_loss": round(float(np.mean(lm_hist[-args.log_every:])), 4),
                          "aux_loss": round(aux.item(), 4), "heldout_loss": ev["loss"],
                          "max_expert_share": ev["max_expert_share"]})
            dense.log(f"step {step} lr {lr:.2e} train {curve[-1]['train_loss']:.3f} aux {aux.item():.3f} "
                      f"heldout {ev['loss']:.3f} (ppl {ev['ppl']:.1f}) max expert share {ev['max_expert_share']:.3f} "
                      f"{(time.time() - t0) / step:.2f} s/step")
    wall = time.time() - t0
    return {"steps": step, "wall_seconds": round(wall, 1), "seconds_per_step": round(wall / max(step, 1), 3),
            "tokens_seen": step * args.batch_size * args.seq_len,
            "final_train_loss": round(float(np.mean(lm_hist[-50:])), 4) if lm_hist else None, "curve": curve}


def verify(out: Path, prompts: list[str], max_new_tokens: int) -> list[dict]:
    """Reload with transformers alone and generate greedily from each prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out)
    samples = []
    for prompt in prompts:
        enc = tok(prompt, return_tensors="pt")
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
        samples.append({"prompt": prompt, "text": tok.decode(gen[0], skip_special_tokens=True)})
    return samples


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="flashllm/data/tiny-moe")
    ap.add_argument("--minutes", type=float, default=18.0, help="training time budget (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", help="continue training this checkpoint (written by this script) instead of a new model")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-ffn", type=int, default=128, help="neurons per expert (default: %(default)s)")
    ap.add_argument("--max-pos", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--aux", type=float, default=0.01, help="load-balancing loss weight (default: %(default)s)")
    ap.add_argument("--eval-seqs", type=int, default=24)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--autocast", action="store_true", help="bfloat16 autocast (slower on this CPU)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    dense.set_seed(args.seed)
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__)] + (argv or sys.argv[1:]))
    t_start = time.time()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    corpus = stdlib_corpus.describe()
    train_stream = dense.token_stream(tok, [t for _, t in stdlib_corpus.texts("train")])
    heldout_stream = dense.token_stream(tok, [t for _, t in stdlib_corpus.texts("heldout")])
    corpus["train"]["tokens"], corpus["heldout"]["tokens"] = int(len(train_stream)), int(len(heldout_stream))
    dense.log(f"train {len(train_stream)} tokens, heldout {len(heldout_stream)} tokens")
    heldout = dense.eval_batches(heldout_stream, args.eval_seqs, args.seq_len)
    heldout_small = heldout[::4]
    previous = None
    if args.resume:  # continue training a checkpoint this script wrote (its earlier runs are kept in training.json)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.resume, dtype=torch.float32)
        prev = json.loads((Path(args.resume) / "training.json").read_text())
        previous = prev.get("previous_runs", []) + [{k: prev[k] for k in ("command", "training") if k in prev}
                                                    | {"heldout_ppl": prev["heldout_eval"]["trained"]["ppl"]}]
    else:
        model = make_model(tok.get_vocab_size(), tok, args)
    n_params = sum(p.numel() for p in model.parameters())
    dense.log(f"model: {n_params / 1e6:.2f}M parameters")
    init_eval = routing(model, heldout, args.top_k, args.window)
    result = train(model, train_stream, args, heldout_small)
    final_eval = routing(model, heldout, args.top_k, args.window)
    dense.log(f"trained: {result['steps']} steps in {result['wall_seconds']} s; heldout loss {final_eval['loss']:.3f} "
              f"ppl {final_eval['ppl']:.2f} (init {init_eval['ppl']:.1f}); reuse from previous {args.window} tokens "
              f"{final_eval[f'reused_from_prev{args.window}']}")

    import transformers

    info = {
        "command": command,
        "model": {"family": "qwen3_moe", "parameters": n_params, "layers": args.layers, "hidden": args.hidden,
                  "heads": args.heads, "kv_heads": args.kv_heads, "experts": args.experts, "top_k": args.top_k,
                  "expert_neurons": args.expert_ffn, "vocab": tok.get_vocab_size(), "tied_embeddings": True},
        "data": {**corpus, "tokenizer": "flashllm/data/tiny-opt's byte-level BPE (vocab 4096)"},
        "training": {"seed": args.seed, "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr,
                     "warmup_steps": args.warmup, "min_lr_ratio": args.min_lr_ratio, "aux_loss_weight": args.aux,
                     "optimizer": "AdamW(betas=(0.9, 0.95), eps=1e-8)", "weight_decay": args.weight_decay,
                     "grad_clip": args.clip, "autocast": "bfloat16 (CPU)" if args.autocast else "none (float32)", "threads": args.threads,
                     "minutes_budget": args.minutes, "load_average_at_end": os.getloadavg()[0], **result},
        "heldout_eval": {"budget": f"{args.eval_seqs} sequences x {args.seq_len} tokens", "window": args.window,
                         "init": init_eval, "trained": final_eval},
        "previous_runs": previous or [],
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": transformers.__version__, "cpus": os.cpu_count()},
    }
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        info["saved_dtype"] = dense.write_checkpoint(model, dense.hf_tokenizer(tok, args.max_pos), tmp)
        info["samples"] = verify(tmp, PROMPTS, 48)
        info["total_seconds"] = round(time.time() - t_start, 1)
        (tmp / "training.json").write_text(json.dumps(info, indent=2) + "\n")
        os.chmod(tmp / "training.json", 0o644)
        dense.swap_into_place(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    for s in info["samples"]:
        dense.log(f"sample {s['prompt']!r} ->\n{s['text']}\n---")
    dense.log(f"saved {out}")


if __name__ == "__main__":
    main()
