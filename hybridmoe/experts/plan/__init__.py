"""Where each routed expert runs, as pure logic over ids and numbers: no torch here.

Expert shapes, the cost model and its fitting, the GPU cache and placement, activation statistics,
the predictor, the policies, the planner (and `make_planner`, the one way to build it), hardware
profiles and the routing-trace format. The engine's runtime (experts/run/) and the simulator (sim/)
drive the same planner; tests/test_layering.py checks that this package imports without torch.
"""
