"""benchmarks/budget_toy.py on 4 prompts in batches of 2: every configuration is written, and each
budget's mean summed step TV is what the controller's telescoping identity predicts from its first
and last price (docs/methods.md 2.1), exactly: the job applied the rule batch by batch."""
from factories import load_benchmark


def test_quick_run(tmp_path):
    out = load_benchmark("budget_toy").main(["--prompts", "4", "--budgets", "3", "--batch-size", "2", "--threads", "1",
                                             "--out", str(tmp_path / "out"), "--records", str(tmp_path / "rec")])
    tuned = [r for r in out["rows"] if r["tv_per_image"] is not None]
    assert len(tuned) == 1 and len(set(tuned[0]["price"])) == 2  # two batches, two prices
    assert abs(tuned[0]["predicted"] - tuned[0]["mean_step_tv"]["mean"]) < 1e-9
    assert "| budget_tv_3 | 3.0 |" in (tmp_path / "out" / "README.md").read_text()
