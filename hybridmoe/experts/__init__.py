"""Routed experts: where they live (store, GPU cache), where they run (planner, executors)."""
