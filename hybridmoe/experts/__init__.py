"""Routed experts, in two wings: `plan/` decides where each one runs (pure logic over ids and
numbers, no torch: shared by the engine and the simulator), `run/` holds and runs them (tensors:
the store, the expert arithmetic, the CPU pool, the accelerators, the runtimes). run/ imports
plan/, never the reverse."""
