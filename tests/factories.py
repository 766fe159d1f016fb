"""Tiny components of the real classes, from one factory for every test (the diffusers pattern):
random-weight files in the official layouts for every registered real world, tiny toy
continuous weights, the engine-level tiny LlamaGen, and the Hydra overrides that point a world
at its tiny files (``world_overrides``). conftest.py turns them into fixtures."""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CAPTIONS_FIXTURE = ROOT / "tests" / "fixtures" / "captions_val2017_tiny.json"


def compose(*overrides):
    """The job config ``run.py`` would get for these overrides."""
    from coolsd.runner import compose as hydra_compose

    return hydra_compose(*overrides)


def _braced(d: dict) -> str:
    """A mapping as a Hydra override value: {k:v,...} (lists as [a,b])."""
    return "{" + ",".join(f"{k}:{json.dumps(list(v) if isinstance(v, tuple) else v)}" for k, v in d.items()) + "}"


# ------------------------------------------------------------------------------ engine-level LlamaGen
def engine_model(seed: int, dim: int = 64, n_layer: int = 2):
    """A tiny float64 LlamaGen GPT with large weights (peaked distributions)."""
    from coolsd.models.llamagen import LlamaGenGPT, tiny

    torch.manual_seed(seed)
    return LlamaGenGPT(tiny(dim=dim, n_layer=n_layer), init_std=0.2).double().eval()


def engine_cond(valid: list[int]) -> dict:
    """Left-padded random caption embeddings with ``valid[b]`` valid text slots per sample."""
    from coolsd.models.llamagen import tiny

    cfg = tiny()
    g = torch.Generator().manual_seed(sum(valid))
    mask = torch.zeros(len(valid), cfg.cls_token_num, dtype=torch.bool)
    for b, n in enumerate(valid):
        mask[b, cfg.cls_token_num - n :] = True
    return {"caption_embs": torch.randn(len(valid), cfg.cls_token_num, cfg.caption_dim, generator=g,
                                        dtype=torch.float64), "emb_mask": mask}


# ------------------------------------------------------------------------------ LlamaGen files
TINY_GPT = dict(dim=32, n_layer=2, n_head=2, vocab_size=64, cls_token_num=8, caption_dim=16, block_size=16,
                multiple_of=16)
TINY_LLAMAGEN_VQ = dict(codebook_size=64, codebook_dim=4, ch=32, ch_mult=(1, 2), z_channels=32, num_res_blocks=1,
                        usage_buffer=16)
WORDS = ["a", "red", "cat", "dog", "on", "the", "mat", "sits"]


def llamagen_vq(seed: int = 0):
    from coolsd.models.llamagen_vq import LlamaGenVQ, VQConfig

    torch.manual_seed(seed)
    m = LlamaGenVQ(VQConfig(**TINY_LLAMAGEN_VQ))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m.eval()


def write_t5(d: Path, d_model: int = 16) -> Path:
    """A tiny FLAN-T5 folder (tokenizer + encoder) in from_pretrained layout."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>").save_pretrained(d)
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=len(vocab), d_model=d_model, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    T5EncoderModel(cfg).eval().save_pretrained(d)
    return d


def write_llamagen_files(d: Path) -> dict:
    """Every file of a tiny LlamaGen target (GPT, VQ, T5 folder, LANTERN drafter folder)."""
    from coolsd.drafters.eagle import EagleHead
    from coolsd.models.llamagen import LlamaGenConfig, LlamaGenGPT

    torch.manual_seed(1)
    gpt = LlamaGenGPT(LlamaGenConfig(**TINY_GPT), init_std=0.2).eval()
    torch.save({"model": gpt.state_dict(), "steps": 7}, d / "gpt.pt")
    torch.save({"model": llamagen_vq().state_dict()}, d / "vq.pt")
    write_t5(d / "t5")
    head = EagleHead.from_target(gpt, seed=3)
    (d / "drafter").mkdir()
    (d / "drafter" / "config.json").write_text(json.dumps(head.config.to_lantern_json()))
    torch.save(head.state_dict(), d / "drafter" / "pytorch_model.bin")
    return {"gpt": d / "gpt.pt", "vq": d / "vq.pt", "t5": d / "t5", "drafter": d / "drafter", "model": gpt}


def llamagen_overrides(files: dict) -> list[str]:
    return [f"target.files.gpt={files['gpt']}", f"target.files.vq={files['vq']}", f"target.files.t5={files['t5']}",
            f"draft.path={files['drafter']}", "target.device=cpu", "target.dtype=float32", "target.t5_dtype=float32",
            f"target.gpt_config={_braced(TINY_GPT)}",
            f"+target.vq_config={_braced(TINY_LLAMAGEN_VQ)}"]


# ------------------------------------------------------------------------------ Lumina-mGPT files
def lumina_cfg():
    from coolsd.models.chameleon import tiny

    return tiny()  # hidden 32, 2 layers, 4 heads (head_dim 8), intermediate 64, vocab 64


def lumina_vq_cfg():
    from coolsd.models.chameleon_vq import tiny_vq

    return tiny_vq()  # 16 codes x 8 dims, ch 32, ch_mult (1, 1, 2): f = 4


LUMINA_LATENT = 4  # 4 x 4 latent grid: 16 image tokens
N_CODES = 16


def make_lm(seed: int = 0, cfg=None):
    """A float64 Chameleon LM with random weights and non-trivial norms (per-head q/k norm
    weights and biases differ)."""
    from coolsd.models.chameleon import ChameleonLM

    torch.manual_seed(seed)
    model = ChameleonLM(cfg or lumina_cfg(), init_std=0.3).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("norm.bias"):
                p.copy_(0.2 * torch.randn_like(p))
    return model.eval()


def official_state_dict(model) -> dict:
    """The model's weights in Lumina's checkpoint layout: q/k norms as [1, head_dim] (the
    model_parallel_size = 1 form), so every head shares head 0's affine, plus the VQ-encoder
    tensors HF Chameleon checkpoints carry under ``model.vqmodel.``."""
    sd = {}
    for k, v in model.state_dict().items():
        if "_norm." in k and ".self_attn." in k:
            v = v[:1].clone()
        sd[k] = v.clone()
    sd["model.vqmodel.quantize.embedding.weight"] = torch.randn(16, 4, dtype=torch.float64)
    sd["model.vqmodel.encoder.conv_in.weight"] = torch.randn(8, 3, 3, 3, dtype=torch.float64)
    return sd


def make_vq(seed: int = 0):
    from coolsd.models.chameleon_vq import ChameleonVQ

    torch.manual_seed(seed)
    vq = ChameleonVQ(lumina_vq_cfg()).double()
    with torch.no_grad():
        for name, p in vq.named_parameters():
            if "norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (2.0 / p[0].numel()) ** 0.5)
        vq.quantize.embedding.weight.normal_()
    return vq.eval()


def vqgan_ckpt_dict(vq) -> dict:
    """vqgan.ckpt's layout: {"state_dict": decoder side + encoder side (+ a loss module)}."""
    sd = {k: v.clone() for k, v in vq.state_dict().items()}
    sd["encoder.conv_in.weight"] = torch.randn(32, 3, 3, 3, dtype=torch.float64)
    sd["encoder.conv_out.bias"] = torch.randn(8, dtype=torch.float64)
    sd["quant_conv.weight"] = torch.randn(8, 8, 1, 1, dtype=torch.float64)
    sd["loss.discriminator.main.0.weight"] = torch.randn(4, 3, 4, 4, dtype=torch.float64)
    return {"state_dict": sd}


def code_name(code: int) -> str:
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(code)) + "Z"


def synthetic_vocabulary_map() -> dict:
    """A Chameleon-style vocabulary_map on the tiny vocab: image names for 16 codes on shuffled
    BPE ids 4..19 (id != code + 4), structural tokens at Lumina's ids, text elsewhere."""
    perm = torch.randperm(N_CODES, generator=torch.Generator().manual_seed(7)).tolist()
    vmap = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    vmap.update({code_name(c): 4 + perm[c] for c in range(N_CODES)})
    vmap.update({"<eoss>": 20, "<racm3:break>": 21, "<reserved08799>": 22, "<reserved08800>": 23,
                 "<reserved08801>": 24, "<reserved08802>": 25, "<reserved08706>": 26, "<image>": 27})
    vmap.update({f"w{i}": i for i in range(28, 64)})
    return vmap


VMAP = synthetic_vocabulary_map()


def write_text_tokenizer(path: Path) -> Path:
    """A Chameleon-style text_tokenizer.json over the tiny vocabulary (words of WORDS and the toy
    captions map to <unk> except a few)."""
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


def write_lumina_files(d: Path) -> dict:
    """A tiny Lumina-mGPT folder (config.json with the vocabulary map + safetensors), vqgan.ckpt
    and text_tokenizer.json."""
    from safetensors.torch import save_file

    cfg = lumina_cfg()
    (d / "model").mkdir()
    official = official_state_dict(make_lm(seed=2))
    save_file({k: v.contiguous() for k, v in official.items()}, str(d / "model" / "model.safetensors"))
    (d / "model" / "config.json").write_text(json.dumps({
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads, "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size, "vocabulary_map": VMAP}))
    torch.save(vqgan_ckpt_dict(make_vq(seed=1)), d / "vqgan.ckpt")
    return {"model": d / "model", "vqgan": d / "vqgan.ckpt", "text_tokenizer": write_text_tokenizer(d / "text_tokenizer.json"),
            "drafter": write_lumina_drafter(d / "drafter")}


def write_lumina_drafter(d: Path, seed: int = 0) -> Path:
    """A random-weight LANTERN-layout EAGLE drafter folder for the tiny Lumina model (its embedding;
    config.json + model.safetensors, as ``coolsd.drafters.eagle_lumina.save_lumina_drafter``)."""
    from coolsd.drafters.eagle_lumina import LuminaEagleHead, save_lumina_drafter

    return save_lumina_drafter(LuminaEagleHead.from_target(make_lm(seed=2), seed=seed), d, {"steps": 0})


def lumina_overrides(files: dict) -> list[str]:
    """The tiny Lumina files as ``target.files.*`` and the tiny drafter as ``draft.path``."""
    vq = lumina_vq_cfg()
    return ["target.device=cpu", "target.dtype=float32", f"target.image_size={LUMINA_LATENT * vq.downsample}",
            *[f"target.files.{k}={v}" for k, v in files.items() if k != "drafter"],
            *([f"draft.path={files['drafter']}"] if "drafter" in files else []),
            f"+target.vq_config={_braced(vq.__dict__)}"]


# ------------------------------------------------------------------------------ MAR files
TINY_MAR = dict(seq_len=16, token_dim=4, encoder_dim=16, encoder_depth=1, encoder_heads=2, decoder_dim=16,
                decoder_depth=1, decoder_heads=2, buffer_size=2, n_classes=10, head_width=16, head_depth=1)
TINY_VAE = dict(embed_dim=4, z_channels=4, ch=32, ch_mult=[1, 2], num_res_blocks=1, resolution=8, attn_resolutions=[4])


def write_mar_files(d: Path) -> dict:
    """Target and draft ``checkpoint-last.pth`` (model + model_ema + argparse args) and kl16.ckpt."""
    from coolsd.models.kl16_vae import KLVAE, KLVAEConfig
    from coolsd.models.mar import MAR, MARConfig

    torch.manual_seed(0)
    paths = {}
    for name in ("target", "draft"):
        m = MAR(MARConfig(**TINY_MAR))
        paths[name] = d / f"{name}.pth"
        torch.save({"model": m.state_dict(), "model_ema": m.state_dict(), "epoch": 1,
                    "args": argparse.Namespace(model="tiny")}, paths[name])
    vae = KLVAE(KLVAEConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in TINY_VAE.items()}))
    paths["vae"] = d / "kl16.ckpt"
    torch.save({"model": vae.state_dict()}, paths["vae"])
    return paths


def mar_overrides(files: dict) -> list[str]:
    arch = _braced(TINY_MAR)
    return ["dataset=imagenet", "target.device=cpu", f"target.arch={arch}", f"draft.arch={arch}",
            f"+target.vae={_braced(TINY_VAE)}", "target.head.steps=3", f"target.files.checkpoint={files['target']}",
            f"target.files.vae={files['vae']}", f"draft.files.checkpoint={files['draft']}"]


# ------------------------------------------------------------------------------ toy continuous weights
def build_tiny_toy_continuous(d: Path) -> Path:
    """Toy continuous weight files trained for 2 steps (the shipped ones: make toy-continuous-assets)."""
    from coolsd.toy.continuous import TOY_DRAFT, TOY_TARGET, build

    tiny = {name: dataclasses.replace(cfg, encoder_dim=16, decoder_dim=16, encoder_depth=1, decoder_depth=1,
                                      encoder_heads=2, decoder_heads=2, head_width=16, head_depth=1)
            for name, cfg in (("target", TOY_TARGET), ("draft", TOY_DRAFT))}
    build(d, n_images=64, steps={"target": 2, "draft": 2}, log=lambda *_: None, configs=tiny)
    return d


def toy_continuous_overrides(assets: Path) -> list[str]:
    return [f"target.assets={assets}", "target.head.steps=4"]


def tiny_metric_scorers(tmp_path: Path) -> dict:
    """``evaluate_run`` keyword arguments for a real-target report on tiny files: a tiny random
    CLIP, moment features instead of Inception, reference statistics of three random COCO-named
    JPEGs (numbers meaningless; the reports' layout is what such tests check)."""
    import numpy as np
    from PIL import Image

    from coolsd.metrics.clip_score import ClipScorer
    from coolsd.metrics.reference import reference_statistics
    from tiny_models import MomentFeatures, write_tiny_clip

    coco = tmp_path / "val2017"
    coco.mkdir()
    r = np.random.default_rng(0)
    for i in (1, 2, 3):
        Image.fromarray(r.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(coco / f"{i:012d}.jpg")
    feats = MomentFeatures()
    (tmp_path / "clip").mkdir()
    return {"clip": ClipScorer.from_pretrained(write_tiny_clip(tmp_path / "clip")), "inception": feats,
            "reference": reference_statistics(sorted(coco.glob("*.jpg")), feats, tmp_path / "cache", "w"),
            "fid_resamples": 5}
