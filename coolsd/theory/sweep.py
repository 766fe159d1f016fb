"""Exact TV against accepted length for every method and schedule on seeded random tabular
pairs: the COOL-SD trade-off (Prop. 2: annealed omega beats uniform at equal acceptance),
computed exactly, with no sampling noise; the training-free parallel decoders (SJD, MC-SJD, GSD)
beside them from sampled runs of the production loop (``SAMPLED_CURVES``). Any registered method,
one from outside the package included, joins as a curve of its own: ``python -m coolsd.theory
--include PATH --curve NAME KEY=V1,V2,...`` (exact where ``exact_stats`` covers it, else sampled).
``--check NAME [KEY=V ...]`` instead samples the method's rule and holds its emitted tokens
against the rule's ``emitted()`` (``coolsd.theory.contract``); exit status 1 if they differ."""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from coolsd.engine import plugins
from coolsd.engine.methods import check_params, method_info
from coolsd.theory.contract import check_emitted, report
from coolsd.theory.lab import exact_stats, has_exact_stats, sample_stats
from coolsd.theory.stats import total_variation
from coolsd.theory.tabular import TabularAR
from coolsd.util.errors import ConfigError

DELTAS = (1.0, 1.25, 1.5, 2.0, 3.0, 4.0)
LAMS = (1.0, 1.5, 2.0, 3.0, 5.0)
PRICES = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0)  # method=budget (docs/methods.md 2.1); the parameter column holds the price
CURVES = {
    "uniform_rsd": [("uniform_rsd", {"delta": d}) for d in DELTAS],
    "coolsd exp (mean)": [("coolsd", {"delta": d, "schedule": "exp"}) for d in DELTAS],
    "coolsd exp_geomean": [("coolsd", {"delta": d, "schedule": "exp_geomean"}) for d in DELTAS],
    "coolsd linear": [("coolsd", {"delta": d, "schedule": "linear"}) for d in DELTAS],
    "coolsd toward_one": [("coolsd", {"delta": d, "schedule": "toward_one"}) for d in DELTAS],
    "lantern_pp k=2": [("lantern_pp", {"lam": l, "k": 2}) for l in LAMS],
    "lantern_pp k=2 +G*": [("lantern_pp", {"lam": l, "k": 2, "resample": "gstar"}) for l in LAMS],
    "budget (KL price)": [("budget", {"price": p}) for p in PRICES],
}


# training-free parallel decoders: the target drafts for itself through SJD's window
# (W = draft_length + 1), so their rounds carry drafts across rounds and have no exact solver here;
# their TV is that of n sampled sequences through the production loop (sample_stats), plotted
# beside the same statistic of n i.i.d. draws from the target (the sampling noise floor: a lossless
# method sits on it). "accepted length" = tokens per target forward, as for the drafted methods.
GROUPS = (1, 2, 3, 4)
SAMPLED_CURVES = {
    "sjd": [("sjd", {})],
    "mc_sjd maximal": [("mc_sjd", {"coupling": "maximal"})],
    "mc_sjd gumbel": [("mc_sjd", {"coupling": "gumbel"})],
    "sjd_pac width 2": [("sjd_pac", {"tree_width": 2, "tree_depth": 3})],
    "sjd_pac width 4": [("sjd_pac", {"tree_width": 4, "tree_depth": 3})],
    "gsd (G ranks, no p filter)": [("gsd", {"G": g, "p_thr": None}) for g in GROUPS],
    "gsd +G*": [("gsd", {"G": g, "p_thr": None, "resample": "gstar"}) for g in GROUPS],
}
N_SAMPLED = 100_000


def lab_pairs(vocab: int, length: int, mix: float, seeds):
    """(target, draft) pairs: draft = (1-mix)*target + mix*independent random model."""
    for s in seeds:
        P = TabularAR.random(vocab, length, seed=1000 + s, concentration=0.5)
        R = TabularAR.random(vocab, length, seed=2000 + s, concentration=0.5)
        yield s, P, TabularAR.mix(P, R, mix)


def _exact(st: dict) -> dict:
    """The sweep's columns of ``exact_stats``: sequence TV / KL to the target, the expected summed
    per-token distortion (what a run's step_tv / step_kl estimate), the accepted length."""
    return {k: st[k] for k in ("tv", "kl", "expected_step_tv", "expected_step_kl", "accepted_length")}


def sampled_rows(P, seed: int, draft_length: int, n: int) -> list[dict]:
    """The SAMPLED_CURVES points of one pair, and the noise floor (TV of n i.i.d. target draws)."""
    exact = P.sequence_distribution()
    draws = np.random.default_rng(seed).multinomial(n, exact / exact.sum())
    rows = [{"curve": "i.i.d. target draws (noise floor)", "seed": seed, "method": "target", "param": 0.0,
             "tv": total_variation(draws / n, exact), "accepted_length": 1.0, "sampled": True}]
    for curve, items in SAMPLED_CURVES.items():
        for method, params in items:
            st = sample_stats(P, P, method, draft_length, n, seed=seed, window=draft_length + 1, **params)
            rows.append({"curve": curve, "seed": seed, "method": method, "param": float(params.get("G", 0)),
                         "tv": st["tv_to_target"], "accepted_length": st["accepted_length"], "sampled": True})
    return rows


def parse_curve(words: list[str]) -> tuple[str, list[dict]]:
    """``--curve NAME KEY=V1,V2,... [KEY2=W]``: (label, the points' parameters). Values are numbers
    where they parse as one (else strings, ``null`` = None); a key with one value holds it at every
    point, the others must list as many values as each other."""
    if not words:
        raise ValueError("--curve needs a method name, then KEY=V1,V2,... (e.g. --curve coolsd delta=1.5,2)")
    name, specs = words[0], words[1:]
    method_info(name)  # a ValueError naming the valid methods
    cols = {}
    for spec in specs:
        key, eq, values = spec.partition("=")
        if not eq or not values:
            raise ValueError(f"--curve {name}: {spec!r} is not KEY=V1,V2,...")
        cols[key] = [parse_value(v) for v in values.split(",")]
    n = max((len(v) for v in cols.values()), default=1)
    if any(len(v) not in (1, n) for v in cols.values()):
        raise ValueError(f"--curve {name}: the swept keys list different numbers of values: {cols}")
    points = [{k: v[i] if len(v) > 1 else v[0] for k, v in cols.items()} for i in range(n)]
    return " ".join(words), points


def run_checks(ap, include: list, checks: list[list[str]]) -> int:
    """``--check``: each method's rule contract (``coolsd.theory.contract.check_emitted``), printed;
    0 if every rule's emitted tokens follow its ``emitted()``, else 1."""
    try:
        plugins.load(include)
        todo = []
        for words in checks:
            name, params = words[0], {}
            for spec in words[1:]:
                key, eq, value = spec.partition("=")
                if not eq:
                    raise ValueError(f"--check {name}: {spec!r} is not KEY=VALUE")
                params[key] = parse_value(value)
            check_params(name, params)
            todo.append((name, params))
    except (ValueError, ConfigError) as e:
        ap.error(str(e))
    ok = True
    for name, params in todo:
        try:
            result = check_emitted(name, **params)
        except ValueError as e:
            ap.error(str(e))
        print(report(result))
        ok &= result["ok"]
    return 0 if ok else 1


def parse_value(text: str):
    if text == "null":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def curve_rows(label: str, method: str, points: list[dict], seed, P, Q, draft_length: int, n: int) -> list[dict]:
    """One curve's rows on one pair: exact where ``exact_stats`` covers the method, else ``n``
    sampled sequences of the production loop (a Jacobi method drafts from the target itself)."""
    rows = []
    for i, params in enumerate(points):
        swept = [v for v in params.values() if isinstance(v, (int, float))]
        param = float(swept[0]) if swept else float(i)
        if has_exact_stats(method):
            st = _exact(exact_stats(P, Q, method, draft_length, **params))
            rows.append({"curve": label, "seed": seed, "method": method, "param": param, **st})
        else:
            jacobi = method_info(method).jacobi
            st = sample_stats(P, P if jacobi else Q, method, draft_length, n, seed=seed, **params)
            rows.append({"curve": label, "seed": seed, "method": method, "param": param,
                         "tv": st["tv_to_target"], "accepted_length": st["accepted_length"], "sampled": True})
    return rows


def run_sweep(vocab=4, length=5, draft_length=4, mix=0.4, seeds=(0, 1, 2), n_sampled=N_SAMPLED,
              extra: tuple = (), curves=None) -> pd.DataFrame:
    """Every curve on every pair (``curves``: only these of ``CURVES``, by name; EAGLE always);
    ``extra``: (label, method, points) curves of any registered method."""
    rows = []
    for seed, P, Q in lab_pairs(vocab, length, mix, seeds):
        for label, method, points in extra:
            rows += curve_rows(label, method, points, seed, P, Q, draft_length, n_sampled or N_SAMPLED)
        if n_sampled:
            rows += sampled_rows(P, seed, draft_length, n_sampled)
        base = exact_stats(P, Q, "eagle", draft_length)
        rows.append({"curve": "eagle", "seed": seed, "method": "eagle", "param": 1.0, **_exact(base)})
        for curve, items in CURVES.items():
            if curves is not None and curve not in curves:
                continue
            for method, params in items:
                st = exact_stats(P, Q, method, draft_length, **params)
                rows.append({"curve": curve, "seed": seed, "method": method,
                             "param": params.get("delta", params.get("lam", params.get("price"))), **_exact(st)})
    return pd.DataFrame(rows)


def plot(df: pd.DataFrame, path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mean = df.groupby(["curve", "param"], as_index=False)[["tv", "accepted_length"]].mean()
    fig, ax = plt.subplots(figsize=(9.5, 4.8))
    sampled = set(df.loc[df.get("sampled", False) == True, "curve"]) if "sampled" in df else set()  # noqa: E712
    colours = plt.get_cmap("tab20").colors  # one colour per curve (the default cycle repeats after 10)
    for i, (curve, g) in enumerate(mean.groupby("curve", sort=False)):
        g = g.sort_values("param")
        style = "*" if curve == "eagle" else ("x--" if curve in sampled else "o-")
        ax.plot(g["accepted_length"], g["tv"], style, label=curve + (" [sampled]" if curve in sampled else ""),
                ms=9 if curve == "eagle" else 4, color=colours[(2 * i) % 20 + (2 * i) // 20 % 2])
    ax.set_xlabel("accepted length (tokens per target forward)")
    ax.set_ylabel("TV to the target's sequence distribution\n(exact; [sampled]: n sequences, with its noise floor)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: no curve hidden
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    fig.savefig(path.with_suffix(".pdf"))
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m coolsd.theory", description=__doc__)
    ap.add_argument("--vocab", type=int, default=4)
    ap.add_argument("--length", type=int, default=5)
    ap.add_argument("--draft-length", type=int, default=4)
    ap.add_argument("--mix", type=float, default=0.4, help="draft = (1-mix)*target + mix*random")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--n-sampled", type=int, default=N_SAMPLED,
                    help="sequences per sampled point of the parallel decoders (0: exact curves only)")
    ap.add_argument("--out", type=Path, default=Path("results/theory"))
    ap.add_argument("--include", action="append", default=[], metavar="PATH",
                    help="a Python file or folder of them that registers methods (coolsd.engine.plugins)")
    ap.add_argument("--curve", action="append", nargs="+", default=[], metavar="WORD",
                    help="NAME KEY=V1,V2,...: a curve of any registered method (repeatable)")
    ap.add_argument("--check", action="append", nargs="+", default=[], metavar="WORD",
                    help="NAME [KEY=V ...]: sample the method's rule and test its emitted tokens against its "
                         "emitted() (repeatable; no sweep runs; exit status 1 if any differs)")
    a = ap.parse_args(argv)
    if a.check:
        raise SystemExit(run_checks(ap, a.include, a.check))

    try:
        plugins.load(a.include)
        extra = [(label, words[0], points) for words in a.curve for label, points in [parse_curve(words)]]
        for _, method, points in extra:
            for params in points:
                check_params(method, params)
    except (ValueError, ConfigError) as e:
        ap.error(str(e))
    df = run_sweep(a.vocab, a.length, a.draft_length, a.mix, a.seeds, a.n_sampled, extra)
    a.out.mkdir(parents=True, exist_ok=True)
    df.to_csv(a.out / "tv_vs_accepted_length.csv", index=False)
    title = (f"Exact trade-off on random tabular models\n(V={a.vocab}, N={a.length}, chain L={a.draft_length},"
             f" draft mix {a.mix}; mean of {len(a.seeds)} seeds)")
    plot(df, a.out / "tv_vs_accepted_length.png", title)
    summary = df.groupby(["curve", "param"])[["accepted_length", "tv", "expected_step_tv"]].mean().round(4)
    print(summary.to_string())
    print(f"wrote {a.out / 'tv_vs_accepted_length.csv'} and .png/.pdf")


if __name__ == "__main__":
    main()
