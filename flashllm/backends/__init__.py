"""Backends implement the math (norms, attention with KV cache, FFN, head) on one array library.

Each exposes: put(name, tensor), tensor(array), nbytes(), norm(name, x), embed(ids, pos),
attention(layer, x, pos) -> (out, normed_in), ffn(x, rows, up_bias, gate_bias, down_bias), logits(x).
Cache bookkeeping, I/O, formats and sampling are shared and live outside the backends.
"""
