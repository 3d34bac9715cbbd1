"""hybridmoe: run and serve Mixture-of-Experts LLMs whose experts do not all fit on the GPU."""

from hybridmoe import env

env.set_defaults()  # before torch loads OpenMP (env.py says why)

__version__ = "0.1.0"
