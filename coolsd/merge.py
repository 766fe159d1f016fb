"""Join the shards of a run (``coolsd.shards``) into the records and summary one process would
have written:

    python -m coolsd.merge outputs/toy/coolsd/<time>                  # shards in one folder
    python -m coolsd.merge <folder> --from <other folder> ...          # shards copied from elsewhere
    python -m coolsd.merge <folder> --partial                          # report what is there

Checks before writing anything: every folder holds a run of the same configuration (its
``run.json``), every shard file has the run's shard count, a sample present in two shards is
the same sample, and (unless ``--partial``) every (method, prompt) pair is present, else an error
lists the missing prompts. Writes ``samples.jsonl`` (prompt order, methods in run order) and
``summary.json`` atomically; shard files stay as they are.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from coolsd.records import identity_diff, read_records, write_json_atomic
from coolsd.shards import SHARD_FILE

TIMING_KEYS = ("latency_s", "decode_s")  # differ between processes; everything else must not


def _identity(folder: Path) -> dict:
    path = folder / "run.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} holds no run.json: not a run folder")
    return json.loads(path.read_text())


def _ranges(xs: list[int]) -> str:
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


def shard_records(folder: Path, count: int) -> list[dict]:
    """Complete records of every shard file (a truncated last line is skipped)."""
    records = []
    files = sorted(folder.glob("samples.shard-*.jsonl")) if count > 1 else [folder / "samples.jsonl"]
    for f in files:
        m = SHARD_FILE.match(f.name)
        if m and int(m.group(2)) != count:
            raise ValueError(f"{f} belongs to a run of {int(m.group(2))} shards, but {folder}/run.json says {count}: "
                             "the shard count changed between runs of this folder")
        records += read_records(f)
    return records


def merge(folder, sources=(), partial: bool = False) -> dict:
    folder = Path(folder)
    ident = _identity(folder)
    for src in map(Path, sources):
        other = _identity(src)
        if other != ident:
            diff = identity_diff(ident, other)
            raise ValueError(f"{src} holds a run of another configuration than {folder} (differs in "
                             f"{', '.join(diff[:8])}); only shards of one run can be merged")
    count = int(ident.get("shards", 1))
    methods = list(ident["methods"])
    d = ident["dataset"]
    prompts = range(int(d["offset"]), int(d["offset"]) + int(d["n_prompts"]))
    by_key: dict = {}
    for src in [folder, *map(Path, sources)]:
        for r in shard_records(src, count):
            key = (r["method"], r["prompt_index"])
            if key in by_key:
                a = {k: v for k, v in by_key[key][0].items() if k not in TIMING_KEYS}
                b = {k: v for k, v in r.items() if k not in TIMING_KEYS}
                if a != b:
                    raise ValueError(f"two different samples for method {key[0]!r}, prompt {key[1]} (in {src}); "
                                     "shards of one run never overlap")
                continue
            by_key[key] = (r, src)
    missing = sorted({p for t in methods for p in prompts if (t, p) not in by_key})
    if missing and not partial:
        raise ValueError(f"{folder}: {len(missing)} of {len(prompts)} prompts are incomplete ({_ranges(missing)}); "
                         "rerun their shards (they resume), or pass --partial to report what is there")
    for (_, _), (r, src) in by_key.items():  # images of shards written elsewhere
        if src != folder and "image" in r and not (folder / r["image"]).exists():
            (folder / r["image"]).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / r["image"], folder / r["image"])
    complete = [p for p in prompts if all((t, p) in by_key for t in methods)]
    records = [by_key[(t, p)][0] for p in complete for t in methods]
    tmp = folder / "samples.jsonl.partial"
    tmp.write_text("".join(json.dumps(r, default=float) + "\n" for r in records))
    tmp.replace(folder / "samples.jsonl")
    failed = {t: [p for p in complete if "error" in by_key[(t, p)][0]] for t in methods}
    ok = [p for p in complete if not any(p in v for v in failed.values())]  # compared where all succeeded
    summary = summarize_records(folder, ident, [r for r in records if r["prompt_index"] in set(ok)], ok)
    summary.update(merged_shards=count, prompts_complete=len(complete), prompts_missing=missing,
                   failures={t: v for t, v in failed.items() if v})
    write_json_atomic(summary, folder / "summary.json")
    return summary


def summarize_records(folder: Path, ident: dict, records: list[dict], prompts: list[int]) -> dict:
    """The run's summary from merged records: speed numbers for every job; the toy metrics too."""
    import numpy as np
    from PIL import Image

    from coolsd.job import speed_summary

    if not prompts:
        return {"job": ident["job"], "results": {}}
    toy = ident["job"] == "toy"  # only the toy metrics read the images back
    outputs = {}
    for tag in ident["methods"]:
        rows = [r for r in records if r["method"] == tag]
        imgs = np.stack([np.asarray(Image.open(folder / r["image"]).convert("RGB")) for r in rows]) if toy else None
        outputs[tag] = (rows, imgs)
    if toy:
        from coolsd.toy.assets import load_toy_world
        from coolsd.toy.job import summarize, toy_prompts

        world = load_toy_world(cfg_scale=ident["cfg_scale"])
        if world.manifest["sha256"] != ident["assets"]:
            raise ValueError(f"{folder} was generated with other toy weights than the installed ones")
        pool = toy_prompts(max(prompts) + 1)
        table = summarize(world, outputs, [pool[p] for p in prompts])
    else:
        table = speed_summary(outputs)
    return {"job": ident["job"], "method": ident["methods"], "n_prompts": len(prompts), "batch_size": ident.get("batch_size", 1),
            "speedup_reference": "ar on the same prompts, same run (merged shards)", "results": table}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--from", dest="sources", type=Path, nargs="*", default=[], help="other folders with shards of this run")
    ap.add_argument("--partial", action="store_true", help="summarise the complete prompts even if some are missing")
    a = ap.parse_args(argv)
    s = merge(a.run, a.sources, a.partial)
    print(f"merged {s['merged_shards']} shard(s): {s['prompts_complete']} complete prompts"
          + (f", {len(s['prompts_missing'])} missing" if s["prompts_missing"] else "") + f" -> {a.run}/summary.json")
    for tag, e in s["results"].items():
        sp = e.get("speedup")
        print(f"{tag:<14} accepted length {e['accepted_length']['mean']:.3f}"
              + (f"  speed-up {sp['mean']:.3f} [{sp['ci95'][0]:.3f}, {sp['ci95'][1]:.3f}]" if sp else ""))
    return s


if __name__ == "__main__":
    main()
