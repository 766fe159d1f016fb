"""``make sota-table TARGETS=toy|lumina_mgpt|llamagen_xl|janus_pro|janus_pro_7b|emu3``: the field's
best parallel decoders beside the drafted methods, on ONE loaded target, with ONE protocol.

Rows (``SOTA_ROWS``): AR, EAGLE-1, COOL-SD at delta 1.1 and 2, SJD (random and SJD's best
initialisation, vertical_repeat: its issue #1 / Fig. 9), MC-SJD (maximal coupling), SJD-PAC (width 4,
depth 3; docs/sjd_pac.md), GSD, ZipAR (window 8 as upstream, 4 on the toy world's 8-token rows; on targets that decode rows
in parallel, ``World.row_parallel``: LlamaGen, Janus-Pro; not Lumina-mGPT or Emu3 yet). The drafted rows
(EAGLE-1, COOL-SD) run only on targets with a trained drafter (``conf/draft/<target>.yaml``: not
Janus-Pro or Emu3, for which none is released). Columns: accepted tokens per target forward
(image tokens / target forwards, per image: for drafted methods this differs from the accepted
length only by the prefill), target forwards per image, latency, the speed-up over the AR row
paired by prompt (AR in the same mode) and over the fastest AR measured (``speedup_vs_fastest_ar``:
the faster of that AR and the compiled AR timed beside it on CUDA), the protocol's quality metrics (toy: toy_fid / toy_clip; real targets: FID and
CLIP of ``coolsd.cli.evaluate`` under ``--protocol``, by default the SJD family's: pytorch-fid against
COCO val2017, torchmetrics CLIP ViT-B/16 x 100; with ``--parti-tsv`` every row also runs on
PartiPrompts, scored by CLIP only as in SJD: column ``clip_score_parti``), the exact distortion summed over the image
(``step_tv``; 0 for lossless methods), all with 95% CIs. Each paper's own numbers sit in a
separate column labelled with ITS protocol and baseline (``REPORTED``): they are comparable only
within one paper (Lumina-mGPT's AR latency is 102, 122, 170 or 197 s depending on the paper).

The toy world runs every row in one interleaved sweep (``coolsd.report.sweep.toy_sweep``: batch 1,
one thread, same prompts and seeds). A real target runs the rows through the generation job on
one loaded world (``coolsd.report.real_sweep``), after checking every file first.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from coolsd.cli.runner import compose
from coolsd.engine import plugins
from coolsd.engine.methods import check_method, method_info
from coolsd.metrics.protocols import read_parti_prompts
from coolsd.metrics.registry import METRICS, PROTOCOLS, analogues, metric
from coolsd.report.compare import paired_comparison
from coolsd.report.paper import tag_of
from coolsd.report.real_sweep import real_table2_sweep
from coolsd.report.sweep import ROOT, ci_text, sweep_frame, toy_sweep
from coolsd.report.table2 import report_args, report_prelude
from coolsd.theory.sweep import parse_value
from coolsd.util.records import read_records, write_json_atomic
from coolsd.util.stats import POSITIVE, mean_ci
from coolsd.worlds import load_world, world_class

# (label, method, params); the Jacobi methods' window: 16 on real targets (SJD's default), 8 on
# the toy world's 64-token images (``toy_params``)
SOTA_ROWS = [
    ("AR", "ar", {}),
    ("EAGLE-1", "eagle", {}),
    ("COOL-SD delta=1.1", "coolsd", {"delta": 1.1}),
    ("COOL-SD delta=2", "coolsd", {"delta": 2.0}),
    ("SJD (random init)", "sjd", {}),
    ("SJD (vertical_repeat)", "sjd", {"init": "vertical_repeat"}),
    ("MC-SJD (maximal)", "mc_sjd", {"coupling": "maximal"}),
    ("SJD-PAC (width 4, depth 3)", "sjd_pac", {}),
    ("GSD (G=14)", "gsd", {"G": 14}),
    ("ZipAR (window 8; toy 4)", "zipar", {}),
    ("PJD (c=8, window 8)", "pjd", {}),
]
TOY_WINDOW = 8
PARTI = "@parti"  # a row's tag on PartiPrompts (its own AR row, its own records folder)
PARTI_SUFFIX = "_parti"  # a quality column's key on PartiPrompts (clip_score_parti)

# each paper's own numbers on Lumina-mGPT / LlamaGen-XL, with the protocol they were measured under
# (research notes: ../shared/research/sota_2026.md; COOL-SD Table 2: coolsd.report.paper)
_LANTERN = "LANTERN protocol (clean-fid, CLIP ViT-B/32 raw cosine, 5k COCO captions; COOL-SD Table 2, A100)"
_SJD = "SJD protocol (pytorch-fid, torchmetrics CLIP ViT-B/16 x100, COCO 2017 val)"
REPORTED = {
    "lumina_mgpt": {
        "eagle": {"speedup": 2.37, "accepted_length": 2.76, "fid": 29.05, "protocol": _LANTERN},
        "coolsd_1.1": {"speedup": 2.69, "accepted_length": 3.11, "fid": 30.30, "protocol": _LANTERN},
        "sjd": {"speedup": 2.05, "tokens_per_forward": 2.2, "protocol": _SJD + "; SJD paper (about 2x)"},
        "mc_sjd_maximal": {"speedup": 4.21, "tokens_per_forward": 2390 / 568, "fid": 30.83, "clip_x100": 31.37,
                           "protocol": _SJD + "; MC-SJD paper, AR 2390 -> 568 forwards, AR FID 30.79"},
        "sjd_pac": {"speedup": 3.80, "tokens_per_forward": 4.51, "fid": 30.69, "clip_x100": 31.21,
                    "protocol": _SJD + "; SJD-PAC paper (width 4, depth 3, window 64), AR FID 30.79"},
        "gsd_14": {"speedup": 122.45 / 32.52, "fid": 33.55,
                   "protocol": _SJD + "; GSD paper at G=25 (122.45 s -> 32.52 s), AR FID 30.79"},
    },
    # research notes' summaries of each paper (../shared/research/sota_2026.md), not re-read from the paper
    "janus_pro_7b": {
        "mc_sjd_maximal": {"speedup": 2.45, "protocol": _SJD + "; MC-SJD paper, Janus-Pro-7B 384 px"},
    },
    "emu3": {
        "sjd_pac": {"speedup": 3.25, "tokens_per_forward": 4.31,
                    "protocol": _SJD + "; SJD-PAC README, Emu3 on COCO (width 4, depth 3)"},
    },
    "llamagen_xl": {
        "eagle": {"speedup": 2.03, "accepted_length": 2.42, "fid": 20.97, "protocol": _LANTERN},
        "coolsd_1.1": {"speedup": 2.27, "accepted_length": 2.73, "fid": 21.02, "protocol": _LANTERN},
        "coolsd_2": {"speedup": 2.72, "accepted_length": 3.34, "fid": 21.20, "protocol": _LANTERN},
    },
}
COLUMNS = {"tokens_per_forward": "tokens / target forward", "target_forwards": "target forwards / image",
           "latency_s": "latency (s)", "speedup": "speed-up vs same-mode AR",
           "speedup_vs_fastest_ar": "speed-up vs fastest AR", "step_tv": "step TV (sum/image)"}
# the quality columns: on real targets every metric evaluate computes (those a run has), CLIP on
# PartiPrompts beside them; on the toy world the metrics registered as standing for them
_REAL = METRICS.names(computed_by="evaluate")
QUALITY = {"toy": tuple(analogues("world")[m] for m in _REAL if m in analogues("world")),
           "real": (*_REAL, "clip_score" + PARTI_SUFFIX)}


def has_trained_drafter(target: str) -> bool:
    """Whether ``target`` has a trained drafter (``conf/draft/<target>.yaml``, which the main config
    loads by the target's name): the drafted rows run only there."""
    return (ROOT / "conf" / "draft" / f"{target}.yaml").is_file()


def rows_for(target: str, extra=()) -> list[tuple[str, str, str, dict]]:
    """(label, tag, method, params) of every row on ``target`` (the toy world: window 8);
    ``extra``: (label, method, params) rows of any registered method (``--row``), after the built-in ones.
    Built-in rows the target cannot run are left out: row-parallel methods where the target does not
    decode rows in parallel, drafted methods where it has no trained drafter."""
    out = []
    for label, method, params in [*SOTA_ROWS, *extra]:
        p = dict(params)
        info = method_info(method)
        if info.row_parallel and not world_class(target).row_parallel:  # refused by the config check: not a row here
            continue
        if info.drafter == "model" and not has_trained_drafter(target) and (label, method, params) in SOTA_ROWS:
            continue
        if target == "toy" and method_info(method).jacobi:
            p.setdefault("window", TOY_WINDOW)
        out.append((label, tag_of(method, params), method, p))
    return out


def tokens_per_forward(records: list[dict], n_tokens: int) -> dict:
    """Per image n_tokens / target forwards (mean [95% CI], positive)."""
    return mean_ci([n_tokens / r["target_forwards"] for r in records], domain=POSITIVE, name="tokens per forward")


def build_table(target: str, table: dict, per_tag_records: dict, n_tokens: int, extra=()) -> pd.DataFrame:
    df = sweep_frame(table).set_index("tag")
    quality = QUALITY["toy" if target == "toy" else "real"]
    rows = []
    for label, tag, method, _ in rows_for(target, extra):
        row = {"target": target, "method": label, "tag": tag}
        tpf = tokens_per_forward(per_tag_records[tag], n_tokens)
        row.update(tokens_per_forward=tpf["mean"], tokens_per_forward_lo=tpf.get("lo"), tokens_per_forward_hi=tpf.get("hi"))
        for k in (*COLUMNS, *quality):
            if k == "tokens_per_forward":
                continue
            have = k in df.columns and tag in df.index and pd.notna(df.loc[tag, k])
            for suffix in ("", "_lo", "_hi"):
                row[k + suffix] = float(df.loc[tag, k + suffix]) if have and k + suffix in df.columns else None
        row["fastest_ar"] = table.get(tag, {}).get("fastest_ar")
        rep = REPORTED.get(target, {}).get(tag)
        row["reported"] = (", ".join(f"{k} {v:.2f}" for k, v in rep.items() if k != "protocol") + f" [{rep['protocol']}]"
                           if rep else "-")
        rows.append(row)
    return pd.DataFrame(rows)


def write_tables(df: pd.DataFrame, out: Path, quality: tuple[str, ...], protocol: str | None = None) -> None:
    """``sota.md`` and ``sota.csv``; ``protocol``: the evaluation protocol of the real targets' quality
    columns (``coolsd.metrics.protocols``), named in the note; quality columns no row has are left out."""
    quality = tuple(q for q in quality if q in df.columns and df[q].notna().any())
    cols = [*COLUMNS, *quality]
    heads = [*COLUMNS.values(), *quality]
    md = ["| target | method | " + " | ".join(heads) + " | reported by its paper (its protocol) |",
          "|---|---|" + "---|" * len(cols) + "---|"]
    for _, r in df.iterrows():
        cells = [ci_text(r, c, "{:.2f}" if c != "latency_s" else "{:.3f}") if r.get(c) is not None else "-" for c in cols]
        md.append(f"| {r['target']} | {r['method']} | " + " | ".join(cells) + f" | {r['reported']} |")
    fastest = sorted({f"{r['target']}: {r['fastest_ar']}" for _, r in df.iterrows() if r.get("fastest_ar")})
    note = ("Ours: mean [95% CI] over prompts, every row on the same target, prompts and seeds, one protocol; "
            "speed-ups paired by prompt: vs same-mode AR against the AR row (AR in the rows' own mode, eager unless "
            "compile=true), vs fastest AR against the faster of that AR and compiled AR (static KV cache, CUDA graphs; "
            "timed beside the AR row on CUDA unless fastest_ar=false; where only one AR ran the two columns are equal)"
            + (f", fastest AR: {', '.join(fastest)}" if fastest else "") + ". Reported: each paper's own numbers, "
            "comparable only within that paper (different baselines, hardware and protocols; their speed-ups are "
            "against eager PyTorch AR).")
    if protocol is not None:
        d = PROTOCOLS.get(protocol).description
        said = "; ".join(f"{metric(m).header} {d[m]}" for m in quality if m in d)
        note += (f" Quality ({protocol} protocol): {said}; prompts {d['prompts']}"
                 + (f"; clip_score{PARTI_SUFFIX}: CLIP on PartiPrompts" if "clip_score" + PARTI_SUFFIX in quality else "")
                 + ".")
    (out / "sota.md").write_text(note + "\n\n" + "\n".join(md) + "\n")
    df.to_csv(out / "sota.csv", index=False)


def parse_row(words: list[str]) -> tuple[str, str, dict]:
    """``--row NAME [KEY=V ...]``: a (label, method, params) row of any registered method, checked
    against its registry entry (one line naming the bad value before any work)."""
    name, *sets = words
    params = {}
    for spec in sets:
        key, eq, val = spec.partition("=")
        if not eq or not key:
            raise SystemExit(f"--row {name}: {spec!r} is not KEY=V")
        params[key] = parse_value(val)
    try:
        check_method(name, "discrete", params)
    except ValueError as e:
        raise SystemExit(f"--row {' '.join(words)}: {e}") from None
    return (" ".join(words), name, params)


def main(argv=None):
    ap = report_args(__doc__, "sota", 120, protocol="sjd")
    ap.add_argument("--parti-tsv", type=Path, default=None,
                    help="PartiPrompts.tsv: every row of a real target also runs on it, scored by CLIP only "
                         "(--protocol sjd, as SJD; coolsd.metrics.protocols.PARTI_SOURCE)")
    ap.add_argument("--parti-prompts", type=int, default=None, help="PartiPrompts per row (default: all 1,632)")
    ap.add_argument("--include", action="append", default=[], metavar="PATH",
                    help="register methods from this file or folder first (docs/add_method.md)")
    ap.add_argument("--row", nargs="+", action="append", default=[], metavar="NAME KEY=V",
                    help="an extra row: a registered method and its parameters, e.g. --row coolsd delta=1.5 schedule=linear")
    a = ap.parse_args(argv)
    if a.parti_tsv is not None:
        if "parti" not in PROTOCOLS.get(a.protocol).prompt_sets:
            have = "/".join(p for p in PROTOCOLS.names() if "parti" in PROTOCOLS.get(p).prompt_sets)
            raise SystemExit(f"--parti-tsv is a prompt set of --protocol {have}, not {a.protocol} (SJD scores it by "
                             "CLIP only)")
        read_parti_prompts(a.parti_tsv)  # one line naming the file and its source if it is missing or malformed
    plugins.load(a.include)
    extra = [parse_row(w) for w in a.row]
    targets, records_root, scorers = report_prelude(a, "sota", "sota-table",
                                                    lambda *args: real_configs(*args, extra=extra),
                                                    metrics=METRICS.names(computed_by="evaluate"))
    frames, summaries, tests = [], {}, {}
    for t in targets:
        parti = (a.parti_tsv, a.parti_prompts) if a.parti_tsv is not None else None
        res, recs, n_tokens = run_target(t, a.prompts, records_root / t, scorers, a.override, extra, parti)
        tests[t] = coupling_test(recs)
        env = {**res["env"], "protocol": a.protocol if t != "toy" else "toy"}
        summaries[t] = {"env": env, "results": res["table"], "mc_sjd_minus_sjd_target_forwards": tests[t]}
        frames.append(build_table(t, res["table"], recs, n_tokens, extra))
    df = pd.concat(frames, ignore_index=True)
    write_tables(df, a.out, QUALITY["toy"] if targets == ["toy"] else tuple(dict.fromkeys(
        q for t in targets for q in QUALITY["toy" if t == "toy" else "real"])),
        protocol=None if targets == ["toy"] else a.protocol)
    write_json_atomic(summaries, a.out / "summary.json")
    with open(a.out / "sota.md", "a") as f:
        for t, x in tests.items():
            f.write(f"\n{t}: {coupling_line(x)}\n")
    print((a.out / "sota.md").read_text())
    print(json.dumps({"wrote": str(a.out), "records": str(records_root)}))


def coupling_test(per_tag_records: dict) -> dict:
    """MC-SJD against SJD (same init) on the same prompts and seeds: target forwards per image,
    the paired difference with its 95% CI and the paired t-test (``coolsd.report.compare``)."""
    a, b = tag_of("mc_sjd", {"coupling": "maximal"}), tag_of("sjd", {})
    return paired_comparison(per_tag_records[a], a, per_tag_records[b], b, metric="target_forwards")


def coupling_line(x: dict) -> str:
    d = x["diff"]
    ci = f"[{d['lo']:+.2f}, {d['hi']:+.2f}]" if "lo" in d else "(no CI)"
    return (f"target forwards per image, MC-SJD (maximal) - SJD (random init), paired by prompt: {d['mean']:+.2f} {ci} "
            f"(means {x['mean_a']:.2f} vs {x['mean_b']:.2f}, paired t-test p = {x['p_value']:.3g}, n = {x['n']})")


def real_configs(target: str, prompts: int, records: Path, overrides=(), extra=()) -> list[tuple[str, object]]:
    """(tag, composed job config) per row on a real target: ``experiments/experiment/sota_<target>.yaml``
    (target, COCO prompts, AR as its own row) with the row's method and parameters."""

    exp = ROOT / "experiments" / "experiment" / f"sota_{target}.yaml"
    if not exp.is_file():
        raise ValueError(f"no state-of-the-art sweep for target {target!r} ({exp.relative_to(ROOT)} is missing)")
    out = []
    for _, tag, method, params in rows_for(target, extra):
        sets = [f"method.{k}={v}" for k, v in params.items()]
        out.append((tag, compose(f"+experiment=sota_{target}", f"method={method}", *sets, f"dataset.n_prompts={prompts}",
                                 f"+out_dir={records / tag}", *overrides)))
    return out


def parti_configs(target: str, tsv, n, records: Path, overrides=(), extra=()) -> list[tuple[str, object]]:
    """The rows of ``real_configs`` on PartiPrompts (``dataset=prompts``, the TSV's ``Prompt`` column
    in file order; ``n`` prompts, None: all), tags suffixed ``@parti``, records under ``records/parti``.
    ``overrides`` of the COCO data set (``dataset.*``, e.g. ``dataset.captions``) are not passed on: the
    TSV is this data set, and a setting it does not have is refused (``check_known_settings``)."""
    overrides = [o for o in overrides if not o.lstrip("+~").startswith("dataset")]
    out = []
    for _, tag, method, params in rows_for(target, extra):
        sets = [f"method.{k}={v}" for k, v in params.items()]
        out.append((tag + PARTI, compose(f"+experiment=sota_{target}", f"method={method}", *sets, "dataset=prompts",
                                         f"dataset.path={tsv}", "dataset.column=Prompt",
                                         f"dataset.n_prompts={'null' if n is None else n}",
                                         f"+out_dir={records / 'parti' / tag}", *overrides)))
    return out


def run_target(target: str, prompts, records: Path, scorers, overrides=(), extra=(), parti=None):
    """(sweep result as ``toy_sweep`` / ``real_table2_sweep`` return it, records per tag, tokens per image).
    ``parti``: (PartiPrompts TSV, prompts or None) on a real target: every row runs there too, on the same
    loaded world, scored by CLIP only; its score joins the row as ``clip_score_parti``."""
    if target == "toy":
        res = toy_sweep([(tag, m, p) for _, tag, m, p in rows_for("toy", extra)], prompts or 120, records)
        by_tag: dict = {}
        for r in read_records(records / "samples.jsonl"):
            by_tag.setdefault(r["method"], []).append(r)
        return res, by_tag, res["world"].target.n_image_tokens

    configs = real_configs(target, prompts or 5000, records, overrides, extra)
    world = load_world(configs[0][1])
    res = real_table2_sweep(target, prompts or 5000, records, scorers, overrides, configs=configs, world=world)
    by_tag = {tag: read_records(Path(res["runs"][tag]) / "samples.jsonl") for tag, _ in configs}
    if parti is not None:
        tsv, n = parti
        clip_only = {"clip_score": scorers["scorers"]["clip_score"]}  # as SJD scores PartiPrompts
        pres = real_table2_sweep(target, n, records, {**scorers, "scorers": clip_only, "parti_tsv": tsv}, overrides,
                                 configs=parti_configs(target, tsv, n, records, overrides, extra), world=world)
        for tag, _ in configs:
            res["table"][tag]["clip_score" + PARTI_SUFFIX] = pres["table"][tag + PARTI]["clip_score"]
        res["env"]["parti"] = {"tsv": str(tsv), "prompts": n, "runs": pres["runs"]}

    return res, by_tag, world_class(target).image_tokens(configs[0][1])


if __name__ == "__main__":
    main()
