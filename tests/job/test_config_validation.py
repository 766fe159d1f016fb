"""A refused configuration stops before anything
loads or is written, in one or two lines naming the key, its value and the valid range.

The command-line rows run ``run.py`` as a subprocess (what a person types). A refused config must
leave no run folder at all: ``coolsd.cli.runner.CheckBeforeRun`` refuses it before Hydra creates the
folder, so the job function (and every model loader behind it) never runs. The output-folder rows
use a path below a regular FILE: tests run as root, where permission bits do not stop writes, but
nothing can create a folder inside a file.
"""
import functools
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import factories
from coolsd.job.config_schema import check_config
from coolsd.util.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TIMES: dict = {}  # override -> (wall s, CPU s) of every refused command line (printed by the last test)


def cli(tmp_path: Path, *overrides, env_extra=None, multirun=False, timeout=120):
    """``python run.py <overrides> hydra.run.dir=<tmp>/run`` -> (process, wall s, child CPU s)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "COOLSD_VERBOSE", "COOLSD_INCLUDE")}
    env.update(env_extra or {})
    args = [sys.executable, str(ROOT / "run.py"), *(["-m"] if multirun else []),  # the last value of a key wins
            f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}", *overrides]
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=timeout)
    proc.env, proc.cwd = env, tmp_path  # for a timing rerun (``assert_refused``)
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    return proc, wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def cpu_of(proc) -> float:
    """Child CPU seconds of running ``proc``'s command again, as it ran."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(proc.args, capture_output=True, text=True, env=proc.env, cwd=proc.cwd, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def assert_refused(tmp_path, proc, wall, cpu, key: str, label: str, status: int = 2):
    out = proc.stdout + proc.stderr
    TIMES[label] = (wall, cpu)
    assert proc.returncode == status, out
    assert key in out, out
    assert "Traceback" not in out, out
    assert len(proc.stderr.strip().splitlines()) <= 2 or status != 2, out  # one or two lines
    assert not (tmp_path / "run").exists() and not (tmp_path / "sweep").exists(), "a refused config wrote files"
    assert not list(tmp_path.rglob("run.json"))
    # at most REFUSAL_WORK_S of CPU beyond starting Python and importing torch and Hydra (measured
    # here, so both inflate alike on a loaded or slower machine; wall time is reported)
    if cpu >= import_cpu() + REFUSAL_WORK_S:  # CPU time inflates on a loaded machine too: both measured again, side by side
        import_cpu.cache_clear()
        cpu = min(cpu, cpu_of(proc))
        TIMES[label] = (wall, cpu)
    assert cpu < import_cpu() + REFUSAL_WORK_S, f"{label}: {cpu:.1f} s CPU ({wall:.1f} s wall; imports {import_cpu():.1f} s)"


REFUSAL_WORK_S = 3.0  # measured 0.5-1.2 s beyond the imports (3.1-3.6 s CPU on a loaded AMD EPYC): config, checks, the world module


@functools.lru_cache(maxsize=1)
def import_cpu() -> float:
    """CPU seconds of ``python -c "import torch, hydra"`` (the floor of any run.py call), the
    smaller of two runs."""
    def once():
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, "-c", "import torch, hydra, omegaconf"], check=True, timeout=120)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return min(once(), once())


# (overrides, the key the message must name): the refusals that are about values
REFUSED = [
    (["sampling.temperature=nan"], "sampling.temperature=nan"),
    (["dataset.n_prompts=-1"], "dataset.n_prompts=-1"),
    (["dataset.n_prompts=0"], "dataset.n_prompts=0"),
    (["dataset.n_prompts=5001"], "the toy pool has 5000 prompts"),
    (["seed=-1"], "seed=-1"),
    (["threads=0"], "threads=0"),
    (["batch_size=0"], "batch_size=0"),
    (["tree.draft_length=100"], "64 image tokens"),
    (["sampling.top_p=nan"], "sampling.top_p=nan"),
    (["method.delta=nan"], "method.delta=nan"),
    (["target.cfg_scale=inf"], "target.cfg_scale=inf"),
    (["shard.index=2", "shard.count=2"], "shard.index 2"),
    (["method=zipar", "method.window=8"], "method.window=8"),
    (["fastest_ar=maybe"], "fastest_ar='maybe'"),
]


# the command line's path is one for every refusal (``CheckBeforeRun`` -> ``one_line_errors``): three of
# them run as a person types them, every one is checked in process (seconds of process start-up saved each)
ON_THE_COMMAND_LINE = {"dataset.n_prompts=5001", "method.delta=nan", "shard.index=2 shard.count=2"}


@pytest.mark.parametrize("overrides, key", [r for r in REFUSED if " ".join(r[0]) in ON_THE_COMMAND_LINE],
                         ids=sorted(ON_THE_COMMAND_LINE, key=[" ".join(o) for o, _ in REFUSED].index))
def test_refused_value_fails_fast_in_one_line(tmp_path, overrides, key):
    proc, wall, cpu = cli(tmp_path, *overrides)
    assert_refused(tmp_path, proc, wall, cpu, key, " ".join(overrides))
    assert proc.stderr.startswith("error: ") and "is invalid" in proc.stderr or "shard" in key


@pytest.mark.parametrize("overrides, key", REFUSED, ids=[" ".join(o) for o, _ in REFUSED])
def test_refused_value_names_its_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        check_config(factories.compose(*overrides))
    assert key in str(e.value) and ("is invalid" in str(e.value) or "shard" in key) and "\n" not in str(e.value)


ROW_PARALLEL = [
    (["method=zipar", "target=lumina_mgpt"], "does not implement yet"),
    (["method=pjd", "deterministic.batch_invariant=true", "batch_size=2"], "not batch-invariant"),
    (["method=pjd", "compile=true"], "eagerly only"),
]


@pytest.mark.parametrize("overrides, words", ROW_PARALLEL, ids=[" ".join(o) for o, _ in ROW_PARALLEL])
def test_row_parallel_refusals_name_the_method(overrides, words):
    """Row-parallel methods (docs/methods.md 8.1, 8.2) on a target without the forward they need, PJD
    batched under batch invariance, and compiled: refused before any work."""
    with pytest.raises(ConfigError) as e:
        check_config(factories.compose(*overrides))
    assert overrides[0] in str(e.value) and words in str(e.value)


def test_a_row_parallel_refusal_is_one_line(tmp_path):
    overrides, words = ROW_PARALLEL[0]
    proc, wall, cpu = cli(tmp_path, *overrides)
    assert_refused(tmp_path, proc, wall, cpu, overrides[0], " ".join(overrides))
    assert words in proc.stderr


# (overrides, what the one line must say): a key no schema declares (typed or added with +), named with
# the closest valid one; a setting the run would not use (refused, never dropped)
UNKNOWN_OR_UNUSED = [
    (["target.cfg_scal=2.0"], "target.cfg_scal is not a setting of target=toy: did you mean target.cfg_scale?"),
    (["+target.cfg_scal=2.0"], "target.cfg_scal is not a setting of target=toy: did you mean target.cfg_scale?"),
    (["tree.draft_lenght=3"], "tree.draft_lenght is not a setting of tree=chain: did you mean tree.draft_length?"),
    (["dataset.n_prompt=3"], "dataset.n_prompt is not a setting of dataset=toy: did you mean dataset.n_prompts?"),
    (["target.devcie=cuda"], "target.devcie is not a setting of target=toy: its settings: name, cfg_scale"),
    (["target.device=cuda"], "target=toy runs on the CPU only: it has no target.device setting"),
    (["method=coolsd", "tree=mc_sim_7b_63", "tree.draft_length=2"],
     "tree.draft_length=2 does not apply to tree=mc_sim_7b_63, a fixed tree: set tree=chain tree.draft_length=2"),
    (["method=sjd", "tree.draft_length=8"], "tree.draft_length does not apply to method=sjd on target=toy, which "
                                            "drafts with no tree (it drafts from the target itself: its window is method.window)"),
    (["method=sjd", "draft=self"], "draft does not apply to method=sjd"),
    (["target=toy_continuous", "method=cspd", "tree.draft_length=3"], "a continuous method's draft length is method.gamma"),
]


@pytest.mark.parametrize("overrides, words", UNKNOWN_OR_UNUSED, ids=[" ".join(o) for o, _ in UNKNOWN_OR_UNUSED])
def test_unknown_and_unused_settings_are_refused(overrides, words):
    """What a run would silently drop is refused before any work: a typo in any group (the schemas
    are open so that ``+key`` composes; ``check_known_settings`` refuses what no schema declares), the
    toy's nonexistent device, a tree a method does not draft with (the command line's overrides)."""
    with pytest.raises(ConfigError) as e:
        check_config(factories.compose(*overrides), overrides=overrides)
    assert words in str(e.value)


@pytest.mark.parametrize("overrides", [["target.cfg_scal=2.0"], ["target.device=cuda"], ["method=sjd", "tree.draft_length=8"]],
                         ids=["typo", "device", "unused"])
def test_unknown_and_unused_settings_are_one_line(tmp_path, overrides):
    """The same refusals from the command line: one line, exit status 2, nothing written."""
    proc, wall, cpu = cli(tmp_path, *overrides, "dataset.n_prompts=1")
    assert_refused(tmp_path, proc, wall, cpu, overrides[-1].split("=")[0], " ".join(overrides))
    assert next(w for o, w in UNKNOWN_OR_UNUSED if o == overrides) in proc.stderr, proc.stderr


def test_settings_a_config_file_sets_for_every_method_are_not_refused():
    """Only what the command line sets is held against a method: a config (an experiment file) may set
    a tree for every row, and the Jacobi methods among them ignore it by design."""
    cfg = factories.compose("method=sjd", "tree.draft_length=8")
    check_config(cfg, overrides=[])  # as if the tree came from a config file
    with pytest.raises(ConfigError, match="tree.draft_length does not apply to method=sjd"):
        check_config(cfg, overrides=["method=sjd", "tree.draft_length=8"])
    check_config(factories.compose("method=coolsd", "tree.draft_length=8"), overrides=["tree.draft_length=8"])


@pytest.mark.parametrize("values, bad", [("-1,2,3", 0), ("2,3,-1", 2)], ids=["bad-first", "bad-last"])
def test_a_sweep_is_checked_whole_before_its_first_job(tmp_path, values, bad):
    """One bad job at either end of a sweep: every job is composed and checked before the first
    starts; the refusal names the bad job by its swept value, in one line, and nothing runs or is written."""
    proc, wall, cpu = cli(tmp_path, f"method.delta={values}", "dataset.n_prompts=1", multirun=True)
    assert_refused(tmp_path, proc, wall, cpu, "method.delta=-1", f"sweep method.delta={values}")
    assert proc.stderr.splitlines()[0].startswith(f"error: job {bad} (method.delta=-1): method.delta=-1"), proc.stderr
    assert "1 of 3 jobs refused: nothing ran" in proc.stderr, proc.stderr


def test_a_sweep_of_settings_a_method_does_not_use_is_refused_per_job(tmp_path):
    proc, _, _ = cli(tmp_path, "method=coolsd,sjd", "tree.draft_length=2,3", "dataset.n_prompts=1", multirun=True)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert [line.removeprefix("error: ").split(":")[0] for line in lines[:2]] == \
        ["job 2 (method=sjd tree.draft_length=2)", "job 3 (method=sjd tree.draft_length=3)"], proc.stderr
    assert lines[2].startswith("2 of 4 jobs refused") and not (tmp_path / "sweep").exists()


def test_corrupted_toy_weights_are_one_line_before_any_folder(tmp_path):
    """A truncated or altered shipped weight file: one line naming it and the rebuild command, exit
    status 2, before Hydra makes the run folder (the checksums are checked with the config)."""
    import shutil

    from coolsd.toy.load_assets import ASSETS_DIR
    from coolsd.util.loading import BadInputFile

    assets = tmp_path / "assets"
    shutil.copytree(ASSETS_DIR, assets)
    weights = assets / "target.safetensors"
    raw = bytearray(weights.read_bytes())
    weights.write_bytes(bytes(raw[:1000]))  # truncated: its header is unreadable too
    proc, wall, cpu = cli(tmp_path, f"target.assets={assets}", "dataset.n_prompts=1")
    assert_refused(tmp_path, proc, wall, cpu, str(weights), "truncated toy weights")
    assert "are corrupted (sha256 differs from manifest.json); run `make toy-assets`" in proc.stderr, proc.stderr
    raw[len(raw) // 2] ^= 0xFF  # altered in the middle: the header reads, the checksum does not match
    weights.write_bytes(bytes(raw))
    with pytest.raises(BadInputFile, match=r"target.safetensors are corrupted .*make toy-assets"):
        check_config(factories.compose(f"target.assets={assets}"))


def test_a_plugin_that_raises_on_import_is_one_line(tmp_path):
    """``--include`` of a file that raises: one line naming the file, its line and the exception,
    exit status 2, nothing written; COOLSD_VERBOSE=1 shows the plugin's traceback."""
    plugin = tmp_path / "broken_method.py"
    plugin.write_text("import math\n\nraise RuntimeError('half-written plugin')\n")
    proc, _, _ = cli(tmp_path, "--include", str(plugin), "dataset.n_prompts=1")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out
    assert proc.stderr.strip() == (f"error: COOLSD_INCLUDE / --include: {plugin}:3 raised RuntimeError: half-written "
                                   "plugin; fix it, or run with COOLSD_VERBOSE=1 for its traceback"), proc.stderr
    assert not (tmp_path / "run").exists()
    proc, _, _ = cli(tmp_path, "--include", str(plugin), env_extra={"COOLSD_VERBOSE": "1"})
    assert "Traceback" in proc.stderr and "half-written plugin" in proc.stderr


def test_wrong_type_fails_at_compose_time(tmp_path):
    """Hydra's structured config refuses a value of the wrong type while composing (its own
    message, naming the override and the key; no traceback, nothing written)."""
    proc, wall, cpu = cli(tmp_path, "sampling.top_k=abc")
    assert_refused(tmp_path, proc, wall, cpu, "sampling.top_k", "sampling.top_k=abc", status=1)
    assert "could not be converted to Integer" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: target.device=cuda is valid here")
def test_cuda_without_cuda_names_the_cpu_settings(tmp_path, world_overrides):
    """A real target (tiny files) with target.device=cuda on a machine without CUDA: one line with
    the CPU settings that work, before any file is opened."""
    proc, wall, cpu = cli(tmp_path, *world_overrides("llamagen_xl"), "target.device=cuda")
    assert_refused(tmp_path, proc, wall, cpu, "target.device=cuda", "target.device=cuda (llamagen_xl)")
    assert "target.device=cpu target.dtype=float32 target.t5_dtype=float32" in proc.stderr


def test_unwritable_output_folder_is_one_line(tmp_path):
    """The run folder below a regular file cannot be created: one line naming it and the key,
    before Hydra sets up its log file (no 'Unable to configure handler')."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    proc, wall, cpu = cli(tmp_path, f"hydra.run.dir={blocker / 'run'}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert f"output folder {blocker / 'run'} cannot be created" in out and "hydra.run.dir" in out, out
    assert "Traceback" not in out and "Unable to configure handler" not in out, out
    assert blocker.read_text() == "not a folder" and not list(tmp_path.rglob("run.json"))
    TIMES["unwritable hydra.run.dir"] = (wall, cpu)


def test_unwritable_sweep_folder_is_one_line(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc, _, _ = cli(tmp_path, "seed=0,1", f"hydra.sweep.dir={blocker / 'sweep'}", multirun=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "hydra.sweep.dir" in out and "Traceback" not in out, out


def test_verbose_shows_the_traceback(tmp_path):
    proc, _, _ = cli(tmp_path, "threads=0", env_extra={"COOLSD_VERBOSE": "1"})
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "threads=0" in proc.stderr, proc.stderr


# ------------------------------------------------------------------------------ in process
def test_run_job_checks_before_loading(tmp_path, monkeypatch, world_overrides):
    """``run_job`` (tests, sweeps, benchmarks call it without Hydra's callback) runs the same
    check first: no loader is called, no folder is made."""
    from coolsd.cli.runner import run

    monkeypatch.setattr("coolsd.job.generation.load_world", lambda cfg: pytest.fail("a model was loaded"))
    for overrides, key in [(["threads=0"], "threads=0"), (["sampling.temperature=nan"], "temperature"),
                           (["tree.draft_length=65"], "64 image tokens")]:
        with pytest.raises(ConfigError, match=key):
            run(factories.compose(*overrides, f"+out_dir={tmp_path / 'run'}"))
    blocker = tmp_path / "f"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"output folder .*f/run cannot be created .*set out_dir="):
        run(factories.compose("dataset.n_prompts=1", f"+out_dir={blocker / 'run'}"))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"target.device=cuda but CUDA is not available"):
            run(factories.compose(*world_overrides("llamagen_xl"), "target.device=cuda", f"+out_dir={tmp_path / 'run'}"))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, message", [
    (["sampling.top_p=0"], r"sampling.top_p=0.0 is invalid: it must be a finite number > 0 and <= 1"),
    (["sampling.top_k=-1"], r"sampling.top_k=-1 is invalid: it must be an integer >= 0 \(0 = the whole vocabulary\)"),
    (["sampling.temperature=-1"], r"sampling.temperature=-1.0 .* >= 0"),
    (["target.sampling.temperature=nan"], r"target.sampling.temperature=nan"),
    (["dataset.offset=4999", "dataset.n_prompts=2"], r"dataset.n_prompts=2 .* 1 \.\. 1 \(the toy pool has 5000"),
    (["dataset.offset=-1"], r"dataset.offset=-1 is invalid: it must be an integer in 0 \.\. 4999"),
    (["dataset=coco2017val", "dataset.n_prompts=5001"], r"dataset.n_prompts=5001 .*\(the coco2017val pool has 5000"),
    (["tree.draft_length=0"], r"tree.draft_length=0 .* 1 \.\. 64"),
    (["method=lantern_pp", "+method.lambda=2"], r"no parameter\(s\) \['lambda'\]"),
    (["method=coolsd", "method.nu=nan"], r"method.nu=nan"),
    (["target=tabular", "tree.draft_length=6"], r"tree.draft_length=6 .* target tabular's 5 image tokens"),
    (["target=llamagen_xl", "target.device=cpu", "target.dtype=fp32"], r"target.dtype='fp32' is invalid: valid: float32"),
    (["target=llamagen_xl", "target.device=cpu", "tree.draft_length=257"], r"llamagen_xl's 256 image tokens"),
    (["target=lumina_mgpt", "target.device=cpu", "tree.draft_length=2305"], r"lumina_mgpt's 2304 image tokens"),
    (["compile=true", "target=mar_h", "target.device=cpu", "method=cspd"], r"compile=true is not implemented for target=mar_h"),
    (["fastest_ar=1"], r"fastest_ar=1 is invalid: valid: auto, true, false"),
    (["fastest_ar=true", "target=mar_h", "target.device=cpu", "method=cspd"],
     r"fastest_ar=true times compiled AR, which target=mar_h does not have \(.*toy.*\): set fastest_ar=auto or false"),
    (["fastest_ar=true", "compile=true"], r"compile=true compiles the run's own ar already .*: set fastest_ar=auto or false"),
    (["fastest_ar=true", "deterministic.batch_invariant=true"], r"batch_invariant=true excludes: set fastest_ar=auto"),
])
def test_range_checks(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_config(factories.compose(*overrides))


@pytest.mark.parametrize("overrides", [["dataset=imagenet", "dataset.n_prompts=50000"], ["tree.draft_length=64"],
                                       ["dataset.offset=4990", "dataset.n_prompts=10"], ["sampling.top_k=null"],
                                       ["fastest_ar=true"], ["fastest_ar=false", "compile=true"],
                                       ["fastest_ar=auto", "target=toy_continuous", "method=cspd"]])
def test_in_range_values_pass(overrides):
    check_config(factories.compose(*overrides))


@pytest.mark.parametrize("override, key", [("threads=abc", "threads"), ("target.cfg_scale=abc", "target.cfg_scale"),
                                           ("shard.count=x", "shard.count"), ("tree.draft_length=2.5", "tree.draft_length"),
                                           ("dataset.n_prompts=many", "dataset.n_prompts"), ("compile=maybe", "compile")])
def test_schema_types_are_checked_at_compose_time(override, key):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as e:
        factories.compose(override)
    assert key in str(e.value) + str(e.value.__cause__)


@pytest.mark.parametrize("target", ["toy", "toy_continuous", "llamagen_xl", "llamagen_xl_512", "lumina_mgpt",
                                    "mar_h", "mar_l", "tabular", "xar_h", "xar_l", "harmon_1_5b", "janus_pro",
                                    "janus_pro_7b", "emu3"])
def test_every_target_config_composes_and_checks(target, world_overrides):
    """Every conf/target/*.yaml composes against its schema; its defaults are in range (real
    targets on their tiny files, on the CPU)."""
    from omegaconf import OmegaConf

    extra = ["method=cspd"] if target in ("toy_continuous", "mar_h", "mar_l", "xar_h", "xar_l", "harmon_1_5b") else []
    if target in ("mar_h", "mar_l", "xar_h", "xar_l"):
        extra.append("dataset=imagenet")
    real = target not in ("toy", "toy_continuous", "tabular")
    cfg = factories.compose(*(world_overrides(target) if real else [f"target={target}"]), *extra)
    assert OmegaConf.get_type(cfg.target).__name__.endswith("TargetSchema")
    check_config(cfg)


def test_refusals_were_fast(tmp_path):
    """A refused command line, run and timed HERE (self-contained: it passes alone and in any order):
    at most REFUSAL_WORK_S of CPU beyond the imports (``assert_refused``), a finite wall time. Also
    reports the slowest refusal timed so far in this session (this one included)."""
    proc, wall, cpu = cli(tmp_path, "threads=0")
    assert_refused(tmp_path, proc, wall, cpu, "threads=0", "threads=0 (timed by test_refusals_were_fast)")
    assert math.isfinite(wall) and wall > 0 and math.isfinite(cpu) and cpu > 0, (wall, cpu)
    print(f"\nthis refusal: {wall:.2f} s wall, {cpu:.2f} s CPU; imports alone: {import_cpu():.2f} s CPU")
    label, (w, c) = max(TIMES.items(), key=lambda kv: kv[1][0])
    print(f"slowest refusal so far: {label}: {w:.2f} s wall, {c:.2f} s CPU over {len(TIMES)} command lines")
