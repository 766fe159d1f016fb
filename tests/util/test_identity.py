"""Content identity of a run's inputs (coolsd.util.fingerprint): run.json records a
sha256 of every weight and data file a world names (cached while the file is unchanged, never
fooled by a same-size replacement, even with its mtime restored); a resume whose GPT file was
replaced by another of the same name and size is refused naming the file, and so is a merge of
shards that ran on different files."""
import json
import os
import shutil

import pytest
import torch

import coolsd.util.fingerprint as fp
from coolsd.cli.merge import merge
from coolsd.cli.runner import run
from factories import CAPTIONS_FIXTURE, compose


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COOLSD_CACHE_DIR", str(tmp_path / "cache"))


def _same_size_other_gpt(path):
    """Overwrite ``path`` with other random weights of the same layout (hence the same byte count)."""
    size = path.stat().st_size
    ckpt = torch.load(path, weights_only=True)
    g = torch.Generator().manual_seed(99)
    for v in ckpt["model"].values():
        if v.is_floating_point():
            v.copy_(0.2 * torch.randn(v.shape, generator=g))
    torch.save(ckpt, path)
    assert path.stat().st_size == size  # the replacement is indistinguishable by name and size


def test_fingerprint_sees_same_size_replacements_and_caches_unchanged_files(tmp_path, monkeypatch):
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 1000)
    calls = []
    real = fp.sha256_file
    monkeypatch.setattr(fp, "sha256_file", lambda p: calls.append(p) or real(p))
    first = fp.fingerprint(f)
    assert first == {"name": "w.bin", "bytes": 1000, "sha256": real(f)} and len(calls) == 1
    assert fp.fingerprint(f) == first and len(calls) == 1  # cached while unchanged
    st = f.stat()
    f.write_bytes(b"b" * 1000)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # same name, size and mtime: only ctime tells
    second = fp.fingerprint(f)
    assert second["sha256"] == real(f) != first["sha256"] and len(calls) == 2
    d = tmp_path / "folder"
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "sub" / "weights.bin").write_bytes(b"x" * 10)
    folder = fp.fingerprint(d)
    assert folder["files"] == 2 and folder["bytes"] == 12
    (d / ".cache").mkdir()
    (d / ".cache" / "download.lock").write_text("hub metadata")  # hidden: not part of the content
    assert fp.fingerprint(d) == folder
    (d / "sub" / "weights.bin").write_bytes(b"y" * 10)
    assert fp.fingerprint(d)["sha256"] != folder["sha256"]
    assert fp.fingerprint(tmp_path / "absent.pt") == {"name": "absent.pt", "bytes": None, "sha256": None}


def test_a_read_only_cache_still_fingerprints(tmp_path, monkeypatch):
    f = tmp_path / "w.bin"
    f.write_bytes(b"abc")
    (tmp_path / "ro").write_text("a file where the cache folder would be")
    monkeypatch.setenv("COOLSD_CACHE_DIR", str(tmp_path / "ro"))
    assert fp.fingerprint(f)["sha256"] == fp.sha256_file(f)


def test_data_files_are_fingerprinted(compose):
    from coolsd.worlds import world_class

    cfg = compose("target=llamagen_xl", "dataset=coco2017val", f"dataset.captions={CAPTIONS_FIXTURE}")
    ds = world_class("llamagen_xl").dataset(cfg)
    assert ds["captions"] == fp.fingerprint(CAPTIONS_FIXTURE)


def _llamagen(world_overrides, gpt, out, *extra):
    over = [o for o in world_overrides("llamagen_xl") if not o.startswith("target.files.gpt=")]
    return compose(*over, f"target.files.gpt={gpt}", "method=ar", "dataset.n_prompts=2", f"+out_dir={out}", *extra)


def test_resume_with_a_replaced_weight_file_of_the_same_size_is_refused(world_overrides, llamagen_files, tmp_path):
    gpt = tmp_path / "weights" / "gpt.pt"
    gpt.parent.mkdir()
    shutil.copy(llamagen_files["gpt"], gpt)
    out = tmp_path / "run"
    run(_llamagen(world_overrides, gpt, out))
    ident = json.loads((out / "run.json").read_text())
    assert ident["world"]["gpt"] == {"name": gpt.name, "bytes": gpt.stat().st_size, "sha256": fp.sha256_file(gpt)}
    assert ident["world"]["t5"]["files"] > 1 and len(ident["world"]["t5"]["sha256"]) == 64  # folders too
    records = (out / "samples.jsonl").read_text()
    _same_size_other_gpt(gpt)
    with pytest.raises(ValueError, match=r"holds a run of another configuration \(world\.gpt \(gpt\.pt\) has other content than the file "
                                         r"this folder was started with \(sha256 .*same name and size\)"):
        run(_llamagen(world_overrides, gpt, out))
    assert (out / "samples.jsonl").read_text() == records and json.loads((out / "run.json").read_text()) == ident


def test_merge_refuses_shards_that_ran_on_different_files(world_overrides, llamagen_files, tmp_path):
    gpt = tmp_path / "gpt.pt"
    shutil.copy(llamagen_files["gpt"], gpt)
    run(_llamagen(world_overrides, gpt, tmp_path / "a", "shard.index=0", "shard.count=2"))
    _same_size_other_gpt(gpt)
    run(_llamagen(world_overrides, gpt, tmp_path / "b", "shard.index=1", "shard.count=2"))
    with pytest.raises(ValueError, match=r"another configuration than .* \(world\.gpt \(gpt\.pt\) has other content.*"
                                         r"same name and size.*only shards of one run can be merged"):
        merge(tmp_path / "a", sources=[tmp_path / "b"])
    assert not (tmp_path / "a" / "summary.json").exists()
