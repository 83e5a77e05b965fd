"""Architecture adapters: one small spec per HF family (dense and mixture-of-experts)."""
