"""benchmarks/row_parallel.py --quick: the lab's tables are written, ZipAR's exact TV is above 0 at
every window and below the mean summed step TV (the signal's bound), and every PJD setting reports
its tokens per forward, its sampled TV beside the null band and a chi-square p-value."""
import json
from pathlib import Path
from factories import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run(tmp_path):
    bench = load_benchmark("row_parallel")
    bench.main(["--quick", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "summary.json").read_text())
    assert [x["window"] for x in data["lab"]["zipar"]] == [1, 2]
    for x in data["lab"]["zipar"]:
        assert 0.05 < x["tv"] <= x["expected_step_tv"] + 1e-12 and x["tokens_per_forward"] > 1
    assert len(data["lab"]["pjd"]) == 5
    for x in data["lab"]["pjd"]:
        assert x["tokens_per_forward"] > 1 and 0 <= x["chi_square_p"] <= 1 and x["null_tv"]["p95"] > 0
    md = (tmp_path / "README.md").read_text()
    assert "## Lab, ZipAR" in md and "## Lab, PJD" in md
