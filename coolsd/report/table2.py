"""``make paper-table2``: the COOL-SD paper's Table 2 layout for the configured targets, our
numbers with 95% CIs beside the paper's (docs/methods.md#7-reference-numbers) and the difference, as Markdown, CSV and
LaTeX, plus Pareto plots and the paired t-test of accepted length (COOL-SD vs LANTERN++).

``--targets toy`` runs anywhere: the toy world has no paper numbers, so its rows are LlamaGen's
methods with toy metrics (toy_clip, toy_fid; named as what they are). A real target runs where
its weight files are present and otherwise stops, before any work, listing the missing files.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import pandas as pd
import torch

from coolsd.cli.evaluate import build_scorers
from coolsd.metrics.registry import PROTOCOLS, analogues, every_input_spec, metric, protocol_inputs
from coolsd.report.compare import paired_comparison
from coolsd.report.paper import TABLE2_COLUMNS, table2_rows, tag_of
from coolsd.report.plots import pareto_plot
from coolsd.report.real_sweep import real_table2_sweep, row_configs, sweep_missing_inputs
from coolsd.report.sweep import ROOT, ci_text, sweep_frame, toy_sweep
from coolsd.util.records import read_records, write_json_atomic
from coolsd.worlds import world_class

SPEED = {c: c for c in ("accepted_length", "latency_s", "speedup")}
# the paper's quality columns (the columns of TABLE2_COLUMNS that are registered metrics)
QUALITY_COLUMNS = tuple(c for c in TABLE2_COLUMNS if c not in ("accepted_length", "latency_s", "speedup"))


def paper_metrics(target: str) -> dict:
    """The paper's metric -> our summary key on ``target``: a real target reports the paper's own
    metrics; a world that scores its images itself (the toy worlds) reports the metric registered as
    standing for each (``MetricInfo.stands_for``: toy_clip for CLIP, toy_fid for FID; None where it
    has none); a world without images (the lab) none."""
    world_cls = world_class(target)
    if not world_cls.makes_images:
        return {}
    if not world_cls.quality_reads_images:  # its images are scored by evaluate (the toy worlds score their own)
        return {c: c for c in QUALITY_COLUMNS}
    toy = analogues("world")
    return {c: toy.get(c) for c in QUALITY_COLUMNS}


# the per-token quality signals (ours only; docs/signals.md): exact distortion summed over the image, NLL shift of what was emitted vs AR
SIGNALS = {"step_tv": "step TV (sum/image)", "target_nll_minus_ar": "target NLL - AR (nats/token)",
           "target_nll_expected_minus_ar": "expected target NLL - AR (nats/token)",
           "off_support_minus_ar": "off-support - AR (fraction)"}
HEADERS = {**{c: metric(c).header for c in QUALITY_COLUMNS}, "accepted_length": "accepted length",
           "latency_s": "latency (s)", "speedup": "speed-up (same-mode AR)"}
# ours only, beside the paper's speed-up (which is against its eager PyTorch AR): the speed-up against the
# fastest AR the run timed (coolsd.job.summary.FASTEST_AR_REFERENCE), then the quality signals
OURS_ONLY = {"speedup_vs_fastest_ar": "speed-up (fastest AR)", **SIGNALS}


def check_target(target: str):
    """The target's world class; unknown names and worlds without images are errors."""
    path = ROOT / "conf" / "target" / f"{target}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (ROOT / "conf" / "target").glob("*.yaml"))
        raise ValueError(f"unknown target {target!r}: no {path.relative_to(ROOT)}; configured targets: {known}")
    world_cls = world_class(target)
    if not world_cls.makes_images:
        raise ValueError(f"target {target!r} is the theory lab (exact statistics), not an image target")
    return world_cls


def real_metric_names(a, names=QUALITY_COLUMNS) -> list[str]:
    """The metrics among ``names`` (default: the paper's quality columns) a report computes on real
    targets: every one, an optional extra (``MetricInfo.optional``: ImageReward, HPSv2) only where its
    first input is set (``--ir-checkpoint``, ``--hps-checkpoint``, or their variables)."""
    proto = PROTOCOLS.get(a.protocol)

    def given(m):
        first = protocol_inputs(proto, metric(m))[0]
        return getattr(a, first.dest, None) is not None

    return [m for m in names if not metric(m).optional or given(m)]


def metric_inputs(a, names=QUALITY_COLUMNS) -> dict:
    """name -> (path, source) of what the real-target metrics need under ``a.protocol``
    (their ``InputSpec``s, ``coolsd.metrics.registry``)."""
    proto = PROTOCOLS.get(a.protocol)
    out = {}
    for name in real_metric_names(a, names):
        for spec in protocol_inputs(proto, metric(name)):
            value = spec.resolve(getattr(a, spec.dest, None))
            if value is None and spec.optional:
                continue
            out[spec.name] = (value, f"{spec.source}" + (f" [${spec.env}]" if spec.env else ""))
    return out


def real_scorers(a, names=QUALITY_COLUMNS) -> dict:
    """The metric networks of ``coolsd.cli.evaluate``, built once for every run of the sweep."""
    proto = PROTOCOLS.get(a.protocol)
    wanted = real_metric_names(a, names)
    inputs = {s.dest: getattr(a, s.dest, None) for m in wanted for s in protocol_inputs(proto, metric(m))}
    return {"scorers": build_scorers(wanted, device=a.metrics_device, cache_dir=ROOT / "outputs" / "cache",
                                     fid_resamples=a.fid_resamples, protocol=a.protocol, **inputs),
            "protocol": a.protocol}


def build_table(target: str, table: dict) -> pd.DataFrame:
    df = sweep_frame(table).set_index("tag")
    ours = {**paper_metrics(target), **SPEED}
    rows = []
    for r in table2_rows(target):
        tag = tag_of(r["method"], r["params"])
        row = {"target": target, "method": r["label"], "tag": tag}
        for col in TABLE2_COLUMNS:
            name = ours[col]
            have = name is not None and name in df.columns and pd.notna(df.loc[tag, name])
            row[f"{col}_ours_metric"] = name
            row[f"{col}_ours"] = float(df.loc[tag, name]) if have else None
            row[f"{col}_lo"] = float(df.loc[tag, name + "_lo"]) if have else None
            row[f"{col}_hi"] = float(df.loc[tag, name + "_hi"]) if have else None
            row[f"{col}_paper"] = r["paper"][col]
            both = have and r["paper"][col] is not None and name == col
            row[f"{col}_diff"] = row[f"{col}_ours"] - r["paper"][col] if both else None
        for name in OURS_ONLY:  # the paper reports no such number
            have = name in df.columns and pd.notna(df.loc[tag, name])
            row.update({k: float(df.loc[tag, k]) if have and k in df.columns else None
                        for k in (name, name + "_lo", name + "_hi")})
        row["fastest_ar"] = table[tag].get("fastest_ar")
        rows.append(row)
    return pd.DataFrame(rows)


def _cell(r, col, latex=False):
    v = r[f"{col}_ours"]
    digits = metric(col).digits if col in QUALITY_COLUMNS else 3 if col == "latency_s" else 2
    fmt = "{:.%df}" % digits
    lo, hi = r[f"{col}_lo"], r[f"{col}_hi"]
    ours = ("-" if v is None or pd.isna(v) else f"{fmt.format(v)} (no CI)" if lo is None or pd.isna(lo)
            else f"{fmt.format(v)} [{fmt.format(lo)}, {fmt.format(hi)}]")
    p = r[f"{col}_paper"]
    paper = "-" if p is None or pd.isna(p) else fmt.format(p)
    d = r[f"{col}_diff"]
    diff = "" if d is None or pd.isna(d) else f" ({'+' if d >= 0 else ''}{fmt.format(d)})"
    return ours, paper + diff


def write_tables(df: pd.DataFrame, out: Path) -> None:
    cols = list(TABLE2_COLUMNS)

    def ours_header(c):  # name the metric we computed where it is not the paper's (toy_clip, toy_fid)
        names = sorted({r[f"{c}_ours_metric"] for _, r in df.iterrows() if r[f"{c}_ours_metric"] not in (None, c)})
        return f"{HEADERS[c]} ours" + (f" ({'/'.join(names)})" if names else "")

    md = ["| target | method | " + " | ".join(f"{ours_header(c)} | {HEADERS[c]} paper (diff)" for c in cols) + " | "
          + " | ".join(f"{h} ours" for h in OURS_ONLY.values()) + " |",
          "|---|---|" + "---|---|" * len(cols) + "---|" * len(OURS_ONLY)]
    fastest_head = f"{OURS_ONLY['speedup_vs_fastest_ar']} ours"
    tex = [r"\begin{tabular}{ll" + "rr" * len(cols) + "r}", r"\toprule",
           "target & method & " + " & ".join(f"{ours_header(c)} & paper".replace("_", r"\_") for c in cols)
           + f" & {fastest_head}" + r" \\", r"\midrule"]
    for _, r in df.iterrows():
        cells = [_cell(r, c) for c in cols]
        ours = [ci_text(r, k, "{:+.4f}" if k.endswith("minus_ar") else "{:.2f}") for k in OURS_ONLY]
        md.append(f"| {r['target']} | {r['method']} | " + " | ".join(f"{o} | {p}" for o, p in cells) + " | "
                  + " | ".join(ours) + " |")
        esc = lambda s: s.replace("_", r"\_").replace("[", "{[}").replace("]", "{]}")  # noqa: E731
        tex.append(f"{esc(r['target'])} & {esc(r['method'])} & " + " & ".join(f"{esc(o)} & {esc(p)}" for o, p in cells)
                   + f" & {esc(ours[0])}" + r" \\")
    tex += [r"\bottomrule", r"\end{tabular}"]
    metric_names = sorted({f"{c}: {r[f'{c}_ours_metric']}" for _, r in df.iterrows() for c in cols
                           if r[f"{c}_ours_metric"] and r[f"{c}_ours_metric"] != c})
    fastest = sorted({f"{r['target']}: {r['fastest_ar']}" for _, r in df.iterrows() if r.get("fastest_ar")})
    note = ("Ours: mean [95% CI] over prompts; paper: COOL-SD Table 2 (A100 40GB). Speed-up (same-mode AR): against "
            "AR run in the row's own mode (eager unless compile=true) on the same prompts, as the paper measures "
            "against its eager PyTorch AR. Speed-up (fastest AR), ours only: against the faster of that AR and "
            "compiled AR (static KV cache, CUDA graphs; timed on CUDA unless fastest_ar=false) on the same prompts; "
            "where only one AR ran it equals the same-mode speed-up"
            + (f" (fastest AR: {', '.join(fastest)})" if fastest else "") + ". The last four columns, also ours "
            "only: the exact distortion of each token's emitted distribution summed over the image (docs/distortion.md; "
            "empty for trees), the target's NLL of the emitted tokens, its exact expectation given what preceded each "
            "draw (-sum pi log p: the same mean, less noise) and the tokens' fraction outside the warped support, "
            "paired by prompt against AR. "
            + (f"Columns computed with other metrics: {', '.join(metric_names)} (toy metrics are not CLIP / FID, so "
               "no difference is shown)." if metric_names else ""))
    (out / "table2.md").write_text(note + "\n\n" + "\n".join(md) + "\n")
    (out / "table2.tex").write_text("% " + note + "\n" + "\n".join(tex) + "\n")
    df.to_csv(out / "table2.csv", index=False)


def report_args(doc: str, name: str, toy_prompts: int, protocol: str = "lantern") -> argparse.ArgumentParser:
    """The command line of a report over targets (``make paper-table2``, ``make sota-table``):
    targets, prompts, output and records folders, overrides, the evaluation protocol (default
    ``protocol``) and the metric files of real targets: ``--clip`` / ``--inception`` default to the
    protocol's environment variables (``report_prelude``), every other input of a registered metric
    (``InputSpec``: ``--coco-images``, ``--ir-*``, ``--hps-*``) to its own."""
    env = os.environ.get
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default="toy", help="comma-separated target names (conf/target/*.yaml)")
    ap.add_argument("--prompts", type=int, default=None,
                    help=f"prompts per target (default: toy {toy_prompts}, real 5,000 as the paper)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / name)
    ap.add_argument("--records", type=Path, default=None, help=f"records folder (default outputs/{name}/<time>)")
    ap.add_argument("--override", action="append", default=[], help="a Hydra override for every real-target run")
    ap.add_argument("--protocol", choices=PROTOCOLS.names(), default=protocol,
                    help=f"how CLIP score and FID are computed (coolsd.metrics.protocols; default {protocol})")
    ap.add_argument("--clip", default=None, help="CLIP folder (default: $CLIP_DIR, or $CLIP_B16_DIR under sjd)")
    ap.add_argument("--inception", default=None,
                    help="FID Inception weights (default: $INCEPTION_WEIGHTS, or $PT_INCEPTION_WEIGHTS under sjd)")
    protocol_flags = {f for p in PROTOCOLS.names() for f in PROTOCOLS.get(p).inputs}
    for flag, specs in every_input_spec().items():
        if flag not in protocol_flags:
            spec = specs[0]
            ap.add_argument(flag, default=env(spec.env) if spec.env else None,
                            help=f"{spec.help} [{'$' + spec.env if spec.env else 'no variable'}]")
    ap.add_argument("--metrics-device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--fid-resamples", type=int, default=100)
    return ap


def report_prelude(a, name: str, make: str, configs, metrics=QUALITY_COLUMNS):
    """(targets, records root, metric scorers or None) of a report's arguments ``a``: every target
    known and, for real ones, every input file present (one list, before any work starts);
    ``configs(target, prompts, records, overrides)``: its (tag, job config) rows."""
    targets = [t.strip() for t in a.targets.split(",") if t.strip()]
    for spec in PROTOCOLS.get(a.protocol).inputs.values():  # its environment variable where the flag is not given
        if getattr(a, spec.dest, None) is None and spec.env:
            setattr(a, spec.dest, os.environ.get(spec.env))
    records_root = a.records or ROOT / "outputs" / name / time.strftime("%Y-%m-%d_%H-%M-%S")
    for t in targets:
        check_target(t)
    missing = []
    for t in (t for t in targets if t != "toy"):
        cfg = configs(t, a.prompts or 5000, records_root / t, a.override)[0][1]
        missing += [f"{t}: {m}" for m in sweep_missing_inputs(cfg, metric_inputs(a, metrics))]
    if missing:
        raise SystemExit(f"make {make} cannot run; missing:\n  " + "\n  ".join(missing))
    scorers = real_scorers(a, metrics) if any(t != "toy" for t in targets) else None
    a.out.mkdir(parents=True, exist_ok=True)
    return targets, records_root, scorers


def main(argv=None):
    a = report_args(__doc__, "paper_table2", 60).parse_args(argv)
    targets, records_root, scorers = report_prelude(a, "paper_table2", "paper-table2", row_configs)
    frames, summaries = [], {}
    coolsd_tag, lantern_tag = tag_of("coolsd", {"delta": 1.1}), tag_of("lantern_pp", {"lam": 2.0, "k": 10})
    for t in targets:
        if t == "toy":
            specs = [(tag_of(r["method"], r["params"]), r["method"], r["params"]) for r in table2_rows(t)]
            res = toy_sweep(specs, a.prompts or 60, records_root / t)
            recs = read_records(records_root / t / "samples.jsonl")
            test = paired_comparison(recs, coolsd_tag, recs, lantern_tag)
        else:
            res = real_table2_sweep(t, a.prompts or 5000, records_root / t, scorers, a.override)
            test = paired_comparison(read_records(Path(res["runs"][coolsd_tag]) / "samples.jsonl"), "coolsd",
                                     read_records(Path(res["runs"][lantern_tag]) / "samples.jsonl"), "lantern_pp")
        metrics = [m for m in paper_metrics(t).values() if m is not None]  # the target's quality columns
        summaries[t] = {"env": res["env"], "results": res["table"], "ttest_coolsd_1.1_vs_lantern_pp": test}
        frames.append(build_table(t, res["table"]))
        pareto_plot(sweep_frame(res["table"]), a.out / f"pareto_{t}.png", metrics,
                    f"{t}: quality against acceleration (95% CIs), Table 2 methods")
    df = pd.concat(frames, ignore_index=True)
    write_tables(df, a.out)
    write_json_atomic(summaries, a.out / "summary.json")
    print((a.out / "table2.md").read_text())
    for t, s in summaries.items():
        x = s["ttest_coolsd_1.1_vs_lantern_pp"]
        print(f"{t}: accepted length coolsd 1.1 - lantern_pp = {x['diff']['mean']:+.3f} "
              f"[{x['diff']['lo']:+.3f}, {x['diff']['hi']:+.3f}], paired t-test p = {x['p_value']:.3g} (n = {x['n']})")
    print(json.dumps({"wrote": str(a.out), "records": str(records_root)}))


if __name__ == "__main__":
    main()
