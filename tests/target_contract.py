"""A target's tests in its own module (docs/add_target.md, "Tests to add"): the module declares one
class that subclasses ``TargetContract`` with its tiny files, the overrides that run the target on
them and the contract's settings; the class registers itself by target name (``DECLARED``), and
pytest runs the contract on every name it declares, in that module. conftest.py finds the
declarations in tests/worlds/ (``declarations``): the session fixture of each target's tiny files
(``files_fixture``, built once) and ``world_overrides(name)`` come from them. A target from outside
the package declares itself the same way, with the folder it is included from (``include``).

The contract, for every declared name: under ``deterministic.batch_invariant=true`` a batch-2 run of
3 prompts (a full batch and a remainder) writes the batch-1 run's records and images bit for bit;
a run killed part-way resumes to the uninterrupted run's records; two shards merged by
``coolsd.cli.merge`` give the one-process run's records and a summary with every field of the
one-process summary; and (``lists_missing_files``) every file of the target and of its drafter that
is not there is named in one error before any work."""
from __future__ import annotations

import importlib
import json
import re
import shutil
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
WORLD_TESTS = ROOT / "tests" / "worlds"  # where the target test modules sit (one per target family)
DECLARED: dict[str, type] = {}  # target name -> its declaring class
BATCH = 2  # the batched run: 3 prompts at batch 2 are a full batch and a remainder
TIMING = ("latency_s", "signal_s", "decode_s", "hardware", "batch_size", "draft_forwards")  # draft_forwards: per batch
# summary fields measured in seconds (they differ between any two runs)
TIMED = ("latency_s", "signal_s", "decode_s", "images_per_s", "speedup", "speedup_per_accepted_length",
         "speedup_without_signals", "speedup_vs_fastest_ar", "fastest_ar")  # fastest_ar: the AR of lower latency


class TargetContract:
    """The mixin of a target's declaration (module docstring). A subclass sets:

    * ``runs``: target name -> the contract's method overrides (small: 3 prompts x the methods'
      records must give the killed run a third record to stop in);
    * ``files(folder)``: writes the tiny files of the real classes in the official layouts into
      ``folder`` and returns what ``overrides`` needs (None: the target runs with no files of its
      own); ``files_fixture``: the name of the session fixture that builds them once;
    * ``overrides(files)``: the Hydra overrides that point the target at them;
    * optionally ``n_prompts`` (3), ``sets_n_prompts`` (False where the world draws its own prompts),
      ``include`` (the folder an outside target is included from), ``lists_missing_files`` (False
      where the target has no files to miss), ``missing_overrides`` / ``missing_names`` (what that
      check composes and expects named; default: every ``target.files`` key)."""

    runs: ClassVar[dict[str, list[str]]] = {}
    files_fixture: ClassVar[Optional[str]] = None
    n_prompts: ClassVar[int] = 3
    sets_n_prompts: ClassVar[bool] = True
    include: ClassVar[Optional[Path]] = None
    lists_missing_files: ClassVar[bool] = True
    missing_overrides: ClassVar[tuple[str, ...]] = ()
    missing_names: ClassVar[Optional[tuple[str, ...]]] = None

    files: ClassVar[Callable[[Path], Any]] = staticmethod(lambda folder: None)
    overrides: ClassVar[Callable[[Any], list[str]]] = staticmethod(lambda files: [])

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        for name in cls.runs:  # every name checked before any is registered
            other = DECLARED.get(name)
            if other is not None and other.__qualname__ != cls.__qualname__:
                raise ValueError(f"target {name!r} is declared by {other.__module__}.{other.__qualname__} and by "
                                 f"{cls.__module__}.{cls.__qualname__}")
        DECLARED.update(dict.fromkeys(cls.runs, cls))
        if not cls.lists_missing_files:  # nothing to collect (a None attribute is no test)
            cls.test_missing_files_are_listed_before_any_work = None

    def pytest_generate_tests(self, metafunc):
        """Every contract test runs once per declared name (the ``target`` argument)."""
        if "target" in metafunc.fixturenames:
            metafunc.parametrize("target", sorted(self.runs))

    # ------------------------------------------------------------------ the contract
    def _cfg(self, compose, world_overrides, name, out, *extra, n=None):
        n_prompts = [f"dataset.n_prompts={n or self.n_prompts}"] if self.sets_n_prompts else []
        return compose(*world_overrides(name), *self.runs[name], *n_prompts, f"+out_dir={out}", *extra)

    def test_world_contract(self, target, compose, world_overrides, tmp_path, monkeypatch):
        from coolsd.cli.merge import merge
        from coolsd.cli.runner import run

        name, n = target, self.n_prompts
        if self.include is not None:
            monkeypatch.setenv("COOLSD_INCLUDE", str(self.include))
        inv = "deterministic.batch_invariant=true"
        one = tmp_path / "one"
        s_one = run(self._cfg(compose, world_overrides, name, one, inv))
        recs = records(one)
        tags = list(s_one["results"])
        assert len(recs) == n * len(tags) and s_one["n_prompts"] == n and s_one["target"] == name

        # batch BATCH = batch 1, bit for bit, under the flag: a full batch and the remainder's
        batched = tmp_path / "batched"
        s_batched = run(self._cfg(compose, world_overrides, name, batched, inv, f"batch_size={BATCH}"))
        assert s_batched["batch_size"] == BATCH and strip(records(batched)) == strip(recs)
        assert {r.get("batch_size", 1) for r in records(batched)} == {BATCH, n % BATCH}
        assert same_images(one, batched, recs)

        # killed part-way (two records and half a line written, an orphan PNG of the next sample): resumes
        killed = tmp_path / "killed"
        shutil.copytree(one, killed)
        lines = (killed / "samples.jsonl").read_text().splitlines()
        (killed / "samples.jsonl").write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][: len(lines[2]) // 2])
        (killed / "summary.json").unlink()
        for r in recs[3:]:
            if "image" in r:
                (killed / r["image"]).unlink()
        run(self._cfg(compose, world_overrides, name, killed, inv))
        assert strip(records(killed)) == strip(recs) and same_images(one, killed, recs)

        # two shards, merged = one process: records, and every summary field
        sharded = tmp_path / "sharded"
        for k in (1, 0):
            out = run(self._cfg(compose, world_overrides, name, sharded, inv, f"shard.index={k}", "shard.count=2"))
            assert out["shard"] == k
        merged = merge(sharded)
        assert strip(records(sharded)) == strip(recs) and same_images(one, sharded, recs)
        assert fields(s_one) <= fields(merged)
        for tag in tags:
            for key, value in s_one["results"][tag].items():
                if key not in TIMED:
                    assert merged["results"][tag][key] == value, (tag, key)
        for key in ("target", "methods", "n_prompts", "device", "hardware", "threads", "failures", "settings"):
            assert merged.get(key) == s_one.get(key), key

    def test_missing_files_are_listed_before_any_work(self, target, compose, tmp_path, monkeypatch):
        """Every file of the target (and of its drafter where it has one) not set or not there: one
        error naming each, before anything loads or any folder is made."""
        from coolsd.cli.runner import run

        for var in file_variables(self.include):
            monkeypatch.delenv(var, raising=False)
        if self.include is not None:
            monkeypatch.setenv("COOLSD_INCLUDE", str(self.include))
        cfg = compose(f"target={target}", *self.runs[target], *self.missing_overrides, f"+out_dir={tmp_path / 'out'}")
        names = self.missing_names if self.missing_names is not None else list(cfg.target.get("files") or {})
        assert names, f"{target}: no file to list (declare lists_missing_files = False)"
        with pytest.raises(FileNotFoundError) as e:
            run(cfg)
        for f in names:
            assert f"{f}: " in str(e.value), (f, str(e.value))
        assert not (tmp_path / "out").exists()


def declarations() -> dict[str, type]:
    """target name -> its declaring class, from every target test module in tests/worlds/ (imported
    under the name pytest gives it, so a module is never imported twice)."""
    for path in sorted(WORLD_TESTS.glob("test_*.py")):
        importlib.import_module(path.stem)
    return dict(DECLARED)


def file_variables(include: Optional[Path] = None) -> set[str]:
    """The environment variables the target and draft conf files read a file path from
    (``${oc.env:VAR,...}``): the missing-files check clears them all."""
    confs = [ROOT / "conf"] + ([include / "conf"] if include is not None else [])
    return {v for c in confs for sub in ("target", "draft") for f in sorted((c / sub).glob("*.yaml"))
            for v in re.findall(r"oc\.env:(\w+)", f.read_text())}


def records(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "samples.jsonl").read_text().splitlines()]


def strip(recs) -> list[dict]:
    """Records without their timings, in (prompt, method) order."""
    key = lambda r: (r["prompt_index"], r["method"])  # noqa: E731
    return [{k: v for k, v in r.items() if k not in TIMING} for r in sorted(recs, key=key)]


def same_images(a: Path, b: Path, recs) -> bool:
    return all(np.array_equal(np.asarray(Image.open(a / r["image"])), np.asarray(Image.open(b / r["image"])))
               for r in recs if "image" in r)


def fields(d, prefix="") -> set[str]:
    """Every key path of a nested summary."""
    out = set()
    for k, v in d.items():
        out.add(prefix + k)
        if isinstance(v, dict):
            out |= fields(v, prefix + k + ".")
    return out
