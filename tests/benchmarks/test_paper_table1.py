"""benchmarks/continuous_sweep.py (``make paper-table1``) on a real continuous target's classes: xAR on
tiny random files (``--target xar_h --override ...``), the paper's rule at two batch sizes, its
tables from the runs."""
import json

import factories
from factories import load_benchmark


def test_paper_table1_grid_runs_on_xar(xar_files, tmp_path):
    bench = load_benchmark("continuous_sweep")
    overrides = [x for o in factories.xar_overrides(xar_files) for x in ("--override", o)]
    bench.main(["--target", "xar_h", *overrides, "--prompts", "2,2", "--batches", "1,2", "--gammas", "2,4",
                "--modes", "paper", "--no-warmup", "--out", str(tmp_path / "out"), "--records", str(tmp_path / "rec")])
    out = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert out["env"]["target"] == "xar_h" and out["env"]["head"]["unit"] == 2
    rows = out["rows"]
    main = [r for r in rows if r["equal_forwards_of"] is None]
    assert {(r["batch"], r["config"]) for r in main} == {(b, c) for b in (1, 2) for c in ("ar", "cspd_g2", "cspd_g4")}
    for r in main:  # 8 steps of 2 tokens: 1 pre-filled (ceil(0.05 * 8)), then ceil(7 / gamma) target calls
        want = {"ar": 8, "cspd_g2": 1 + 4, "cspd_g4": 1 + 2}[r["config"]]
        assert r["target_forwards"] == want, r
        # the target alone with as many forwards: 16 tokens in steps of a divisor of the 4-token cell
        # (num_iter 4, 8 or 16), the nearest to 5 and to 3 being 4
        assert r["equal_forwards"] == (None if r["config"] == "ar" else "ar_nf4")
    eq = {(r["batch"], r["config"]): r for r in rows if r["equal_forwards_of"] is not None}
    assert eq[1, "ar_nf4"]["target_forwards"] == 4 and eq[1, "ar_nf4"]["equal_forwards_of"] == ["cspd_g2", "cspd_g4"]
    assert "| config | acceptance | target fwd | bs=1 | bs=2 | equal-fwd AR |" in (tmp_path / "out" / "speedup_table.md").read_text()
