"""`flashllm serve`: an OpenAI-compatible HTTP server over one loaded model."""
