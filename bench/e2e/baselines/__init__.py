"""Routed-expert baselines for bench_e2e.py: one module per library, each exposing VARIANTS,
a dict {name: (dtype, factory)}. factory(weights) returns routed(x, topk_weights, topk_ids)
-> y_routed [T, H] in x's dtype (weights prepared once, outside the timed call), or raises
Unsupported naming why the variant has no path on this machine. moe_baselines.py runs them
under the benchmark virtual environment's interpreter (bench/install-deps.sh)."""
