"""hybridmoe: run and serve Mixture-of-Experts LLMs whose experts do not all fit on the GPU."""

__version__ = "0.1.0"
