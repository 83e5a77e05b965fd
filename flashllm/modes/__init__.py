"""How layer weights are obtained per token: dense, naive, hybrid, sparse and MoE modes."""
