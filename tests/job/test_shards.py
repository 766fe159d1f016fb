"""Sharded runs (coolsd.job.shards, coolsd.cli.merge): shards of one folder merge into the records of a
one-process run; bad shards, a changed shard count, incomplete runs, shards still being written
and folders of other configurations are clear errors; --partial says how many shards it merged;
a local sharded multirun keeps one log per shard and prints the merge command on its console."""
import json
import os

import pytest

from coolsd.cli.merge import main, merge
from coolsd.util.records import RunLock
from coolsd.cli.runner import run
from coolsd.job.shards import Shard
from factories import compose as _compose

TIMING = ("latency_s", "signal_s", "decode_s")


def _strip(records):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def _records(folder):
    return [json.loads(x) for x in (folder / "samples.jsonl").read_text().splitlines()]


def _run(out, *overrides, n=5):
    return run(_compose("method=eagle", f"dataset.n_prompts={n}", f"+out_dir={out}", *overrides))


def test_shard_selection_partitions_the_prompts_and_validates():
    parts = [Shard(k, 3).select(10) for k in range(3)]
    assert sorted(sum(parts, [])) == list(range(10)) and parts[1] == [1, 4, 7]
    assert Shard().records_name == "samples.jsonl" and Shard(2, 3).records_name == "samples.shard-002-of-003.jsonl"
    with pytest.raises(ValueError, match=r"shard.index 3 is out of range for shard.count 3 \(valid: 0 .. 2\)"):
        Shard(3, 3)
    with pytest.raises(ValueError, match="shard.count must be >= 1"):
        Shard(0, 0)
    with pytest.raises(ValueError, match="shard.index must be an integer"):
        Shard("a", 2)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    _run(out)
    return out


def test_shards_merge_into_the_one_process_records(single, tmp_path):
    out = tmp_path / "sharded"
    for k in (2, 0, 1):  # any order
        res = _run(out, f"shard.index={k}", "shard.count=3")
        assert res["shard"] == k and res["n_prompts"] == len(Shard(k, 3).select(5))
    assert sorted(p.name for p in out.glob("samples*.jsonl")) == [f"samples.shard-00{k}-of-003.jsonl" for k in range(3)]
    summary = merge(out)
    assert _strip(_records(out)) == _strip(_records(single))
    one = json.loads((single / "summary.json").read_text())["results"]
    for tag in ("ar", "eagle"):
        assert summary["results"][tag]["accepted_length"] == one[tag]["accepted_length"]
        assert summary["results"][tag]["toy_clip"] == one[tag]["toy_clip"]
    assert summary["prompts_missing"] == [] and summary["merged_shards"] == 3
    md = (out / "summary.md").read_text()  # the merged table, as a one-process run writes it
    assert [line.split(" | ")[0] for line in md.splitlines() if line.startswith(("| ar ", "| eagle "))] == ["| ar", "| eagle"]
    assert "merged 3 of 3 shard(s): 5 complete prompts" in md
    with pytest.raises(ValueError, match="holds a run of another configuration.*shards"):
        _run(out, "shard.index=0", "shard.count=2")  # the shard count changed: refused, nothing written
    assert not list(out.glob("samples.shard-*-of-002.jsonl"))


def test_incomplete_and_foreign_merges_are_errors(single, tmp_path, capsys):
    out = tmp_path / "part"
    _run(out, "shard.index=0", "shard.count=2")
    with pytest.raises(ValueError, match=r"2 of 5 prompts are incomplete \(1, 3\).*--partial"):
        merge(out)
    assert not (out / "summary.json").exists()
    s = merge(out, partial=True)
    assert s["prompts_complete"] == 3 and s["prompts_missing"] == [1, 3]
    assert s["merged_shards"] == 1 and s["shards"] == 2
    main([str(out), "--partial"])
    assert "merged 1 of 2 shard(s): 3 complete prompts, 2 missing" in capsys.readouterr().out
    with RunLock(out, Shard(0, 2).records_name):  # a shard still being written is not merged
        with pytest.raises(ValueError, match=r"samples.shard-000-of-002.jsonl is still being written by host .*pid "
                                             rf"{os.getpid()}"):
            merge(out, partial=True)
    other = tmp_path / "other"
    _run(other, "shard.index=1", "shard.count=2")
    s = merge(out, sources=[other])  # shards written in two folders
    assert _strip(_records(out)) == _strip(_records(single)) and s["prompts_missing"] == []
    with pytest.raises(ValueError, match="another configuration.*shards: 2 -> '<absent>'"):
        merge(out, sources=[single])  # an unsharded run of the same method
    foreign = tmp_path / "foreign"
    run(_compose("method=coolsd", "dataset.n_prompts=5", f"+out_dir={foreign}", "shard.index=1", "shard.count=2"))
    with pytest.raises(ValueError, match="another configuration.*methods.coolsd"):
        merge(out, sources=[foreign])
    with pytest.raises(ValueError, match="out of range"):
        _run(tmp_path / "bad", "shard.index=5", "shard.count=2")
    assert not (tmp_path / "bad").exists()


def test_submitit_local_sweep_survives_a_sigkill_and_merges_to_the_one_process_records(tmp_path):
    """A sweep of 3 shards through Hydra's submitit launcher (one process per shard): one shard
    process is killed with SIGKILL mid-run; the same command again resumes every shard; the merged
    records equal the one-process run's (timings aside)."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, str(root / "run.py"), "-m", "hydra/launcher=local", "method=eagle", "dataset.n_prompts=9",
           "shard.index=0,1,2", "shard.count=3", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir = sweep / "eagle_dataset.n_prompts=9,method=eagle"  # the swept values name the folder, not the shard
    killed, deadline = None, time.time() + 300
    while killed is None and time.time() < deadline and proc.poll() is None:
        jobs = sweep / ".submitit"
        for f in sorted(run_dir.glob("samples.shard-*.jsonl")) if run_dir.exists() else []:
            n = len(f.read_text().splitlines())
            if 1 <= n < 5:  # this shard (3 prompts x 2 methods) has written a sample and is still working
                pids = [int(p.name.split("_")[0]) for p in jobs.glob("*_submitted.pkl")] if jobs.exists() else []
                for pid in pids:  # submitit's local job id is its controller; the job runs in its child
                    shard = f.name.split("-")[1]
                    submitted = jobs / f"{pid}_submitted.pkl"
                    if submitted.exists() and f"shard.index={int(shard)}" in submitted.read_bytes().decode("latin-1"):
                        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
                        if children:
                            os.kill(int(children[0]), signal.SIGKILL)
                            killed = (shard, n)
                        break
            if killed:
                break
        time.sleep(0.05)
    out, _ = proc.communicate(timeout=600)
    assert killed is not None, "no shard was caught mid-run\n" + out[-3000:]
    assert proc.returncode != 0  # the sweep reports the killed job
    again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert f"python -m coolsd.cli.merge {run_dir}" in again.stdout  # on the console, not only in .submitit logs
    assert not list(sweep.rglob("%j")), "a literal %j folder"
    assert sorted(p.name for p in run_dir.glob("*.log")) == [f"run.shard-00{k}-of-003.log" for k in range(3)]
    merge(run_dir)
    single = tmp_path / "single"
    _run(single, n=9)
    assert _strip(_records(run_dir)) == _strip(_records(single))
    assert len(_records(run_dir)) == 18
