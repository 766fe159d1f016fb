"""``make sota-table`` (coolsd.report.sota) on the toy world and on tiny random
files of both real targets: every row (AR, EAGLE-1, COOL-SD 1.1 / 2, SJD random / vertical_repeat,
MC-SJD, SJD-PAC, GSD) runs on one loaded target with one protocol, the table has its columns, the papers'
own numbers sit in their labelled column, and MC-SJD's paired difference to SJD is reported.
The numbers are meaningless at this size: the layout and the rows are what is tested."""
from pathlib import Path

import pytest

from coolsd.report import sota
from coolsd.report.sweep import sweep_frame
from coolsd.util.records import read_records



def _check_table(df, target, n_tokens):
    assert list(df["method"]) == [label for label, *_ in sota.rows_for(target)]
    assert (df["tokens_per_forward"] > 0).all() and (df["tokens_per_forward"] <= n_tokens).all()
    ar = df.set_index("method").loc["AR"]
    assert ar["tokens_per_forward"] < 1.0 + 1e-9 and ar["speedup"] == 1.0  # AR: one token per forward (+ prefill)
    lossless = df[df["method"].str.startswith(("EAGLE", "SJD", "MC-SJD"))]  # SJD-PAC too
    assert len(lossless) == (5 if sota.has_trained_drafter(target) else 4)  # EAGLE-1 only with a drafter
    assert (lossless["step_tv"] == 0).all()  # exactly 0, trees too (a lossless rule's pi is p)


def test_toy_sota_table_has_every_row_and_the_coupling_test(tmp_path):
    res, recs, n_tokens = sota.run_target("toy", 2, tmp_path / "records", None)
    df = sota.build_table("toy", res["table"], recs, n_tokens)
    _check_table(df, "toy", n_tokens)
    sota.write_tables(df, tmp_path, sota.QUALITY["toy"])
    md = (tmp_path / "sota.md").read_text()
    assert "| toy | GSD (G=14) |" in md and "| toy | SJD-PAC (width 4, depth 3) |" in md
    assert "| speed-up vs same-mode AR | speed-up vs fastest AR |" in md  # the CPU: one AR, the two columns equal
    assert (df["speedup_vs_fastest_ar"] == df["speedup"]).all() and (df["fastest_ar"] == "ar").all()
    x = sota.coupling_test(recs)
    assert x["n"] == 2 and x["metric"] == "target_forwards" and "MC-SJD (maximal) - SJD" in sota.coupling_line(x)
    # the Jacobi rows ran at the toy window, drafted rows as chains of 4
    assert sweep_frame(res["table"]).set_index("tag").loc["sjd", "params"]["window"] == sota.TOY_WINDOW
    # ZipAR at window 4 on 8 x 8 tokens: 2 * 8 + 6 * 4 = 40 forwards (docs/methods.md section 8.1), lossy
    zipar = df.set_index("method").loc["ZipAR (window 8; toy 4)"]
    assert abs(zipar["tokens_per_forward"] - 64 / 40) < 1e-9 and zipar["step_tv"] > 0


def test_sota_table_shows_both_speedups_and_names_the_fastest_ar(tmp_path):
    rows = sota.rows_for("toy")
    table = {tag: {"params": {"method": m}, "speedup": {"mean": 2.0 + k, "ci95": [1.5 + k, 2.5 + k]},
                   "speedup_vs_fastest_ar": {"mean": 0.5 + k, "ci95": [0.25 + k, 0.75 + k]}, "fastest_ar": "ar_compiled"}
             for k, (_, tag, m, _) in enumerate(rows)}
    recs = {tag: [{"target_forwards": 32}, {"target_forwards": 16}] for _, tag, _, _ in rows}
    df = sota.build_table("toy", table, recs, 64)
    sota.write_tables(df, tmp_path, sota.QUALITY["toy"])
    md = (tmp_path / "sota.md").read_text()
    assert "| speed-up vs same-mode AR | speed-up vs fastest AR |" in md and "fastest AR: toy: ar_compiled" in md
    eagle = next(line for line in md.splitlines() if line.startswith("| toy | EAGLE-1 |"))
    assert "| 3.00 [2.50, 3.50] | 1.50 [1.25, 1.75] |" in eagle


@pytest.mark.parametrize("target", ["lumina_mgpt", "llamagen_xl"])
def test_real_target_sota_table_on_tiny_files(target, tmp_path, request):
    import factories
    from factories import CAPTIONS_FIXTURE

    if target == "lumina_mgpt":
        overrides = factories.lumina_overrides(request.getfixturevalue("lumina_files"))
    else:
        overrides = factories.llamagen_overrides(request.getfixturevalue("llamagen_files"))
    res, recs, n_tokens = sota.run_target(target, 2, tmp_path / "records", factories.tiny_metric_scorers(tmp_path),
                                          [*overrides, f"dataset.captions={CAPTIONS_FIXTURE}"])
    assert set(recs) == {tag for _, tag, *_ in sota.rows_for(target)}
    for tag, e in res["table"].items():
        assert {"clip_score", "fid", "latency_s", "target_forwards"} <= set(e), tag
    df = sota.build_table(target, res["table"], recs, n_tokens)
    _check_table(df, target, n_tokens)
    sota.write_tables(df, tmp_path, sota.QUALITY["real"])
    md = (tmp_path / "sota.md").read_text()
    reported = next(x for x in md.splitlines() if x.startswith(f"| {target} | COOL-SD delta=1.1 |"))
    assert ("2.69" if target == "lumina_mgpt" else "2.27") in reported and "LANTERN protocol" in reported
    if target == "lumina_mgpt":
        mc = next(x for x in md.splitlines() if x.startswith(f"| {target} | MC-SJD (maximal) |"))
        assert "4.21" in mc and "SJD protocol" in mc
        pac = next(x for x in md.splitlines() if x.startswith(f"| {target} | SJD-PAC (width 4, depth 3) |"))
        assert "3.80" in pac and "SJD protocol" in pac


def test_janus_pro_sota_table_on_sjd_protocol_with_partiprompts(tmp_path, janus_files):
    """Janus-Pro (no trained drafter: no EAGLE-1 / COOL-SD rows; decodes rows in parallel: ZipAR and
    PJD rows) under the SJD protocol's scorers, every row also on a PartiPrompts TSV scored by CLIP
    only: the table has clip_score_parti beside FID and CLIP, the note names the protocol."""
    import factories
    from factories import CAPTIONS_FIXTURE

    tsv = tmp_path / "PartiPrompts.tsv"
    tsv.write_text("Prompt\tCategory\na red cat\tAnimals\nthe dog sits on the mat\tAnimals\n")
    overrides = [*factories.janus_overrides(janus_files), f"dataset.captions={CAPTIONS_FIXTURE}"]
    scorers = factories.tiny_metric_scorers(tmp_path, protocol="sjd")
    res, recs, n_tokens = sota.run_target("janus_pro", 2, tmp_path / "records", scorers, overrides, parti=(tsv, 2))
    tags = {tag for _, tag, *_ in sota.rows_for("janus_pro")}
    assert set(recs) == tags and {"zipar", "pjd"} <= tags and not {"eagle", "coolsd_1.1"} & tags
    for tag, e in res["table"].items():
        assert {"clip_score", "fid", "clip_score_parti"} <= set(e), tag
        assert e["clip_score"]["protocol"] == e["clip_score_parti"]["protocol"] == "sjd"
    parti_run = res["env"]["parti"]["runs"]["sjd@parti"]
    captions = [r["caption"] for r in read_records(Path(parti_run) / "samples.jsonl")]
    assert sorted(captions) == ["a red cat", "the dog sits on the mat"]
    df = sota.build_table("janus_pro", res["table"], recs, n_tokens)
    _check_table(df, "janus_pro", n_tokens)
    sota.write_tables(df, tmp_path, sota.QUALITY["real"], protocol="sjd")
    md = (tmp_path / "sota.md").read_text()
    assert "clip_score_parti |" in md and "Quality (sjd protocol): CLIP torchmetrics" in md and "; FID pytorch-fid" in md


def test_sota_cli_refuses_partiprompts_outside_the_sjd_protocol(tmp_path):
    with pytest.raises(SystemExit, match=r"--parti-tsv is a prompt set of --protocol sjd, not lantern"):
        sota.main(["--targets", "janus_pro", "--protocol", "lantern", "--parti-tsv", str(tmp_path / "p.tsv")])
    with pytest.raises(Exception, match=r"nope\.tsv"):
        sota.main(["--targets", "janus_pro", "--parti-tsv", str(tmp_path / "nope.tsv")])


@pytest.mark.parametrize("target", sorted(p.stem[5:] for p in (sota.ROOT / "experiments" / "experiment").glob("sota_*.yaml")))
def test_sota_experiment_rows_are_the_reports_rows(target):
    """``python run.py -m +experiment=sota_<target>`` sweeps the same rows ``make sota-table`` runs."""
    from omegaconf import OmegaConf

    from coolsd.job.config_schema import method_from_cfg
    from coolsd.cli.runner import compose

    exp = OmegaConf.load(sota.ROOT / "experiments" / "experiment" / f"sota_{target}.yaml")
    rows = str(exp.hydra.sweeper.params["+row"]).split(",")
    assert len(rows) == len(sota.rows_for(target))
    for row, (_, _, method, params) in zip(rows, sota.rows_for(target)):
        name, p = method_from_cfg(compose(f"+experiment=sota_{target}", f"+row={row}", "target=toy", "dataset=toy"))
        assert name == method and all(p[k] == v for k, v in params.items()), (row, name, p, params)
