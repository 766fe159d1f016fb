"""All per-sample records of a set of runs (or a multirun folder) in one parquet table, with
each run's folder and resolved identity, so that metrics and plots are recomputed from records
and images without regenerating (``python -m coolsd.report.consolidate multirun/... -o t.parquet``)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from coolsd.records import read_records


def find_runs(roots) -> list[Path]:
    """Run folders (holding samples.jsonl) under the given folders, sorted."""
    runs = set()
    for root in map(Path, roots):
        if not root.exists():
            raise FileNotFoundError(f"run folder {root} does not exist")
        runs.update(p.parent for p in root.rglob("samples.jsonl"))
    return sorted(runs)


def records_frame(roots) -> pd.DataFrame:
    """One row per sample: the record's fields (lists and dicts as JSON text), ``run`` (its
    folder) and ``image_path`` (absolute)."""
    runs = find_runs(roots)
    if not runs:
        raise FileNotFoundError(f"no samples.jsonl under {', '.join(map(str, roots))}")
    rows = []
    for run in runs:
        ident = run / "run.json"
        ident_text = ident.read_text() if ident.exists() else None
        for r in read_records(run / "samples.jsonl"):
            row = {k: (json.dumps(v) if isinstance(v, (list, dict)) else v) for k, v in r.items()}
            row.update(run=str(run), run_identity=ident_text,
                       image_path=str(run / r["image"]) if "image" in r else None)
            rows.append(row)
    return pd.DataFrame(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("runs", nargs="+", type=Path, help="run folders or folders containing runs (multirun/...)")
    ap.add_argument("-o", "--out", type=Path, required=True, help="parquet file to write")
    a = ap.parse_args(argv)
    df = records_frame(a.runs)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_name(a.out.name + ".partial")
    df.to_parquet(tmp, index=False)
    tmp.replace(a.out)
    print(f"{len(df)} samples from {df['run'].nunique()} run(s) -> {a.out}")


if __name__ == "__main__":
    main()
