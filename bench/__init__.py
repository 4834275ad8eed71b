"""Benchmarks (results in docs/benchmarks/). Run from the repository root as `python -m bench.bench_x`; each
script's CPU smoke mode runs in CI (tests/bench/test_bench_smoke.py)."""
