"""Lumina-mGPT through run.py's runner (coolsd.targets.lumina) on tiny files in the official
layouts: prompt ids from a Chameleon-style text tokenizer, the whole job with self-drafting, and
the stop-before-work error listing every missing file."""
import json

import pytest
import torch
from omegaconf import OmegaConf, open_dict

from coolsd.runner import run
from coolsd.targets.lumina import TextPrompts
from test_lumina import CFG, HL, VMAP, VQ_CFG, code_name, make_lm, make_vq, official_state_dict, vqgan_ckpt_dict
from test_llamagen_target import _compose


def write_text_tokenizer(path):
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = {"red": 28, "circle": 29, "a": 30}
    vocab = {k: v for k, v in VMAP.items() if not k.startswith("IMGIMG") and v not in words.values()}
    vocab.update(words)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<reserved08706>", special=True)])  # one id even inside text
    assert tok.token_to_id("<reserved08706>") == 26
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("lumina")
    (d / "model").mkdir()
    official = official_state_dict(make_lm(seed=2))
    save_file({k: v.contiguous() for k, v in official.items()}, str(d / "model" / "model.safetensors"))
    (d / "model" / "config.json").write_text(json.dumps({
        "hidden_size": CFG.hidden_size, "num_hidden_layers": CFG.num_layers, "num_attention_heads": CFG.num_heads,
        "num_key_value_heads": CFG.num_heads, "intermediate_size": CFG.intermediate_size,
        "vocab_size": CFG.vocab_size, "vocabulary_map": VMAP}))
    torch.save(vqgan_ckpt_dict(make_vq(seed=1)), d / "vqgan.ckpt")
    return {"model": d / "model", "vqgan": d / "vqgan.ckpt", "text_tokenizer": write_text_tokenizer(d / "text_tokenizer.json")}


def test_prompt_ids_are_bos_template_and_separator(files):
    from tokenizers import Tokenizer

    enc = TextPrompts(Tokenizer.from_file(str(files["text_tokenizer"])), 768, 768)
    ids = enc.encode(["a red circle", "red"])
    assert ids[0][0] == 0 and ids[0][-1] == 26 and ids[0][-4:-1] == [30, 28, 29]
    assert ids[1][-2:] == [28, 26] and len(ids[0]) == len(ids[1]) + 2
    assert code_name(12) == "IMGIMGBCZ"


def _cfg(files, tmp_path, *extra):
    cfg = _compose("target=lumina_mgpt", "dataset.n_prompts=2", f"+out_dir={tmp_path / 'run'}",
                   "target.device=cpu", "target.dtype=float32", f"target.image_size={HL * VQ_CFG.downsample}",
                   *[f"target.files.{k}={v}" for k, v in files.items()], *extra)
    with open_dict(cfg):
        cfg.target.vq_config = OmegaConf.create({**VQ_CFG.__dict__, "ch_mult": list(VQ_CFG.ch_mult),
                                                 "attn_resolutions": list(VQ_CFG.attn_resolutions)})
    return cfg


def test_run_py_job_on_tiny_lumina_files_with_self_drafting(files, tmp_path):
    summary = run(_cfg(files, tmp_path, "method=eagle", "tree=chain", "tree.draft_length=3"))
    res = summary["results"]
    assert set(res) == {"ar", "eagle"} and res["ar"]["accepted_length"]["mean"] == 1.0
    assert res["eagle"]["accepted_length"]["mean"] > 3.0  # the target drafting for itself: all accepted
    recs = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(recs) == 4 and all(r["target_forwards"] >= 1 for r in recs)
    assert (tmp_path / "run" / recs[0]["image"]).is_file() and summary["target"] == "lumina_mgpt"


def test_missing_lumina_files_are_listed_before_work(tmp_path):
    cfg = _compose("target=lumina_mgpt", "target.files.model=null", "target.files.vqgan=null",
                   "target.files.text_tokenizer=null", f"+out_dir={tmp_path / 'run'}")
    with pytest.raises(FileNotFoundError) as e:
        run(cfg)
    msg = str(e.value)
    for name, source in [("model", "Alpha-VLLM/Lumina-mGPT-7B-768"), ("vqgan", "vqgan.ckpt"),
                         ("text_tokenizer", "text_tokenizer.json")]:
        assert f"{name}: not set" in msg and source in msg
    assert not (tmp_path / "run").exists()
    with pytest.raises(FileNotFoundError, match="no EAGLE head for Lumina-mGPT"):
        run(_compose("target=lumina_mgpt", "draft=llamagen_xl", f"+out_dir={tmp_path / 'run'}"))
