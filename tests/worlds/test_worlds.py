"""The world contract, for every registered world (tiny random files of the real classes for the
real targets, the shipped toy weights, tiny toy continuous weights, the theory lab): its files are
listed up front when missing; under ``deterministic.batch_invariant=true`` a batch-2 run of 3
prompts (a full batch and a remainder) writes the batch-1 run's records and images bit for bit;
a run killed part-way resumes to the uninterrupted run's records; two shards merged by
``coolsd.cli.merge`` give the one-process run's records and a summary with every field of the
one-process summary. One registry entry per target, one conf file per registry entry."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from coolsd.cli.merge import merge
from coolsd.cli.runner import run
from coolsd.worlds import TARGETS, world_class, world_names

ROOT = Path(__file__).resolve().parents[2]
# (method overrides, prompts) per world: small, but with a batch of BATCH and one of the rest
# (3 prompts at batch 2: the full-batch and remainder shapes), and enough records (3 prompts x
# 2 methods) for the killed run below to stop inside the third
BATCH = 2
RUNS = {
    "toy": (["method=coolsd"], 3),
    "toy_continuous": (["method=cspd", "method.gamma=4"], 3),
    "emu3": (["method=eagle", "draft=self", "tree=chain", "tree.draft_length=3"], 3),
    "harmon_1_5b": (["method=cspd", "method.gamma=3", "method.mode=exact", "method.verify=prefix"], 3),
    "janus_pro": (["method=coolsd", "draft=self"], 3),
    "janus_pro_7b": (["method=sjd"], 3),
    "llamagen_xl": (["method=coolsd"], 3),
    "llamagen_xl_512": (["method=eagle", "tree=mc_sim_7b_63"], 3),
    "lumina_mgpt": (["method=eagle", "tree=chain", "tree.draft_length=3"], 3),
    "mar_h": (["method=cspd", "method.gamma=4"], 3),
    "mar_l": (["method=cspd", "method.gamma=4", "method.mode=exact", "method.verify=prefix"], 3),
    "tabular": (["method=coolsd", "target.n_samples=500"], 3),
    "xar_h": (["method=cspd", "method.gamma=2", "method.mode=exact", "method.verify=prefix"], 3),
    "xar_l": (["method=cspd", "method.gamma=3"], 3),
}
TIMING = ("latency_s", "signal_s", "decode_s", "hardware", "batch_size", "draft_forwards")  # draft_forwards: per batch
# summary fields measured in seconds (they differ between any two runs)
TIMED = ("latency_s", "signal_s", "decode_s", "images_per_s", "speedup", "speedup_per_accepted_length",
         "speedup_without_signals", "speedup_vs_fastest_ar", "fastest_ar")  # fastest_ar: the AR of lower latency


def test_every_registered_world_has_its_conf_and_every_conf_a_world():
    confs = sorted(p.stem for p in (ROOT / "conf" / "target").glob("*.yaml"))
    builtin = [n for n in world_names() if TARGETS.entry(n).builtin]  # not one a test included
    assert confs == builtin == sorted(RUNS)
    for name in builtin:
        cls = world_class(name)
        assert cls.family in ("discrete", "continuous") and callable(cls.load)


def _cfg(compose, world_overrides, name, out, *extra, n=None):
    method, prompts = RUNS[name]
    n_prompts = [] if name == "tabular" else [f"dataset.n_prompts={n or prompts}"]
    return compose(*world_overrides(name), *method, *n_prompts, f"+out_dir={out}", *extra)


def _records(folder) -> list[dict]:
    return [json.loads(x) for x in (folder / "samples.jsonl").read_text().splitlines()]


def _strip(records) -> list[dict]:
    key = lambda r: (r["prompt_index"], r["method"])  # noqa: E731
    return [{k: v for k, v in r.items() if k not in TIMING} for r in sorted(records, key=key)]


def _same_images(a: Path, b: Path, records) -> bool:
    return all(np.array_equal(np.asarray(Image.open(a / r["image"])), np.asarray(Image.open(b / r["image"])))
               for r in records if "image" in r)


def _fields(d, prefix=""):
    """Every key path of a nested summary."""
    out = set()
    for k, v in d.items():
        out.add(prefix + k)
        if isinstance(v, dict):
            out |= _fields(v, prefix + k + ".")
    return out


@pytest.mark.parametrize("name", sorted(RUNS))
def test_world_contract(name, compose, world_overrides, tmp_path):
    inv = "deterministic.batch_invariant=true"
    one = tmp_path / "one"
    s_one = run(_cfg(compose, world_overrides, name, one, inv))
    recs = _records(one)
    tags = list(s_one["results"])
    n = RUNS[name][1]
    assert len(recs) == n * len(tags) and s_one["n_prompts"] == n and s_one["target"] == name

    # batch BATCH = batch 1, bit for bit, under the flag: a full batch and the remainder's
    batched = tmp_path / "batched"
    s_batched = run(_cfg(compose, world_overrides, name, batched, inv, f"batch_size={BATCH}"))
    assert s_batched["batch_size"] == BATCH and _strip(_records(batched)) == _strip(recs)
    assert {r.get("batch_size", 1) for r in _records(batched)} == {BATCH, n % BATCH}
    assert _same_images(one, batched, recs)

    # killed part-way (two records and half a line written, an orphan PNG of the next sample): resumes
    killed = tmp_path / "killed"
    shutil.copytree(one, killed)
    lines = (killed / "samples.jsonl").read_text().splitlines()
    (killed / "samples.jsonl").write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][: len(lines[2]) // 2])
    (killed / "summary.json").unlink()
    for r in recs[3:]:
        if "image" in r:
            (killed / r["image"]).unlink()
    run(_cfg(compose, world_overrides, name, killed, inv))
    assert _strip(_records(killed)) == _strip(recs) and _same_images(one, killed, recs)

    # two shards, merged = one process: records, and every summary field
    sharded = tmp_path / "sharded"
    for k in (1, 0):
        out = run(_cfg(compose, world_overrides, name, sharded, inv, f"shard.index={k}", "shard.count=2"))
        assert out["shard"] == k
    merged = merge(sharded)
    assert _strip(_records(sharded)) == _strip(recs) and _same_images(one, sharded, recs)
    assert _fields(s_one) <= _fields(merged)
    for tag in tags:
        for key, value in s_one["results"][tag].items():
            if key not in TIMED:
                assert merged["results"][tag][key] == value, (tag, key)
    for key in ("target", "methods", "n_prompts", "device", "hardware", "threads", "failures", "settings"):
        assert merged.get(key) == s_one.get(key), key


@pytest.mark.parametrize("name", ["emu3", "harmon_1_5b", "janus_pro", "janus_pro_7b", "llamagen_xl", "llamagen_xl_512",
                                  "lumina_mgpt", "mar_h", "mar_l", "toy", "xar_h", "xar_l"])
def test_missing_files_are_listed_before_any_work(name, compose, world_overrides, tmp_path, monkeypatch):
    """Every file of the target (and of its drafter where it has one) not set or not there: one
    error naming each, before anything loads or any folder is made."""
    for var in ("LLAMAGEN_GPT", "LLAMAGEN_GPT_512", "LLAMAGEN_VQ", "FLAN_T5_XL", "LLAMAGEN_DRAFTER",
                "LLAMAGEN_DRAFTER_512", "LUMINA_MGPT", "CHAMELEON_VQGAN", "CHAMELEON_TEXT_TOKENIZER", "MAR_H",
                "MAR_L", "MAR_B", "MAR_VAE", "XAR_H", "XAR_L", "XAR_B", "HARMON_1_5B", "HARMON_0_5B",
                "HARMON_TOKENIZER", "JANUS_PRO", "JANUS_PRO_7B", "EMU3_GEN"):
        monkeypatch.delenv(var, raising=False)
    cfg = compose(f"target={name}", *RUNS[name][0], f"+out_dir={tmp_path / 'out'}")
    files = list(cfg.target.get("files") or {})
    if name == "toy":
        cfg = compose("target=toy", "draft=llamagen_xl", "draft.path=/nowhere/drafter", f"+out_dir={tmp_path / 'out'}")
        files = ["drafter"]
    with pytest.raises(FileNotFoundError) as e:
        run(cfg)
    for f in files:
        assert f"{f}: " in str(e.value), (f, str(e.value))
    assert not (tmp_path / "out").exists()


def test_every_target_follows_the_recipe():
    """docs/add_target.md: a target is its model file, its world file (the world class, which
    registers itself under the name and holds its config schema beside it) and its conf file,
    whose first default is that schema."""
    import yaml

    for conf in sorted((ROOT / "conf" / "target").glob("*.yaml")):
        name = conf.stem
        cls = world_class(name)
        assert name in cls.targets, name
        assert cls.__module__.startswith("coolsd.worlds."), name
        schema_name, schema = cls.schema
        assert schema.__module__ == cls.__module__, f"{name}: the schema sits beside the world class"
        assert yaml.safe_load(conf.read_text())["defaults"][0] == schema_name, name
        assert (ROOT / (cls.__module__.replace(".", "/") + ".py")).is_file()
