"""Live W&B tracking (coolsd.job.tracking) against the real wandb library, offline, read back from the
``run-*.wandb`` files it wrote: a 2-shard toy run logs one history row per image (step = images
done, running means over the shard's records), both shards and the merge share one group, a
requeued shard continues its own run id, and the merge (and a sweep report over run folders) logs
the Pareto charts, the error-bar figure and the summary table. A W&B failure mid-run warns once
and the run finishes its records."""
import json
import time

import pytest

from coolsd.cli.merge import merge
from coolsd.cli.runner import run
from coolsd.job.tracking import TRACKED, WANDB_FILE, make_logger, wandb_group
from coolsd.util.errors import ConfigError
from factories import compose
from test_report import _wandb_records

pytest.importorskip("wandb")

N_PROMPTS = 3  # shard 0 of 2: prompts 0, 2; shard 1: prompt 1 (each with ar and eagle)
EVERY = 2  # logger.image_every


def _run(out, wandb_dir, *overrides):
    return run(compose("method=eagle", f"dataset.n_prompts={N_PROMPTS}", f"+out_dir={out}", "logger=wandb",
                       f"logger.dir={wandb_dir}", f"logger.image_every={EVERY}", *overrides))


def _read(path) -> list:
    """The records of one finished offline run, read again until its ``exit`` record is there (W&B's
    service process may still be flushing the file after ``finish``)."""
    from google.protobuf.message import DecodeError

    for _ in range(160):
        try:
            recs = list(_wandb_records(path))
            if any(r.WhichOneof("record_type") == "exit" for r in recs):
                return recs
        except DecodeError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"{path} never held a finished run")


def _run_info(recs) -> dict:
    """{"id", "group", "job_type", "history": [{key: value}], "charts": {config key}}."""
    out = {"history": [], "charts": set()}
    for r in recs:
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out.update(id=r.run.run_id, group=r.run.run_group, job_type=r.run.job_type)
        elif kind == "history":
            out["history"].append({u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in r.history.item})
        elif kind == "config":
            out["charts"] |= {u.key or "/".join(u.nested_key) for u in r.config.update}
    return out


def _offline_runs(wandb_dir) -> dict:
    """{run id: [info of each offline run folder with that id, in start order]}."""
    runs: dict = {}
    for d in sorted((wandb_dir / "wandb").glob("offline-run-*")):
        info = _run_info(_read(next(d.glob("run-*.wandb"))))
        info["dir"] = d
        runs.setdefault(info["id"], []).append(info)
    return runs


def _records(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Shards 0 and 1 of one folder; shard 0 killed after its first 2 images and requeued; merged."""
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_SILENT", "true")
    root = tmp_path_factory.mktemp("tracking")
    out, wandb_dir = root / "run", root / "wandb"
    t0 = time.perf_counter()
    try:
        for k in (0, 1):
            _run(out, wandb_dir, f"shard.index={k}", "shard.count=2")
        shard0 = out / "samples.shard-000-of-002.jsonl"
        full0 = _records(shard0)
        shard0.write_text("".join(x + "\n" for x in shard0.read_text().splitlines()[:2]))  # killed after 2 images
        _run(out, wandb_dir, "shard.index=0", "shard.count=2")  # the requeue: same command, same folder
        summary = merge(out)
    finally:
        mp.undo()
    print(f"tracked sweep: {time.perf_counter() - t0:.1f} s")
    return {"out": out, "wandb": wandb_dir, "runs": _offline_runs(wandb_dir), "full0": full0, "summary": summary}


def _image_rows(info):
    return [h for h in info["history"] if "images_done" in h]


def test_every_image_is_a_history_row_at_step_images_done_with_running_means(sweep):
    runs = sweep["runs"]
    shard1 = next(v for k, v in runs.items() if k.endswith("shard-1-of-2"))
    assert len(shard1) == 1
    recs = _records(sweep["out"] / "samples.shard-001-of-002.jsonl")
    for first in (next(v for k, v in runs.items() if k.endswith("shard-0-of-2"))[0], shard1[0]):
        rows = _image_rows(first)
        expect = sweep["full0"] if first is not shard1[0] else recs
        assert [h["_step"] for h in rows] == [h["images_done"] for h in rows] == list(range(1, len(expect) + 1))
        for i, (h, rec) in enumerate(zip(rows, expect)):
            tag = rec["method"]
            mine = [r for r in expect[: i + 1] if r["method"] == tag]
            for k in TRACKED:
                assert h[f"{tag}/{k}"] == pytest.approx(rec[k])
                assert h[f"{tag}/{k}_mean"] == pytest.approx(sum(r[k] for r in mine) / len(mine))
            assert (f"{tag}/sample/path" in h) == ((len(mine) - 1) % EVERY == 0)  # the 1st, 3rd, ... image of a method
    assert {"toy_fid", "toy_clip"}.isdisjoint({k.split("/")[-1] for h in shard1[0]["history"] for k in h})


def test_shards_and_merge_share_one_group_and_a_requeued_shard_keeps_its_run(sweep):
    runs, out = sweep["runs"], sweep["out"]
    ident = json.loads((out / "run.json").read_text())
    assert len(runs) == 3  # shard 0 (twice: first and requeued), shard 1, merged
    assert {i["group"] for v in runs.values() for i in v} == {wandb_group(ident)}
    assert sorted(i["job_type"] for v in runs.values() for i in v) == ["generate"] * 3 + ["merge"]
    first, requeued = next(v for k, v in runs.items() if k.endswith("shard-0-of-2"))
    assert first["id"] == requeued["id"] and first["dir"] != requeued["dir"]
    # the requeue resumed 2 records: it logs images 3 and 4, its running means over all 4
    rows, full = _image_rows(requeued), sweep["full0"]
    assert [h["_step"] for h in rows] == [3, 4]
    final = _records(out / "samples.shard-000-of-002.jsonl")
    for h, rec in zip(rows, final[2:]):
        mine = [r for r in final[: h["_step"]] if r["method"] == rec["method"]]
        assert h[f"{rec['method']}/latency_s_mean"] == pytest.approx(sum(r["latency_s"] for r in mine) / len(mine))
    assert [r["prompt_index"] for r in final] == [r["prompt_index"] for r in full]
    assert json.loads((out / WANDB_FILE).read_text())["dir"] == str(sweep["wandb"].resolve())


def test_merge_logs_the_pareto_charts_figure_and_summary_table(sweep):
    merged = next(v for k, v in sweep["runs"].items() if k.endswith("-merged"))[0]
    results = sweep["summary"]["results"]
    logged = {k for h in merged["history"] for k in h}
    assert {"eagle/speedup", "eagle/speedup_lo", "eagle/toy_clip_hi", "ar/step_tv",
            "eagle/speedup_vs_fastest_ar", "eagle/speedup_vs_fastest_ar_hi"} <= logged
    for m in ("step_tv", "toy_clip"):  # a quality signal: a scatter chart of it against each speed-up
        assert f"_wandb/visualize/pareto/{m}" in merged["charts"]
        assert f"_wandb/visualize/pareto_fastest_ar/{m}" in merged["charts"]
    assert not any("speedup" in c or "latency" in c or "_minus_ar" in c for c in merged["charts"])
    files = merged["dir"] / "files"
    (table_path,) = files.glob("media/table/summary/table_*.table.json")
    table = json.loads(table_path.read_text())
    rows = {r[table["columns"].index("tag")]: dict(zip(table["columns"], r)) for r in table["data"]}
    assert set(rows) == {"ar", "eagle"} and rows["eagle"]["fastest_ar"] == "ar"  # the CPU: no compiled AR
    for m in ("speedup", "speedup_vs_fastest_ar", "toy_clip", "step_tv"):
        e = results["eagle"][m]
        got = [rows["eagle"][m], rows["eagle"][m + "_lo"], rows["eagle"][m + "_hi"]]
        assert got == pytest.approx([e["mean"], *e["ci95"]])
    (chart_path,) = files.glob("media/table/pareto/step_tv_table_*.table.json")
    chart = json.loads(chart_path.read_text())
    assert chart["columns"] == ["tag", "family", "speedup", "speedup_lo", "speedup_hi", "step_tv", "step_tv_lo",
                                "step_tv_hi"] and len(chart["data"]) == 2
    (chart_path,) = files.glob("media/table/pareto_fastest_ar/step_tv_table_*.table.json")
    assert json.loads(chart_path.read_text())["columns"][2:5] == ["speedup_vs_fastest_ar", "speedup_vs_fastest_ar_lo",
                                                                  "speedup_vs_fastest_ar_hi"]
    assert any("figures/pareto/path" in h for h in merged["history"])  # the plot with its error bars
    assert (sweep["out"] / "pareto.png").is_file()


def test_a_sweep_report_logs_its_pareto_charts_and_table_to_the_runs_project(sweep, tmp_path, monkeypatch):
    from coolsd.report.consolidate import main as consolidate

    monkeypatch.setenv("WANDB_SILENT", "true")
    other = tmp_path / "other"  # a one-process run of another configuration: it logs its own summary
    run(compose("method=ar", "dataset.n_prompts=2", f"+out_dir={other}", "logger=wandb",
                f"logger.dir={tmp_path / 'wandb'}", "logger.image_every=0"))
    (one,) = (tmp_path / "wandb" / "wandb").glob("offline-run-*")
    info = _run_info(_read(next(one.glob("run-*.wandb"))))
    assert info["id"].endswith("-run") and [h["_step"] for h in _image_rows(info)] == [1, 2]
    assert "_wandb/visualize/pareto/toy_clip" in info["charts"] and not any("/sample/" in k for h in info["history"]
                                                                            for k in h)
    consolidate([str(sweep["out"]), str(other), "-o", str(tmp_path / "t.parquet"), "--wandb"])
    # logged where the first run folder's (sorted: ``other``) W&B runs are
    (new,) = set((tmp_path / "wandb" / "wandb").glob("offline-run-*")) - {one}
    info = _run_info(_read(next(new.glob("run-*.wandb"))))
    assert info["id"].startswith("coolsd-report-") and info["job_type"] == "report" and info["group"] == "reports"
    assert {"_wandb/visualize/pareto/step_tv", "_wandb/visualize/pareto/toy_clip"} <= info["charts"]
    (table_path,) = new.glob("files/media/table/summary/table_*.table.json")
    table = json.loads(table_path.read_text())
    # one row per configuration of each run (config_label), a label two runs share told apart by folder
    assert sorted(r[table["columns"].index("tag")] for r in table["data"]) == ["ar [other]", "ar [run]",
                                                                                 "eagle tree=chain4"]
    assert any("figures/t_pareto/path" in h for h in info["history"]) and (tmp_path / "t_pareto.png").is_file()


def test_a_wandb_failure_mid_run_warns_once_and_the_run_finishes(tmp_path, monkeypatch, capfd):
    from wandb.sdk.wandb_run import Run

    monkeypatch.setenv("WANDB_SILENT", "true")
    calls = []

    def broken(self, *a, **k):
        calls.append(1)
        raise ConnectionError("W&B is down")

    monkeypatch.setattr(Run, "log", broken)
    res = _run(tmp_path / "run", tmp_path / "wandb", "shard.index=0", "shard.count=2")
    assert res["n_prompts"] == 2 and len(_records(tmp_path / "run" / "samples.shard-000-of-002.jsonl")) == 4
    err = capfd.readouterr().err
    assert err.count("W&B logging failed") == 1 and "W&B is down" in err and len(calls) == 1


def test_logger_settings_are_checked_before_any_work():
    with pytest.raises(ConfigError, match=r"logger.image_every must be an integer >= 0, got -1"):
        make_logger({"name": "wandb", "project": "p", "dir": "x", "image_every": -1}, {}, "x")
