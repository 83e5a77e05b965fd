"""Sparse mode: predictors, the sliding-window neuron cache, read-ahead."""
