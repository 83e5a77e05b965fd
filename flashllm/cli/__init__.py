"""The `flashllm` command: one module per command over the Python API, shared arguments in args.py."""
