"""benchmarks/op_counts.py: the counting rules on small known functions (a kernel per op, none for a
view, one for a fused norm that the CPU decomposes, casts apart), and the per-token AR count of tiny
models being linear in the layer count (fixed + slope x layers, measured at 3 layers)."""
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from factories import load_benchmark

bench = load_benchmark("op_counts")


class _RawOps(TorchDispatchMode):
    """Every aten op the dispatcher runs, no rules: what the CPU actually does."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_matmul_and_add_count_two():
    a, b = torch.randn(4, 8), torch.randn(8, 4)
    c = bench.count_ops(lambda: a @ b + 1.0)
    assert c.ops == 2 and c.casts == 0
    assert c.by_op == {"mm": 1, "add": 1}


def test_views_count_zero():
    x = torch.randn(2, 3, 4)
    c = bench.count_ops(lambda: (x.view(6, 4).reshape(3, 8).unsqueeze(0).squeeze(0)[1:, 2:].transpose(0, 1)
                                 .expand(2, -1, -1).select(0, 1).t().split(1),
                                 x.permute(2, 0, 1).unbind(0), torch.view_as_complex(x.view(2, 3, 2, 2)).real))
    assert c.ops == 0 and not c.by_op
    # a reshape that must copy is a clone (one kernel) and a view
    assert bench.count_ops(lambda: x.transpose(1, 2).reshape(2, 12)).by_op == {"clone": 1}


def test_rms_norm_counts_once_though_the_cpu_decomposes_it():
    w = torch.randn(16)
    for x in (torch.randn(3, 16), torch.randn(3, 16).bfloat16()):
        with _RawOps() as raw:
            F.rms_norm(x, (16,), weight=w if x.dtype == torch.float32 else None, eps=1e-6)
        assert len(raw.ops) >= 4  # pow, mean, add, rsqrt, mul... on the CPU
        c = bench.count_ops(F.rms_norm, x, (16,), weight=w if x.dtype == torch.float32 else None, eps=1e-6)
        assert c.ops == 1 and c.casts == 0 and c.fused == 1, (x.dtype, c.by_op)
    # the same for attention (a boolean mask: the CPU converts it and runs flash attention)
    q = torch.randn(1, 2, 4, 8)
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    assert bench.count_ops(F.scaled_dot_product_attention, q, q, q, attn_mask=mask).ops == 1


def test_a_cast_counts_one_op_and_one_cast():
    x = torch.randn(4, 4).bfloat16()
    c = bench.count_ops(lambda: x.to(torch.float32))
    assert (c.ops, c.casts) == (1, 1)
    assert bench.count_ops(lambda: x.to(torch.bfloat16)).ops == 0  # no conversion, no kernel
    c = bench.count_ops(lambda: torch.zeros(4, 4).copy_(x))  # a fill, then a copy between dtypes
    assert (c.ops, c.casts) == (2, 1)
    c = bench.count_ops(lambda: (x > 0).long())
    assert (c.ops, c.casts) == (2, 1)


def test_host_reads_count_once():
    x = torch.arange(3)
    c = bench.count_ops(lambda: (x.tolist(), int(x[0]), bool(x[1])))
    assert c.host_reads == 3 and c.ops == 0


def test_ar_count_per_token_is_linear_in_the_layer_count():
    built = bench.specs("llamagen", (1, 2, 3), tiny=True)  # one set of weights, layers past the first zeroed
    ar = {"ar": bench.build_method("ar")}
    per = {}
    for L in (1, 2, 3):
        m = bench.measure("llamagen", L, spec=built[L], method_set=ar, signals=False, ar_tokens=6,
                          warm=L == 1, log=lambda *a: None)
        per[L] = m["ar"]
        assert m["ar"]["steady_rounds"] == [1, 4]
    for q in ("ops", "casts"):
        fit = bench.linear_fit({1: per[1][q], 2: per[2][q]}, 3)
        assert fit["per_layer"] > 0 and fit["fixed"] > 0
        assert per[3][q] == fit["full"], (q, per, fit)
    assert per[1]["ops"] > 100 and per[1]["host_reads"] >= 1
    assert per[1]["sides"]["target"] > per[1]["sides"].get("loop", 0)


def test_a_token_from_one_run_equals_the_two_run_difference():
    """The steady rounds of one run (``per_round``) count what a longer run adds over a shorter one."""
    spec = bench.specs("llamagen", (1,), tiny=True)[1]
    ar = bench.build_method("ar")
    bench.generate(spec, ar, 2, True)  # one-time work
    short, long = (bench.counted_run(spec, ar, n, True) for n in (5, 9))
    one = bench.per_round(long, 0)["count"]
    two = bench.two_run_difference(short, long)
    assert (one.ops, one.casts, one.host_reads) == (two.ops, two.casts, two.host_reads)
    assert long.flushes and 0 < one.where(bench._is_flush).ops < 1  # a flush's ops over the rounds it holds
