"""``hf://`` values (``coolsd.util.hub``): parsed into repo, revision and path; resolved through the
real ``huggingface_hub`` from a cache in the hub's own layout (refs, snapshots, blobs) without the
network; a malformed or uncached value is one line naming it."""
import pytest

from coolsd.util import hub
from coolsd.worlds.files import Need

from factories import write_hub_repo


def test_parse():
    assert hub.parse("/a/local/path") is None and hub.parse(None) is None
    assert hub.parse("hf://org/repo") == hub.HubFile("org/repo", None, "")
    assert hub.parse("hf://org/repo/sub/f.pt") == hub.HubFile("org/repo", None, "sub/f.pt")
    assert hub.parse("hf://org/repo@v1.0/f.pt") == hub.HubFile("org/repo", "v1.0", "f.pt")
    assert str(hub.parse("hf://org/repo@abc/sub/f.pt")) == "hf://org/repo@abc/sub/f.pt"
    for bad in ("hf://org", "hf://", "hf://org/repo@/f.pt", "hf://org@x/repo"):
        with pytest.raises(ValueError, match=r"is not a hub id: expected hf://org/repo\[@revision\]\[/path\]"):
            hub.parse(bad)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f.pt").write_bytes(b"weights")
    (tmp_path / "src" / "folder").mkdir()
    (tmp_path / "src" / "folder" / "config.json").write_text("{}")
    snap = write_hub_repo(tmp_path / "hub", "org/repo", {"f.pt": tmp_path / "src" / "f.pt",
                                                        "sub": tmp_path / "src" / "folder"}, commit="a" * 40)
    (tmp_path / "hub" / "models--org--repo" / "refs" / "v1").write_text("a" * 40)
    return snap


def test_local_path_reads_the_cache_only(cache):
    ref = hub.parse("hf://org/repo/f.pt")
    assert hub.local_path(ref, folder=False) == cache / "f.pt" and (cache / "f.pt").read_bytes() == b"weights"
    assert hub.local_path(hub.parse("hf://org/repo@v1/f.pt"), folder=False) == cache / "f.pt"  # a tag's ref
    assert hub.local_path(hub.parse(f"hf://org/repo@{'a' * 40}/f.pt"), folder=False) == cache / "f.pt"  # a commit
    assert hub.local_path(hub.parse("hf://org/repo/sub"), folder=True) == cache / "sub"  # found by its config.json
    assert hub.local_path(hub.parse("hf://org/repo/sub"), folder=None) == cache / "sub"
    assert hub.local_path(hub.parse("hf://org/repo"), folder=True, probe=()) == cache  # the revision's snapshot
    for missing in ("hf://org/repo/nope.pt", "hf://org/other/f.pt", "hf://org/repo@v2/f.pt"):
        assert hub.local_path(hub.parse(missing), folder=False) is None, missing
    assert hub.snapshot_repo_name(cache) == "repo" and hub.snapshot_repo_name(cache / "sub") is None


def test_need_lines_name_the_hub_id_and_the_download(cache):
    ok = Need("model", "target.files.model", "hf://org/repo/sub", "src", "MODEL", True, ("config.json",))
    assert ok.problem() is None and ok.local() == cache / "sub"
    lacking = ok._replace(contains=("config.json", "weights.bin"))
    assert lacking.problem("python -m coolsd.cli.download target=x") == (
        "model: hf://org/repo/sub lacks weights.bin (run `python -m coolsd.cli.download target=x` (or set "
        "target.files.model=/path or $MODEL)) -- src")
    absent = ok._replace(path="hf://org/repo/other")
    assert absent.problem("DL") == (f"model: hf://org/repo/other is not in the Hugging Face cache {cache.parents[2]}: "
                                    "run `DL` (or set target.files.model=/path or $MODEL) -- src")
    assert ok._replace(path="hf://org").problem() == (
        "model: hf://org is not a hub id: expected hf://org/repo[@revision][/path] "
        "(set target.files.model=/path or $MODEL)")
