"""Benchmarks (not tests): each sub-benchmark of `hybridmoe bench` is one module here."""
