"""benchmarks/budget_cost.py, eager, batch 1, two prompt groups: both rules decode the same rounds (the
target drafting for itself accepts every draft under both), and the table is written."""
from factories import load_benchmark


def test_quick_run(tmp_path):
    rows = load_benchmark("budget_cost").main(["--modes", "eager", "--batches", "1", "--prompts", "2",
                                               "--out", str(tmp_path)])
    assert len(rows) == 1 and rows[0]["target_forwards_per_image"] < 64 / 4  # whole chains accepted: few forwards
    assert rows[0]["ms_budget"] > 0 and "| eager | 1 |" in (tmp_path / "budget_cost.md").read_text()
