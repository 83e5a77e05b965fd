"""Backends implement the math (norms, attention with KV cache, FFN, head) on one array library.

The contract every backend fulfils is `base.Backend` (written down there once, with the code both
backends share). Cache bookkeeping, I/O, formats and sampling live outside the backends.
"""
