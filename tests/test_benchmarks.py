"""benchmarks/gpu.py runs end to end (tiny shapes on the CPU): the numbers it commits come from
the production loop, and self-drafting accepts every drafted token."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_benchmark_smoke_run(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "benchmarks" / "gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(["--tiny", "--device", "cpu", "--dtype", "float32", "--repeats", "1", "--out", str(tmp_path)])
    gen = out["generation"]
    assert gen["ar"]["accepted_length"] == 1.0 and gen["ar"]["speedup"] == 1.0
    for name in ("eagle_self", "coolsd2_self"):  # the target drafting for itself: whole tree paths accepted
        assert 4.5 < gen[name]["accepted_length"] <= 5.0
    assert out["forwards_batch1"]["tree_tokens"] == 26 and out["bandwidth_gbs"] is None
    assert json.loads((tmp_path / "tiny_cpu.json").read_text())["image_tokens"] == 16
    assert "| eagle_self |" in (tmp_path / "tiny_cpu.md").read_text()
    assert bench.bandwidth_of("NVIDIA H200") == 4800 and bench.bandwidth_of("NVIDIA A100-SXM4-40GB") == 1555
