"""bench/bench_format_accuracy.py's CPU smoke (tiny checkpoint, fp32 reference): every format, branch and layer group
has its errors, the weights are put back after each row, and the formats order as their bits say (Q8_0 and int8
closer than Q4_K; the per-layer mix between Q8_0 and Q4_K)."""
import json

from tests.bench.test_bench_smoke import Smoke, assert_every_part_filled, run_smoke

ARGV = ("bench.bench_format_accuracy", "--tiny", "--json", "{tmp}/out.json")


def test_format_accuracy_smoke(tmp_path):
    run_smoke(list(ARGV), tmp_path, timeout=300)
    out = json.loads((tmp_path / "out.json").read_text())
    assert_every_part_filled(out, Smoke(ARGV, ("rows", "layers", "reference")))
    assert out["restored"] is True
    err = {(r["branch"], r["format"], r["layers"]): r["rel_l2"] for r in out["rows"]}
    groups = {r["layers"] for r in out["rows"]}
    for branch in ("und", "gen"):
        for fmt in ("int8", "fp8", "q8_0", "q4_k"):
            assert all((branch, fmt, g) in err for g in groups - {"all"}), (branch, fmt)
            assert 0 < err[(branch, fmt, "all")] < 0.5
        assert err[(branch, "q8_0", "all")] < err[(branch, "q4_k", "all")]
        assert err[(branch, "int8", "all")] < err[(branch, "q4_k", "all")]
        mix = next(v for (b, f, _), v in err.items() if b == branch and f.startswith("q8_0:"))
        assert err[(branch, "q8_0", "all")] < mix < err[(branch, "q4_k", "all")]
    assert all(r["argmax_agrees"] in (True, False) for r in out["rows"] if r["branch"] == "und")
