"""The torch backend (CPU and CUDA)."""
