"""``target=harmon_1_5b`` on tiny files (and the world contract: ``TestHarmonContract``): text
prompts through the tokenizer file with upstream's template, the tokenizer's null prompt on both models,
the run's grid on draft and target, and one-line refusals of a bad tokenizer file or architecture."""
import pytest
import torch

from coolsd.models.harmon import encode_prompts, null_prompt_ids
from coolsd.prompts import load_prompts
from coolsd.util.loading import BadInputFile
from coolsd.worlds import load_world
import factories
from target_contract import TargetContract


@pytest.fixture
def harmon_cfg(compose, world_overrides):
    def make(*extra):
        return compose(*world_overrides("harmon_1_5b"), "method=cspd", "dataset.n_prompts=3", *extra)

    return make


def test_text_prompts_and_the_null_prompt_come_from_the_tokenizer_file(harmon_cfg):
    cfg = harmon_cfg()
    world = load_world(cfg)
    prompts = load_prompts(cfg.dataset)
    ids = world.labels(prompts)
    assert torch.equal(ids, encode_prompts(world.tokenizer, [p.caption for p in prompts]))
    lengths = (ids >= 0).sum(1)
    assert len(set(lengths.tolist())) > 1  # ragged prompts: the batch-invariance rule of the LLM is exercised
    unk = world.tokenizer.token_to_id("<unk>")
    assert not (ids == unk).any()  # every caption word is in the tiny vocabulary (so ids carry the captions)
    want_null = null_prompt_ids(world.tokenizer)
    assert world.draft is not world.target
    for m in (world.target, world.draft):
        assert torch.equal(m.null_prompt, want_null)
    assert set(world.files()) == {"checkpoint", "vae", "draft", "tokenizer"}


def test_the_run_grid_is_the_drafts_too(harmon_cfg):
    world = load_world(harmon_cfg("target.grid=2"))
    assert world.target.config.grid == world.draft.config.grid == 2 and world.side == 2


def test_a_bad_tokenizer_file_is_one_line_naming_it(harmon_cfg, tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(BadInputFile) as e:
        load_world(harmon_cfg(f"target.files.tokenizer={bad}"))
    assert str(bad) in str(e.value) and "\n" not in str(e.value) and "tokenizer.json" in str(e.value)


@pytest.mark.parametrize("arch, match", [("harmon_7b", "not a released architecture"),
                                         ("{llm:{hidden_size:32},mar:{seq_len:16},extra:1}", "keys llm, mar"),
                                         ("{llm:{hidden:32},mar:{seq_len:16}}", "target.arch")])
def test_bad_architectures_are_refused_before_loading(harmon_cfg, arch, match):
    with pytest.raises(ValueError, match=match):
        load_world(harmon_cfg(f"target.arch={arch}"))


def test_a_ddim_head_runs_on_harmon_through_run_py(compose, world_overrides, tmp_path):
    """``run.py target=harmon_1_5b method=cspd method.sampler=ddim method.head_steps=4``: the records
    carry the sampler (the baseline shares it) and the target drafting for itself (exact, prefix)
    accepts every token and reproduces the baseline's images bit for bit; on Harmon's DiffLoss head,
    DDIM's tokens differ from DDPM's at the same seeds (tokens: a tiny random VAE may saturate pixels)."""
    import json

    import numpy as np
    from PIL import Image

    from coolsd.cli.runner import run
    from coolsd.engine.methods import build_method

    tiny = [o for o in world_overrides("harmon_1_5b") if not o.startswith("draft")]  # the target drafts
    out = tmp_path / "run"
    summary = run(compose(*tiny, "method=cspd", "dataset.n_prompts=2", "draft=self", "method.gamma=3",
                          "method.mode=exact", "method.verify=prefix", "method.sampler=ddim", "method.head_steps=4",
                          "deterministic.batch_invariant=true", f"+out_dir={out}"))
    recs = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted(r["method"] for r in recs) == ["ar", "ar", "cspd", "cspd"]
    assert all(r["params"]["sampler"] == "ddim" and r["params"]["head_steps"] == 4 for r in recs)
    assert summary["results"]["cspd"]["acceptance_rate"]["mean"] == 1.0
    img = {(r["method"], r["prompt_index"]): np.asarray(Image.open(out / r["image"])) for r in recs}
    assert all(np.array_equal(img["cspd", i], img["ar", i]) for i in (0, 1))

    cfg = compose(*tiny, "method=ar", "dataset.n_prompts=2", "draft=self")
    world = load_world(cfg)
    labels = world.labels(load_prompts(cfg.dataset))
    tokens = {s: build_method("ar", family="continuous", sampler=s, head_steps=4).generate(
        world.target, None, labels, [0, 1], world.head).tokens for s in ("ddim", "ddpm")}
    assert not torch.allclose(tokens["ddim"], tokens["ddpm"])


class TestHarmonContract(TargetContract):
    """The world contract (tests/target_contract.py) on tiny Harmon files: target and draft
    checkpoints, kl16.ckpt and the tokenizer."""

    runs = {"harmon_1_5b": ["method=cspd", "method.gamma=3", "method.mode=exact", "method.verify=prefix"]}
    files_fixture = "harmon_files"
    files = staticmethod(factories.write_harmon_files)
    overrides = staticmethod(factories.harmon_overrides)
