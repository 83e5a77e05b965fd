"""Text <-> token ids, and chat templates."""
