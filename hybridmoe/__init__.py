"""hybridmoe: run and serve Mixture-of-Experts LLMs whose experts do not all fit on the GPU."""

import os

# OpenMP threads that finish a parallel region first spin-wait for the others by default; when the
# cores are shared with other processes, the thread they wait for is often descheduled and the spin
# burns the time it needed. Sleeping instead measured 98 ms against 433 ms median per decode step
# (Qwen3-30B-A3B shapes, 4 layers, 2 threads, load average 6). Read once, when torch loads OpenMP, so
# it only takes effect where hybridmoe is imported before torch (the CLI); set the variable to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
