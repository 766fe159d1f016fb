"""A user's mistake on the command line is one line on stderr, exit status 2, with the fix, and
writes nothing: merging shards that do not belong together (another configuration, a shard file
without its images), a folder without shards or that does not exist, a record file corrupted mid-way
(merge, a resumed run), a prompt far longer than the target reads (the reason within the line's
first 200 characters, the prompt cut). ``COOLSD_VERBOSE`` / ``HYDRA_FULL_ERROR`` unset: those add
the traceback."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from coolsd.cli.runner import VERBOSE_ENV, run
from coolsd.toy.scenes import WORDS
from coolsd.util.errors import InputError
from factories import compose

ROOT = Path(__file__).resolve().parents[2]
SHARD = "samples.shard-000-of-002.jsonl"


def _cli(*argv, cwd=ROOT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in VERBOSE_ENV}
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def refused(proc, *words) -> str:
    """The one stderr line of a refusal (exit status 2, no traceback), holding every one of ``words``."""
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """Shard 0 of 2 of a toy run of 2 prompts (records of prompt 0: ar, eagle)."""
    out = tmp_path_factory.mktemp("shard") / "run"
    run(compose("method=eagle", "dataset.n_prompts=2", f"+out_dir={out}", "shard.index=0", "shard.count=2"))
    return out


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _nothing_merged(folder):
    assert not (folder / "samples.jsonl").exists() and not (folder / "summary.json").exists()


def test_merging_shards_of_another_configuration_is_one_line(shard, tmp_path):
    mine, other = _copy(shard, tmp_path / "mine"), _copy(shard, tmp_path / "other")
    ident = json.loads((other / "run.json").read_text())
    (other / "run.json").write_text(json.dumps({**ident, "seed": 1}))
    refused(_cli("-m", "coolsd.cli.merge", str(mine), "--from", str(other)),
            f"{other} holds a run of another configuration", "seed: 0 -> 1", "only shards of one run can be merged")
    _nothing_merged(mine)


def test_a_shard_file_without_its_images_is_refused_before_anything_is_written(shard, tmp_path):
    folder = tmp_path / "copied"
    folder.mkdir()
    shutil.copy(shard / "run.json", folder)
    shutil.copy(shard / SHARD, folder)  # the records, not their images
    line = refused(_cli("-m", "coolsd.cli.merge", str(folder), "--partial"),
                   "2 of its 2 records point to images that are missing", "images/ar/00000.png", "restore the images")
    assert len(line) < 500
    _nothing_merged(folder)


def test_merge_of_a_folder_without_shards_or_without_a_run_is_one_line(shard, tmp_path):
    refused(_cli("-m", "coolsd.cli.merge", str(tmp_path / "nope")), f"{tmp_path / 'nope'} does not exist")
    (tmp_path / "empty").mkdir()
    refused(_cli("-m", "coolsd.cli.merge", str(tmp_path / "empty")), "holds no run.json: not a run folder")
    (tmp_path / "bare").mkdir()
    shutil.copy(shard / "run.json", tmp_path / "bare")
    refused(_cli("-m", "coolsd.cli.merge", str(tmp_path / "bare"), "--partial"),
            "holds no records of its run", "samples.shard-*-of-002.jsonl", "nothing to merge")
    _nothing_merged(tmp_path / "bare")


def test_a_record_file_corrupted_mid_way_is_one_line_for_merge_and_for_a_resumed_run(shard, tmp_path):
    folder = _copy(shard, tmp_path / "corrupt")
    path = folder / SHARD
    lines = path.read_text().splitlines()
    path.write_text(lines[0][:40] + "\n" + "\n".join(lines[1:]) + "\n")  # line 1 cut short, line 2 whole
    refused(_cli("-m", "coolsd.cli.merge", str(folder), "--partial"),
            f"{path} line 1 of 2 is not JSON", "corrupted", "delete that line")
    _nothing_merged(folder)
    with pytest.raises(InputError, match=r"line 1 of 2 is not JSON .*corrupted.*delete that line"):
        run(compose("method=eagle", "dataset.n_prompts=2", f"+out_dir={folder}", "shard.index=0", "shard.count=2"))
    assert path.read_text().splitlines()[1] == lines[1]  # untouched


def test_a_very_long_prompt_is_refused_with_its_reason_first_and_the_prompt_cut(tmp_path):
    valid = [w for w in WORDS if not w.startswith("<")]
    prompts = tmp_path / "long.txt"
    prompts.write_text(" ".join(valid[i % len(valid)] for i in range(10_000)) + "\n")
    out = tmp_path / "out"
    line = refused(_cli(str(ROOT / "run.py"), "dataset=prompts", f"dataset.path={prompts}", f"hydra.run.dir={out}",
                        cwd=tmp_path))
    assert len(line) < 400, len(line)
    assert line.startswith(f"error: {prompts} line 1 (prompt 0): 10000 words, more than 16, the toy caption "
                           "encoder's limit; shorten it (the prompt: 'a against at ")
    assert "..." in line
    assert not out.exists()


def test_a_bad_evaluate_option_is_one_line_with_exit_status_2(shard):
    """``coolsd.cli.evaluate``'s option refusals (an unknown metric or protocol) are the same one
    line and exit status 2 as a run's, before any input is read."""
    refused(_cli("-m", "coolsd.cli.evaluate", str(shard), "--device", "cpu", "--metrics", "clip_score,is"),
            "error: unknown metric(s) ['is']; valid: ")
    refused(_cli("-m", "coolsd.cli.evaluate", str(shard), "--device", "cpu", "--protocol", "clean"),
            "error: unknown --protocol 'clean'; valid: lantern, sjd")
