"""Copies the pure-Python packages a GPU machine without network lacks into one folder beside the
checkout, from this environment's own installs, so that ``PYTHONPATH=<checkout>:<folder>`` runs
``run.py`` and the benchmarks there on the torch that machine already has (docs/gpu.md, "A GPU
machine without network").

    python tools/offline_site.py                 # -> .offline_site/ (git-ignored)
    python tools/offline_site.py --out DIR --extra wandb

``PACKAGES`` are the import names the harness needs beyond what such machines were seen to have
(torch, numpy, scipy, pandas, matplotlib, safetensors, transformers, torchmetrics, pyyaml,
pytest): Hydra and OmegaConf with ANTLR's runtime (whose 4.9.3 release has no wheel: the folder is
copied), ftfy and wcwidth (LlamaGen's caption cleaner), Beautiful Soup and soupsieve, submitit with
cloudpickle and Hydra's submitit launcher plugin. Every copied package must be pure Python: a
compiled extension built for this machine would not load on another, and is refused.
"""
from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hydra", "omegaconf", "antlr4", "ftfy", "wcwidth", "bs4", "soupsieve", "submitit", "cloudpickle",
            "hydra_plugins.hydra_submitit_launcher")
COMPILED = (".so", ".pyd", ".dylib")
OPTIONAL_COMPILED = ("wcwidth",)  # its C extension is optional (a pure-Python fallback): left out


def source_of(name: str) -> Path:
    """The installed folder (or single-file module) of import name ``name``; a one-line error if
    it is not installed here."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None and not spec.submodule_search_locations:
        raise SystemExit(f"offline_site: {name} is not installed in {sys.executable}'s environment: "
                         f"pip install it here first (`make install` installs the harness's own)")
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin)


def copy(name: str, out: Path) -> Path:
    src = source_of(name)
    compiled = [p for p in ([src] if src.is_file() else src.rglob("*")) if p.suffix in COMPILED]
    if compiled and name not in OPTIONAL_COMPILED:
        raise SystemExit(f"offline_site: {name} has compiled files ({compiled[0].name}): not portable, install it "
                         f"on the GPU machine instead")
    dest = out.joinpath(*name.split("."))
    if src.is_file():
        dest = dest.with_suffix(".py")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest)
    else:
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__", *(f"*{s}" for s in COMPILED)))
    return dest


def main(argv=None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / ".offline_site")
    ap.add_argument("--extra", default="", help="more import names to copy, comma-separated")
    a = ap.parse_args(argv)
    names = list(PACKAGES) + [s.strip() for s in a.extra.split(",") if s.strip()]
    a.out.mkdir(parents=True, exist_ok=True)
    done = [copy(n, a.out) for n in names]
    size = sum(p.stat().st_size for d in done for p in ([d] if d.is_file() else d.rglob("*")) if p.is_file())
    print(f"offline_site: {len(done)} packages, {size / 2**20:.1f} MiB -> {a.out}")
    return done


if __name__ == "__main__":
    main()
