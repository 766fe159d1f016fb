"""The LlamaGen-XL target from local files (coolsd.worlds.llamagen), on tiny random-weight models
of the SAME classes written to disk in the official layouts by the test: the VQ-16 tokenizer,
the FLAN-T5 caption encoder with upstream's left padding, strict loaders, the LANTERN drafter
folder, the whole job through ``run.py``'s runner, and the stop-before-work error without files."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf, open_dict

from coolsd.engine.decoding.rng import PerSampleRNG
from coolsd.engine.decoding.rules import ExactRule
from coolsd.models.eagle.model import EagleDrafter
from coolsd.engine.drafting import ModelDrafter, SamplingConfig
from coolsd.engine.decoding.trees import make_tree
from coolsd.engine.loop import speculative_generate
from coolsd.models.llamagen import LlamaGenConfig, LlamaGenGPT, LlamaGenTarget
from coolsd.models.llamagen_vq import VQ_16, LlamaGenVQ, VQConfig, load_llamagen_vq
from coolsd.models.t5_text import T5CaptionEncoder, left_pad
from coolsd.models.eagle.model import load_eagle_head
from coolsd.models.llamagen import load_gpt
from coolsd.worlds.llamagen import LlamaGenWorld
from factories import CAPTIONS_FIXTURE, TINY_GPT, TINY_LLAMAGEN_VQ, compose as _compose, llamagen_overrides, llamagen_vq as _vq

ROOT = Path(__file__).resolve().parents[2]
TINY_VQ = VQConfig(**TINY_LLAMAGEN_VQ)


@pytest.fixture(scope="module")
def files(llamagen_files):
    return llamagen_files


# ------------------------------------------------------------------------------------------ VQ
def test_vq16_layout_matches_the_official_file():
    """Upstream's VQ_16 (vq_model.py): 72M parameters; key names as upstream builds them."""
    with torch.device("meta"):
        m = LlamaGenVQ(VQ_16)
    sd = m.state_dict()
    assert 71.5e6 < sum(p.numel() for p in m.parameters()) < 72.5e6
    expect = {"quantize.embedding.weight": (16384, 8), "quantize.codebook_used": (65536,),
              "quant_conv.weight": (8, 256, 1, 1), "post_quant_conv.weight": (256, 8, 1, 1),
              "encoder.conv_blocks.2.res.0.nin_shortcut.weight": (256, 128, 1, 1),
              "encoder.conv_blocks.3.downsample.conv.weight": (256, 256, 3, 3),
              "encoder.conv_blocks.4.attn.1.proj_out.weight": (512, 512, 1, 1),
              "encoder.mid.1.q.weight": (512, 512, 1, 1), "encoder.conv_out.weight": (256, 512, 3, 3),
              "decoder.conv_in.weight": (512, 256, 3, 3), "decoder.conv_blocks.0.attn.2.v.weight": (512, 512, 1, 1),
              "decoder.conv_blocks.1.res.0.nin_shortcut.weight": (256, 512, 1, 1),
              "decoder.conv_blocks.3.res.0.nin_shortcut.weight": (128, 256, 1, 1),
              "decoder.conv_blocks.3.upsample.conv.weight": (128, 128, 3, 3),
              "decoder.conv_blocks.4.res.2.conv2.weight": (128, 128, 3, 3), "decoder.conv_out.weight": (3, 128, 3, 3)}
    for k, shape in expect.items():
        assert tuple(sd[k].shape) == shape, k
    assert not any("upsample" in k for k in sd if k.startswith("decoder.conv_blocks.4."))
    assert not any("downsample" in k for k in sd if k.startswith("encoder.conv_blocks.4."))


def test_vq_strict_round_trip_decode_and_errors(tmp_path):
    src = _vq(0)
    torch.save({"model": src.state_dict()}, tmp_path / "vq.pt")
    m = load_llamagen_vq(tmp_path / "vq.pt", TINY_VQ)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    x = m.decode_code(tokens)
    assert x.shape == (2, 3, 8, 8) and torch.equal(x, src.decode_code(tokens))
    img = m.decode(tokens)
    assert img.min() >= 0 and img.max() <= 1 and torch.allclose(img, ((x + 1) / 2).clamp(0, 1))
    u8 = m.decode_uint8(tokens)
    assert u8.shape == (2, 8, 8, 3) and u8.dtype == np.uint8
    assert np.array_equal(u8, (127.5 * x + 128).clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy())
    # row-major latent grid: token j sits at (j // g, j % g) of the latent
    zq = torch.nn.functional.normalize(m.quantize.embedding.weight, dim=-1)[tokens[0]].reshape(4, 4, 4)
    assert torch.allclose(m.decoder(m.post_quant_conv(zq.permute(2, 0, 1)[None])), x[:1], atol=1e-5)
    codes = m.encode(x)
    assert codes.shape == (2, 16) and int(codes.max()) < 64
    sd = src.state_dict()
    for bad, pattern in [({k: v for k, v in sd.items() if k != "decoder.conv_out.bias"}, "missing keys: decoder.conv_out.bias"),
                         ({**sd, "discriminator.w": torch.zeros(1)}, "unexpected keys: discriminator.w"),
                         ({**sd, "quant_conv.weight": torch.zeros(5, 32, 1, 1)}, r"wrong shapes: quant_conv.weight \(5, 32, 1, 1\)")]:
        torch.save({"model": bad}, tmp_path / "bad.pt")
        with pytest.raises(ValueError, match=pattern):
            load_llamagen_vq(tmp_path / "bad.pt", TINY_VQ)
    with pytest.raises(FileNotFoundError, match=r"vq_ds16_t2i\.pt.*none\.pt.*peizesun/llamagen_t2i"):
        load_llamagen_vq(tmp_path / "none.pt", TINY_VQ)


# ------------------------------------------------------------------------------------------ T5
def test_left_pad_moves_valid_rows_to_the_end():
    e = torch.arange(2 * 5 * 1, dtype=torch.float).reshape(2, 5, 1)
    m = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    out, mask = left_pad(e, m)
    assert out[0, :, 0].tolist() == [3, 4, 0, 1, 2] and mask[0].tolist() == [False, False, True, True, True]
    assert torch.equal(out[1], e[1]) and mask[1].all()


def test_t5_encoder_cleans_tokenises_and_left_pads(files):
    from transformers import AutoTokenizer, T5EncoderModel

    enc = T5CaptionEncoder.from_folder(files["t5"], dtype=torch.float32, max_length=8)
    out = enc.encode(["A  RED cat sits on the mat.", "dog"])
    assert out["caption_embs"].shape == (2, 8, 16) and out["emb_mask"].dtype == torch.bool
    # cleaned: lower case, punctuation split off by the tokenizer's pre-tokenizer; + </s>
    tok = AutoTokenizer.from_pretrained(str(files["t5"]))
    model = T5EncoderModel.from_pretrained(str(files["t5"])).eval()
    for b, text, n in [(0, "a red cat sits on the mat.", 8), (1, "dog", 2)]:
        ids = tok([text], max_length=8, truncation=True, return_tensors="pt")["input_ids"]
        assert out["emb_mask"][b].sum() == n == ids.shape[1]
        assert not out["emb_mask"][b, : 8 - n].any()
        with torch.no_grad():
            direct = model(input_ids=ids).last_hidden_state[0]
        assert torch.allclose(out["caption_embs"][b, 8 - n:], direct, atol=1e-5)
    single = enc.encode(["dog"])
    assert torch.allclose(single["caption_embs"][0], out["caption_embs"][1], atol=1e-5)
    with pytest.raises(FileNotFoundError, match="FLAN-T5-XL folder not found.*google/flan-t5-xl"):
        T5CaptionEncoder.from_folder(files["t5"].parent / "nope")


# ------------------------------------------------------------------------------------------ GPT + drafter files
def test_gpt_and_drafter_load_strictly(files, tmp_path):
    gpt = load_gpt(files["gpt"], LlamaGenConfig(**TINY_GPT), dtype=torch.float32)
    for k, v in files["model"].state_dict().items():
        assert torch.equal(v, gpt.state_dict()[k])
    with pytest.raises(ValueError, match=r"wrong shapes: .*\(expected"):
        load_gpt(files["gpt"], LlamaGenConfig(**{**TINY_GPT, "dim": 64}))
    with pytest.raises(ValueError, match="missing keys: layers.2"):
        load_gpt(files["gpt"], LlamaGenConfig(**{**TINY_GPT, "n_layer": 3}))
    head = load_eagle_head(files["drafter"], gpt)
    assert head.config.block_size == 16 and not head.embed_tokens.weight.requires_grad
    other = LlamaGenGPT(LlamaGenConfig(**{**TINY_GPT, "vocab_size": 128}))
    with pytest.raises(ValueError, match="drafter .* is for hidden 32, vocab 64"):
        load_eagle_head(files["drafter"], other)
    with pytest.raises(FileNotFoundError, match="needs config.json and pytorch_model.bin.*jadohu/llamagen_drafter"):
        load_eagle_head(tmp_path, gpt)


def test_lantern_drafter_with_text_prefix_keeps_greedy_exact(files):
    """The adapter's drafter wiring (all text-slot features prefilled into LANTERN's head):
    greedy speculative decoding equals greedy AR."""
    gpt = load_gpt(files["gpt"], LlamaGenConfig(**TINY_GPT), dtype=torch.float64)
    head = load_eagle_head(files["drafter"], gpt)
    enc = T5CaptionEncoder.from_folder(files["t5"], dtype=torch.float64, max_length=8)
    cond = enc.encode(["a red cat", "the dog sits on the mat"])
    sampling = SamplingConfig(temperature=0.0)
    target = LlamaGenTarget(gpt, cfg_scale=3.0, prefill_features="all")
    plain = speculative_generate(LlamaGenTarget(gpt, cfg_scale=3.0), 16, PerSampleRNG([0, 1]), cond=cond,
                                 batch_size=2, sampling=sampling)
    drafter = EagleDrafter.for_target(head, target, text_prefix=True)
    spec = speculative_generate(target, 16, PerSampleRNG([0, 1]), rule=ExactRule(), drafter=ModelDrafter(drafter, sampling),
                                tree=make_tree("mc_sim_7b_63"), cond=cond, batch_size=2, sampling=sampling)
    assert torch.equal(plain.tokens, spec.tokens)
    out = target.begin(cond, 2)
    assert out.logits.shape[1] == 1 and out.hidden.shape[:3] == (2, 8, 2)  # every slot, both CFG halves


# ------------------------------------------------------------------------------------------ the job
def test_run_py_job_on_tiny_llamagen_files(files, tmp_path):
    from coolsd.cli.runner import run

    cfg = _compose("target=llamagen_xl", "method=coolsd", "dataset.n_prompts=3", f"+out_dir={tmp_path / 'run'}",
                   f"target.files.gpt={files['gpt']}", f"target.files.vq={files['vq']}", f"target.files.t5={files['t5']}",
                   f"draft.path={files['drafter']}", "target.device=cpu", "target.dtype=float32", "target.t5_dtype=float32")
    with open_dict(cfg):
        cfg.target.gpt_config = TINY_GPT
        cfg.target.vq_config = OmegaConf.create({**TINY_VQ.__dict__, "ch_mult": list(TINY_VQ.ch_mult)})
    summary = run(cfg)
    res = summary["results"]
    assert set(res) == {"ar", "coolsd"} and res["ar"]["accepted_length"]["mean"] == 1.0
    assert res["coolsd"]["accepted_length"]["mean"] > 1.0 and "speedup" in res["coolsd"]
    recs = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(recs) == 6 and all((tmp_path / "run" / r["image"]).is_file() for r in recs)
    assert (tmp_path / "run" / "grid.png").is_file()
    again = run(cfg)  # a finished run resumes with nothing to do and the same records
    assert again["results"]["coolsd"]["accepted_length"] == res["coolsd"]["accepted_length"]


def test_run_py_without_weights_stops_at_once_listing_missing_files(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMAGEN_GPT", "LLAMAGEN_VQ", "FLAN_T5_XL", "LLAMAGEN_DRAFTER")}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), "target=llamagen_xl", "method=eagle",
                           f"hydra.run.dir={tmp_path / 'out'}"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode != 0 and time.perf_counter() - t0 < 60
    err = proc.stderr
    for name, source in [("gpt", "peizesun/llamagen_t2i"), ("vq", "vq_ds16_t2i.pt"), ("t5", "google/flan-t5-xl"),
                         ("drafter", "jadohu/llamagen_drafter")]:  # the defaults are hub ids, not in the (empty) cache
        assert f"{name}: hf://" in err and source in err, (name, err[-2000:])
    assert "is not in the Hugging Face cache" in err and "python -m coolsd.cli.download target=llamagen_xl" in err
    assert not (tmp_path / "out" / "samples.jsonl").exists()
    cfg = _compose("target=llamagen_xl", "draft=self", "target.files.gpt=/nowhere/gpt.pt")
    missing = LlamaGenWorld.missing_files(cfg)
    assert any("gpt: /nowhere/gpt.pt does not exist" in m for m in missing) and not any("drafter" in m for m in missing)


# ------------------------------------------------------------------------------------------ make paper-table2
def test_paper_table2_on_a_real_target_runs_rows_and_metrics(files, tmp_path):
    """The real-target path of make paper-table2 on tiny LlamaGen files: every Table 2 row runs
    (the tree and rows of experiments/experiment/table2_llamagen_xl.yaml), AR pairs the
    speed-ups, metrics come from the records and PNGs, and the table compares with the paper."""
    from coolsd.report.real_sweep import real_table2_sweep
    from coolsd.report.table2 import build_table, write_tables

    from factories import tiny_metric_scorers

    scorers = tiny_metric_scorers(tmp_path)
    res = real_table2_sweep("llamagen_xl", 2, tmp_path / "records", scorers,
                            [*llamagen_overrides(files), f"dataset.captions={CAPTIONS_FIXTURE}"])
    table = res["table"]
    assert list(table) == ["ar", "eagle", "lantern_pp_2_10", "coolsd_1.1", "coolsd_2"]
    assert table["ar"]["speedup"]["mean"] == 1.0 and table["coolsd_2"]["accepted_length"]["mean"] > 1.0
    for tag, e in table.items():
        assert {"clip_score", "fid", "latency_s"} <= set(e), tag
        run = Path(res["runs"][tag])
        assert json.loads((run / "run.json").read_text())["methods"].keys() == {e["params"]["method"]}  # AR is its own row
    cfg = json.loads((Path(res["runs"]["eagle"]) / "run.json").read_text())
    assert cfg["dataset"]["name"] == "coco2017val" and "naive_extend_57" in json.dumps(cfg["methods"])
    df = build_table("llamagen_xl", table)
    write_tables(df, tmp_path)
    md = (tmp_path / "table2.md").read_text()
    assert "| llamagen_xl | COOL-SD delta=2 |" in md and "3.34 (" in md  # paper value with our difference


def test_paper_table2_real_target_lists_everything_missing_before_work(tmp_path, monkeypatch):
    from coolsd.report.table2 import main

    for v in ("LLAMAGEN_GPT", "LLAMAGEN_VQ", "FLAN_T5_XL", "LLAMAGEN_DRAFTER", "COCO_CAPTIONS", "CLIP_DIR",
              "COCO_VAL_IMAGES", "INCEPTION_WEIGHTS"):
        monkeypatch.delenv(v, raising=False)
    with pytest.raises(SystemExit) as e:
        main(["--targets", "llamagen_xl", "--records", str(tmp_path / "rec"), "--inception", str(tmp_path / "no.pth")])
    msg = str(e.value)
    for part in ("gpt: hf://", "drafter: hf://", "COCO captions", "CLIP model folder", "Inception weights",
                 "COCO val2017 images", "jadohu/llamagen_drafter"):
        assert part in msg, part
    assert not (tmp_path / "rec").exists()
