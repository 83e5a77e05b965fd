"""bench/models/train_dense.py: a run resumed from its saved training state equals an uninterrupted one."""

from __future__ import annotations

import torch

from bench.models import train_dense

TEXTS = ["def add(a, b):\n    return a + b\n" * 20, "class Point:\n    x = 0\n    y = 1\n" * 20]


def _setup(tt, tmp_path, steps, ckpt):
    args = tt.build_parser().parse_args([
        "--arch", "llama", "--layers", "1", "--hidden", "32", "--heads", "2", "--ffn", "48", "--batch-size", "2",
        "--seq-len", "16", "--steps", str(steps), "--schedule", "wsd", "--decay-frac", "0.5", "--warmup", "1",
        "--lr", "1e-2", "--checkpoint", str(tmp_path / ckpt), "--checkpoint-every", "2", "--log-every", "2",
        "--threads", "1", "--autocast", "none"])
    tt.set_seed(0)
    tok = tt.train_tokenizer(TEXTS, 300)
    stream = tt.token_stream(tok, TEXTS)
    return args, tt.make_model(tok.get_vocab_size(), tok, args), stream, tt.eval_batches(stream, 2, 16)


def test_resumed_training_equals_an_uninterrupted_run(tmp_path):
    tt = train_dense
    args, whole, stream, held = _setup(tt, tmp_path, 6, "a")
    done = tt.train(whole, stream, args, held)
    args, first, stream, held = _setup(tt, tmp_path, 2, "b")
    tt.train(first, stream, args, held)
    args, resumed, stream, held = _setup(tt, tmp_path, 6, "b")
    resumed_with_other_init = resumed.model.layers[0].mlp.up_proj.weight
    torch.nn.init.normal_(resumed_with_other_init)  # the saved state, not the init, must decide
    again = tt.train(resumed, stream, args, held)
    assert again["steps"] == done["steps"] == 6
    assert [c["train_loss"] for c in again["curve"]] == [c["train_loss"] for c in done["curve"]]
    for (name, a), (_, b) in zip(whole.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), name


def test_wsd_lr_before_the_decay_does_not_depend_on_the_step_count():
    tt = train_dense
    args = tt.build_parser().parse_args(["--schedule", "wsd", "--decay-frac", "0.25", "--warmup", "10", "--lr", "3e-3"])
    for step in (0, 9, 10, 500, 749):
        assert tt.lr_at(step, step / 1000, args) == tt.lr_at(step, step / 4000, args)
    assert tt.lr_at(999, 999 / 1000, args) < 0.11 * 3e-3 < tt.lr_at(999, 999 / 4000, args) == 3e-3
    cosine = tt.build_parser().parse_args(["--warmup", "10", "--lr", "3e-3"])
    assert tt.lr_at(500, 0.5, cosine) < 3e-3 * 0.6
