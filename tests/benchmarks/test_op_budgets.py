"""The launch budgets of a decode step at LlamaGen-XL shapes (GPT-XL widths, bf16, random weights;
1 and 2 layers fitted to the real 36, ``benchmarks/op_counts.py``): on a GPU at batch 1 a token's
time is its kernel launches, so the eager AR token stays within 800 aten ops and 150 dtype
conversions and its quality signals within 5% of its ops. An EAGLE ``mc_sim_7b_63`` round is held at
``ROUND_CEILING`` AR tokens of ops, what the level-at-a-time drafting (every draw's conditional
normalised at once) and the whole-tree verification (every node's children walked at once, the
path followed by gathers) reach today: the goal is ``BUDGETS["round_in_ar_tokens"]`` (1.4), not
met (results/gpu/README.md: the drafter's five level forwards and fifteen sequential draws alone
are over the 384 fixed ops the goal leaves); the compiled kernels are measured by the benchmark
(results/gpu/op_counts.md)."""
import pytest
from factories import load_benchmark

bench = load_benchmark("op_counts")


# an EAGLE mc_sim_7b_63 round in AR tokens of ops at GPT-XL shapes: 2.82 at e56c179, 2.38 at d30398d,
# 2.03 at 0bd7e19, 1.73 now
ROUND_CEILING = 1.8


@pytest.fixture(scope="module")
def built():
    return bench.specs("llamagen", (1, 2))


@pytest.fixture(scope="module")
def ar_counts(built):
    ar = {"ar": bench.methods()["ar"]}
    return {L: bench.measure("llamagen", L, spec=built[L], method_set=ar, signals=L == 1, warm=L == 1,
                             log=lambda *a: None) for L in (1, 2)}


def test_an_eager_ar_token_at_gpt_xl_shapes_is_within_its_launch_budget(ar_counts):
    fit = {q: bench.linear_fit({L: ar_counts[L]["ar"][q] for L in (1, 2)}, bench.REAL_LAYERS["llamagen"])
           for q in ("ops", "casts", "host_reads")}
    assert fit["ops"]["full"] <= bench.BUDGETS["ar_ops_per_token"], fit["ops"]
    assert fit["casts"]["full"] <= bench.BUDGETS["ar_casts_per_token"], fit["casts"]
    assert fit["host_reads"]["full"] <= 1.0, fit["host_reads"]  # the loop's one status read a token


def test_the_quality_signals_are_within_five_percent_of_an_ar_token(ar_counts):
    on, off = ar_counts[1]["ar"]["ops"], ar_counts[1]["ar_nosignals"]["ops"]
    assert 0 < on - off <= bench.BUDGETS["signals_share"] * on, (on, off)


def test_an_eagle_tree_round_at_gpt_xl_shapes_stays_under_its_ceiling(built, ar_counts):
    eagle = {"eagle": bench.methods()["eagle"]}
    rnd = {L: bench.measure("llamagen", L, spec=built[L], method_set=eagle, signals=False, log=lambda *a: None)
           for L in (1, 2)}
    real = bench.REAL_LAYERS["llamagen"]
    ar = bench.linear_fit({L: ar_counts[L]["ar"]["ops"] for L in (1, 2)}, real)["full"]
    fit = bench.linear_fit({L: rnd[L]["eagle"]["ops"] for L in (1, 2)}, real)
    assert fit["full"] / ar <= ROUND_CEILING, (fit, ar)
    assert rnd[1]["eagle"]["host_reads"] <= 1.0  # the loop's one status read a round
