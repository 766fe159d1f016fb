"""How lossy is CSpD's parallel verification on an xAR flow model? Measured on a tiny random xAR
pair (docs/design/xar_cspd.md section 4 items 5-6), with the lossless exact prefix mode as the
reference.

The parallel schedule (the paper's setting, ``verify=parallel``) keeps every drafted token, accepted
or resampled, with no rollback: the target verifies a round's gamma steps given the tokens verified
BEFORE the round only, so a token's context at verification is not the context it ends up with. It
is therefore not lossless for gamma >= 2. The exact prefix mode (``mode=exact verify=prefix``) is.

Setup: target = a tiny xAR (4x4 grid of 4-dim tokens in 2x2 cells, width 32, 2 + 2 blocks, every
parameter 0.15 N(0, 1) from seed 0), draft = the weight blend 0.9 target + 0.1 (the same model from
seed 1), so about half the tokens are accepted; fp64, N = 4 SDE steps per unit, cfg 1, final_std
s = 0.05, prefill 0. ``unit`` 1 (16 AR steps of one token) and 4 (4 AR steps of one 2x2 cell, the
released layout); gamma in {1, 2, 4, n_steps}; the exact prefix mode, and the parallel mode with the
exact and the paper rule. The same seeds 0 .. n-1 (labels seed % 10) for every setting.

Per setting:
* the acceptance rate (accepted / verified tokens) and target forwards per image;
* teacher-forced residuals r = (x - mu_p) / s of every output token: mu_p is the target's final
  mean of the token's AR step given the OUTPUT's own earlier steps and the position's aligned noise,
  computed here by a cache-free pass per chain step (``XAR.attend``, not the loop's cache or
  family). A sampler of the target's joint gives iid N(0, 1) residuals: their mean, std and the KS
  p-value against N(0, 1) (n * 16 * 4 values; the most sensitive measure here);
* E2 = the squared energy distance 2 E|X - Y| - E|X - X'| - E|Y - Y'| between image sets (each
  image a 64-dim vector), as a U-statistic: every mean over pairs of DIFFERENT seeds, so E[E2] is
  the population E2 (0 for a lossless sampler) and may come out below 0:
  - ``E2_paired``: against target-only images (``ar_generate(final_noise=True, final_std=s)``) of
    the SAME seeds. A sample and its seed's target-only image share their noise (coupled), so this
    is a low-noise effect size; a bootstrap 95% interval over seeds goes with it;
  - ``E2_unpaired``: against target-only images of seeds n .. 2n-1 with the same labels, and its
    exact permutation p-value under "these are target samples" (within-pair swaps: x_i and its
    same-label partner are then iid);
* the null reference per unit: ``E2_unpaired`` between two independent target-only sets (seeds
  0 .. n-1 and n .. 2n-1) and the quantiles of its swap distribution: what "no distortion" looks
  like for the unpaired statistic at this n. (The paired one of a lossless sampler varies far less,
  because the coupling cancels most of the noise: compare it with the lossless rows and intervals.)

    python benchmarks/xar_cspd_distortion.py                  # 400 seeds, about 5.5 min on 1 thread
    python benchmarks/xar_cspd_distortion.py --seeds 200 --out /tmp/d
    python benchmarks/xar_cspd_distortion.py --quick --out /tmp/q   # the test's run: 8 seeds, ~15 s

Writes <out>/{table.md, table.json, distortion.png} (default results/xar_cspd_distortion/).
"""
from __future__ import annotations

import argparse
import copy
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
from scipy import stats
from scipy.spatial.distance import cdist

from coolsd.engine.continuous.flow import FlowConfig, time_grid, transition
from coolsd.engine.continuous.generate import ar_generate, cspd_generate, position_noise
from coolsd.engine.timing import cpu_name
from coolsd.models.xar import XAR, XARConfig, cell_order
from coolsd.util.records import write_json_atomic

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "xar_cspd_distortion"
ARCH = {"grid": 4, "cell": 2, "token_dim": 4, "dim": 32, "encoder_depth": 2, "decoder_depth": 2, "heads": 2,
        "n_classes": 10}
N_SDE = 4  # Euler-Maruyama steps per unit (draft and target)
FINAL_STD = 0.05
BLEND = 0.1  # draft = (1 - BLEND) target + BLEND other
UNITS = (1, 4)
SCHEDULES = (("prefix", "exact"), ("parallel", "exact"), ("parallel", "paper"))
QUICK = 8  # seeds of --quick (the tests)


def tiny_xar(seed: int, std: float = 0.15) -> XAR:
    """The tiny xAR of ``ARCH`` in fp64, eval mode, every parameter std N(0, 1) from its own generator
    (as tests/factories.py's ``tiny_xar``; upstream zero-inits some parameters, which would hide them)."""
    m = XAR(XARConfig(**ARCH)).to(torch.float64).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)
    return m


def blended(a: XAR, b: XAR, w: float) -> XAR:
    """The model with weights (1 - w) a + w b."""
    m = copy.deepcopy(a)
    with torch.no_grad():
        for p, q in zip(m.parameters(), b.parameters()):
            p.mul_(1 - w).add_(w * q)
    return m


def aligned_noise(model: XAR, seeds, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every position's aligned noise (``position_noise``) in CELL order: x^(K) (B, L, C) and
    eps (K, B, L, C); eps_k drives chain step i = K - 1 - k."""
    c = model.config
    order = cell_order(c).tolist()
    B, L, C = len(seeds), c.seq_len, c.token_dim
    x = torch.zeros(B, L, C, dtype=torch.float64)
    eps = torch.zeros(K, B, L, C, dtype=torch.float64)
    for b, seed in enumerate(seeds):
        for i, j in enumerate(order):
            x[b, i], eps[:, b, i] = position_noise(seed, j, K, C)
    return x, eps


@torch.no_grad()
def residuals(model: XAR, tokens: torch.Tensor, labels: torch.Tensor, noise, unit: int, s: float) -> torch.Tensor:
    """(x - mu_p) / s of every token of ``tokens`` (B, L, C), image order, in cell order: mu_p is the
    target's final mean of the token's AR step of ``unit`` tokens given the output's own earlier
    steps (clean, t = 0) and the aligned noise ``noise`` (``aligned_noise``), by one cache-free
    ``attend`` per chain step over [earlier steps | this step] with a step-causal mask."""
    x0, eps = noise
    B, L, _ = tokens.shape
    cells = tokens[:, cell_order(model.config)].to(torch.float64)
    step_of = torch.arange(L) // unit
    K = eps.shape[0]  # SDE steps per unit
    grid = time_grid(K)
    out = torch.empty_like(cells)
    for st in range(L // unit):
        lo, hi = st * unit, (st + 1) * unit
        vis = (step_of[None, :hi] <= step_of[:hi, None]).expand(B, hi, hi)
        pos = torch.arange(hi).expand(B, hi)
        x = x0[:, lo:hi]
        for i in range(K):
            t, dt = float(grid[i]), float(grid[i + 1] - grid[i])
            tt = torch.cat([torch.zeros(B, lo), torch.full((B, unit), t)], 1)
            v = model.attend(torch.cat([cells[:, :lo], x], 1), pos, model.condition(labels, tt), None, vis)[0]
            mean, std = transition(x, v[:, lo:hi], t, dt, last=i == K - 1)
            x = mean + std * eps[K - 1 - i, :, lo:hi] if std else mean
        out[:, lo:hi] = (cells[:, lo:hi] - x) / s
    return out


def distances(x: np.ndarray) -> np.ndarray:
    """Euclidean distance matrix of the rows of x (n, d), fp64 (differences, not the Gram trick)."""
    return cdist(x, x)


def _e2(pp, qq, rr, rtr, npairs):
    """E2 = 2 E|X - Y| - E|X - X'| - E|Y - Y'| from sums over pairs of different index (pp: X-X, qq:
    Y-Y, rr: X-Y with the trace rtr of the pairs i = j removed), ``npairs`` pairs each."""
    return (2 * (rr - rtr) - pp - qq) / npairs


def energy_distance_sq(x: np.ndarray, y: np.ndarray) -> float:
    """The squared energy distance of two equal-size sets, rows i of x and y a pair, as a U-statistic:
    every mean over pairs i != j, so the pairs i = j (coupled samples of one seed) are left out and
    E[E2] is the population E2 whether or not the pairs are coupled."""
    n = len(x)
    d = distances(np.concatenate([x, y]))
    P, Q, R = d[:n, :n], d[n:, n:], d[:n, n:]
    return float(_e2(P.sum(), Q.sum(), R.sum(), np.trace(R), n * (n - 1)))


def swap_null(x: np.ndarray, y: np.ndarray, n_perm: int, seed: int) -> np.ndarray:
    """``energy_distance_sq`` of ``n_perm`` within-pair swaps (x_i <-> y_i with probability 1/2):
    its exact null distribution when x_i and y_i are independent draws of one distribution (here
    the same class label, different seeds). Vectorised (torch: its one thread): u (n_perm, n) = 1
    where pair i is kept, w = 1 - u, each sum a quadratic form in u and w."""
    n = len(x)
    d = torch.from_numpy(distances(np.concatenate([x, y])))
    P, Q, R = d[:n, :n], d[n:, n:], d[:n, n:]
    u = torch.from_numpy((np.random.default_rng(seed).random((n_perm, n)) < 0.5).astype(np.float64))
    w = 1 - u
    uP, wP, uQ, wQ, uR, wR, uRt, wRt = u @ P, w @ P, u @ Q, w @ Q, u @ R, w @ R, u @ R.T, w @ R.T

    def dot(a, b):  # row-wise
        return (a * b).sum(1)

    within_a = dot(uP, u) + dot(wQ, w) + dot(uR, w) + dot(wRt, u)
    within_b = dot(wP, w) + dot(uQ, u) + dot(wR, u) + dot(uRt, w)
    cross = dot(uR, u) + dot(wRt, w) + dot(uP, w) + dot(wQ, u)
    return _e2(within_a, within_b, cross, float(torch.trace(R)), n * (n - 1)).numpy()


def bootstrap_e2(x: np.ndarray, y: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    """``energy_distance_sq`` of ``n_boot`` bootstrap resamples of the pairs (seeds), every mean over
    pairs of DIFFERENT original seeds (multinomial counts c: sum c_i c_j M_ij - sum c_i^2 M_ii)."""
    n = len(x)
    d = torch.from_numpy(distances(np.concatenate([x, y])))
    P, Q, R = d[:n, :n], d[n:, n:], d[:n, n:]
    c = torch.from_numpy(np.random.default_rng(seed).multinomial(n, np.full(n, 1 / n), size=n_boot).astype(np.float64))
    npairs = n * n - (c * c).sum(1)

    def quad(M):
        return ((c @ M) * c).sum(1)

    return _e2(quad(P), quad(Q), quad(R), (c * c) @ torch.diagonal(R), npairs).numpy()


def flat(tokens: torch.Tensor) -> np.ndarray:
    return tokens.reshape(tokens.shape[0], -1).to(torch.float64).numpy()


def residual_stats(res: torch.Tensor) -> dict:
    r = res.reshape(-1).numpy()
    return {"resid_mean": float(r.mean()), "resid_std": float(r.std()),
            "resid_ks_p": float(stats.kstest(r, "norm").pvalue), "n_resid": int(r.size)}


def settings(unit: int) -> list[tuple[str, str, int]]:
    """(verify, mode, gamma) of every CSpD setting at ``unit``: gamma in {1, 2, 4, n_steps}."""
    gammas = sorted({1, 2, 4, ARCH["grid"] ** 2 // unit})
    return [(verify, mode, g) for verify, mode in SCHEDULES for g in gammas]


def _git_head() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def batched_residuals(model, token_sets, labels, noise, unit, chunk: int = 2048) -> list[torch.Tensor]:
    """``residuals`` of several equal-size token sets of the same seeds in one batch (the passes'
    fixed cost is paid once), split back per set."""
    k, n = len(token_sets), len(labels)
    toks = torch.cat(token_sets)
    lab = labels.repeat(k)
    x0, eps = noise[0].repeat(k, 1, 1), noise[1].repeat(1, k, 1, 1)
    out = torch.cat([residuals(model, toks[i:i + chunk], lab[i:i + chunk], (x0[i:i + chunk], eps[:, i:i + chunk]),
                               unit, FINAL_STD) for i in range(0, len(toks), chunk)])
    return list(out.split(n))


def run(n: int, n_perm: int, n_boot: int, prefill: float, sde_steps: int = N_SDE, log=print) -> dict:
    target, other = tiny_xar(0), tiny_xar(1)
    draft = blended(target, other, BLEND)
    seeds, indep = list(range(n)), list(range(n, 2 * n))
    labels = torch.arange(n) % 10  # the independent set B has the SAME labels (pairs i, n + i share a class)
    noise = aligned_noise(target, seeds, sde_steps)
    rows, nulls = [], []
    for unit in UNITS:
        fc = FlowConfig(num_steps=sde_steps, cfg=1.0, unit=unit)
        n_steps = ARCH["grid"] ** 2 // unit
        t0 = time.perf_counter()
        ref = ar_generate(target, labels, seeds, fc, final_noise=True, final_std=FINAL_STD)
        ref_b = ar_generate(target, labels, indep, fc, final_noise=True, final_std=FINAL_STD).tokens
        X_ref, X_b = flat(ref.tokens), flat(ref_b)
        null = swap_null(X_ref, X_b, n_perm, seed=unit)
        e2_null = energy_distance_sq(X_ref, X_b)
        q = dict(zip(("q025", "q50", "q975", "q99"), np.quantile(null, [0.025, 0.5, 0.975, 0.99]).tolist()))
        nulls.append({"unit": unit, "n_steps": n_steps, "E2_target_vs_target_other_seeds": e2_null, **q,
                      "n_perm": n_perm})
        runs = [({"sampler": "target_only"}, ref, time.perf_counter() - t0)]
        t0 = time.perf_counter()
        runs.append(({"sampler": "draft_only"}, ar_generate(draft, labels, seeds, fc, final_noise=True,
                                                            final_std=FINAL_STD), time.perf_counter() - t0))
        for verify, mode, gamma in settings(unit):
            t0 = time.perf_counter()
            out = cspd_generate(target, draft, labels, seeds, fc, gamma=gamma, mode=mode, verify=verify,
                                prefill=prefill, final_std=FINAL_STD)
            runs.append(({"sampler": "cspd", "verify": verify, "mode": mode, "gamma": gamma, "prefill": prefill}, out,
                         time.perf_counter() - t0))
        res = batched_residuals(target, [o.tokens for _, o, _ in runs], labels, noise, unit)
        for k, ((what, out, seconds), r_k) in enumerate(zip(runs, res)):
            r = {"unit": unit, "n_steps": n_steps, "verify": None, "mode": None, "gamma": None, "prefill": None,
                 **what}
            if what["sampler"] == "cspd":
                ver = sum(c["verified"] for c in out.counters)
                r["acceptance_rate"] = sum(c["accepted"] for c in out.counters) / ver if ver else None
            r["target_forwards_per_image"] = float(np.mean([c["target_forwards"] for c in out.counters]))
            r.update(residual_stats(r_k))
            X = flat(out.tokens)
            if what["sampler"] != "target_only":  # the target's own row: E2 to itself is 0 by construction
                r["E2_paired"] = energy_distance_sq(X, X_ref)
                r["E2_paired_ci95"] = np.quantile(bootstrap_e2(X, X_ref, n_boot, seed=100 + k), [0.025, 0.975]).tolist()
            r["E2_unpaired"] = energy_distance_sq(X, X_b)
            r["E2_unpaired_perm_p"] = float((1 + (swap_null(X, X_b, n_perm, seed=200 + k) >= r["E2_unpaired"]).sum())
                                            / (1 + n_perm))
            r["seconds"] = seconds
            rows.append(r)
            log(f"unit {unit} {r['sampler']:<11} {r['verify'] or '':<8} {r['mode'] or '':<5} gamma {r['gamma'] or '-':<3}"
                f" acc {_f(r.get('acceptance_rate'), 3):>5}  resid mean {r['resid_mean']:+.3f} std {r['resid_std']:.3f}"
                f" KS p {r['resid_ks_p']:.1e}  E2 paired {_f(r.get('E2_paired'), 4):>8}  unpaired"
                f" {r['E2_unpaired']:.4f} (p {r['E2_unpaired_perm_p']:.3f}; null q97.5 {q['q975']:.4f})"
                f"  {seconds:.1f}s", flush=True)
    return {"rows": rows, "null": nulls}


def _f(x, p=3):
    if x is None:
        return "-"
    if isinstance(x, float) and x != 0 and abs(x) < 10 ** -p:
        return f"{x:.1e}"
    return f"{x:.{p}f}" if isinstance(x, float) else str(x)


def _ci(r, p=4):
    ci = r.get("E2_paired_ci95")
    return "-" if ci is None else f"[{_f(ci[0], p)}, {_f(ci[1], p)}]"


def _cell(r, key, p):
    if key == "E2_paired_ci95":
        return _ci(r, p)
    if key == "resid_ks_p" and r[key] == 0.0:
        return "<1e-300"  # below the smallest double
    return _f(r.get(key), p)


# (key, header, decimals); headers say exactly what the number is (docstring at the top)
COLUMNS = [("unit", "unit", 0), ("n_steps", "n_steps", 0), ("sampler", "sampler", 0), ("verify", "verify", 0),
           ("mode", "mode", 0), ("gamma", "gamma", 0), ("acceptance_rate", "acceptance_rate", 3),
           ("target_forwards_per_image", "target_forwards_per_image", 2), ("resid_mean", "resid_mean", 3),
           ("resid_std", "resid_std", 3), ("resid_ks_p", "resid_KS_p_vs_N(0,1)", 3),
           ("E2_paired", "E2_vs_target_same_seeds", 4), ("E2_paired_ci95", "E2_same_seeds_bootstrap95", 4),
           ("E2_unpaired", "E2_vs_target_other_seeds", 4),
           ("E2_unpaired_perm_p", "E2_other_seeds_perm_p", 3)]


def table_md(out: dict) -> str:
    m = out["meta"]
    lines = [f"# CSpD distortion on a tiny xAR flow model ({m['n_seeds']} seeds)", "",
             (f"`{m['command']}` at commit {m['commit']} (uncommitted work in the tree at the time), {m['cpu']}, "
              f"1 thread, {m['seconds']:.0f} s wall, {m['cpu_seconds']:.0f} s CPU. Target: tiny xAR (4x4 grid of "
              f"4-dim tokens, 2x2 cells) seed 0; draft: 0.9 target + 0.1 seed 1 (weights); fp64, {m['sde_steps']} "
              f"SDE steps per unit, cfg 1, final_std {m['final_std']}, prefill {m['prefill']}; seeds "
              f"0..{m['n_seeds'] - 1} (label seed % 10) for every row."), "",
             ("- `resid_*`: teacher-forced residuals r = (x - mu_p) / s of every token (n x 16 x 4 values) under the "
              "target, given the output's own earlier steps and the aligned noise; iid N(0, 1) for a sampler of the "
              "target's joint. `resid_KS_p_vs_N(0,1)`: KS p-value."),
             ("- `E2_*`: squared energy distance 2E|X-Y| - E|X-X'| - E|Y-Y'| between images (64-dim vectors), a "
              "U-statistic (means over pairs of different seeds; can be < 0). `E2_vs_target_same_seeds`: against "
              "target-only images of the same seeds (coupled through the shared noise: low noise, an effect size), "
              f"with a {m['n_boot']}-resample bootstrap 95% interval over seeds. `E2_vs_target_other_seeds`: "
              f"against target-only images of seeds n..2n-1 with the same labels; `E2_other_seeds_perm_p`: its exact "
              f"p-value under 'these are target samples' ({m['n_perm']} within-pair swaps)."),
             ("- `target_only`'s `E2_vs_target_other_seeds` is the null reference below; its residuals check the "
              "residual code."), "",
             "## Null reference: E2 between two independent target-only sets (seeds 0..n-1 vs n..2n-1)", "",
             ("| unit | n_steps | E2_target_vs_target_other_seeds | swap_null_q2.5% | swap_null_q50% | "
              "swap_null_q97.5% | swap_null_q99% |"), "|---|---|---|---|---|---|---|"]
    for z in out["null"]:
        lines.append(f"| {z['unit']} | {z['n_steps']} | {z['E2_target_vs_target_other_seeds']:.4f} | {z['q025']:.4f} "
                     f"| {z['q50']:.4f} | {z['q975']:.4f} | {z['q99']:.4f} |")
    lines += ["", "## Every setting", "", "| " + " | ".join(h for _, h, _ in COLUMNS) + " |",
              "|" + "---|" * len(COLUMNS)]
    for r in out["rows"]:
        lines.append("| " + " | ".join(_cell(r, k, p) for k, _, p in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def plot(out: dict, path: Path) -> None:
    """Row 1: E2 vs target images of OTHER seeds with the null's 95% band (the calibrated view);
    row 2: E2 vs the same seeds with bootstrap 95% intervals (the low-noise effect size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(UNITS), figsize=(5.5 * len(UNITS), 8), layout="constrained", squeeze=False)
    for col, unit in enumerate(UNITS):
        z = next(z for z in out["null"] if z["unit"] == unit)
        rows = [r for r in out["rows"] if r["unit"] == unit]
        dr = next(r for r in rows if r["sampler"] == "draft_only")
        gam = sorted({r["gamma"] for r in rows if r["gamma"]})
        for i, (key, title) in enumerate((("E2_unpaired", "E2 vs target-only, other seeds"),
                                          ("E2_paired", "E2 vs target-only, same seeds"))):
            ax = axes[i, col]
            if key == "E2_unpaired":
                ax.axhspan(z["q025"], z["q975"], color="0.85", label="null 95% band (two target sets)")
                ax.axhline(z["E2_target_vs_target_other_seeds"], color="0.5", ls=":", lw=1,
                           label="target vs target (observed)")
            ax.axhline(0, color="0.3", lw=0.5)
            ax.axhline(dr[key], color="k", ls="--", lw=1, label="draft only")
            for verify, mode in SCHEDULES:
                pts = sorted((r["gamma"], r[key], r.get("E2_paired_ci95")) for r in rows
                             if r["verify"] == verify and r["mode"] == mode)
                g, y, ci = zip(*pts)
                if key == "E2_paired":
                    err = np.abs(np.array(ci).T - np.array(y))
                    ax.errorbar(g, y, yerr=err, fmt="o-", ms=4, capsize=2, label=f"{verify} / {mode}")
                else:
                    ax.plot(g, y, "o-", ms=4, label=f"{verify} / {mode}")
            ax.set_xscale("log", base=2)
            ax.set_xticks(gam, [str(x) for x in gam])
            ax.set_xlabel("gamma (draft steps per round)")
            ax.set_ylabel(title)
            ax.set_title(f"unit {unit} ({z['n_steps']} AR steps)")
            ax.grid(alpha=0.3)
            if col == 0:
                ax.legend(fontsize=7)
    fig.suptitle(f"CSpD on a tiny xAR ({out['meta']['n_seeds']} seeds): squared energy distance to the target's "
                 "samples, prefill 0")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=400, help="samples per setting (seeds 0 .. n-1)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--perm", type=int, default=2000, help="within-pair swaps of each permutation null")
    ap.add_argument("--boot", type=int, default=1000, help="bootstrap resamples of the same-seed E2")
    ap.add_argument("--sde-steps", type=int, default=N_SDE, help="Euler-Maruyama steps per AR step (both models)")
    ap.add_argument("--prefill", type=float, default=0.0, help="fraction of AR steps by the target alone")
    ap.add_argument("--quick", action="store_true", help=f"a tiny run for the tests ({QUICK} seeds, 200 "
                                                         "swaps and resamples)")
    a = ap.parse_args(argv)
    n, n_perm, n_boot, sde_steps = (QUICK, 200, 200, N_SDE) if a.quick else (a.seeds, a.perm, a.boot, a.sde_steps)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        out = run(n, n_perm, n_boot, a.prefill, sde_steps)
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    finally:
        torch.set_num_threads(threads)  # a caller's setting (the tests import main)
    cmd = "python benchmarks/xar_cspd_distortion.py" + (" --quick" if a.quick else f" --seeds {n}")
    if a.prefill:
        cmd += f" --prefill {a.prefill}"
    out = {"meta": {"command": cmd, "commit": _git_head(), "cpu": cpu_name(), "threads": 1, "seconds": seconds,
                    "cpu_seconds": cpu_seconds, "n_seeds": n, "n_perm": n_perm, "n_boot": n_boot,
                    "prefill": a.prefill, "arch": ARCH, "sde_steps": sde_steps, "final_std": FINAL_STD,
                    "draft_blend": BLEND, "units": list(UNITS)}, **out}
    a.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, a.out / "table.json")
    (a.out / "table.md").write_text(table_md(out))
    plot(out, a.out / "distortion.png")
    print(f"wrote {a.out}/table.md, table.json, distortion.png in {seconds:.0f} s ({cpu_seconds:.0f} s CPU)")
    return out


if __name__ == "__main__":
    main()
