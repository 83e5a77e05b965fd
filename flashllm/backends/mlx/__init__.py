"""The MLX backend (Metal on Apple silicon; MLX's CPU build elsewhere)."""
