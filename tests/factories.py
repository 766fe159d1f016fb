"""Tiny components of the real classes, from one factory for every test (the diffusers pattern):
random-weight files in the official layouts for every registered real world, tiny toy
continuous weights, the in-memory tiny models of the model tests (LlamaGen GPT and both its
variants, Chameleon LM and VQGAN, MAR and its DiffLoss head, xAR, Harmon, and transformers' own
Janus-Pro and Emu3-Gen classes in miniature) and their random inputs, the tiny metric networks
(CLIP, Inception-v3, moment features; ``tiny_models`` re-exports them), and the Hydra overrides
that point a world at its tiny files. Each target's test module declares which files and overrides
its world runs on (``target_contract.TargetContract``), and conftest.py turns the declarations into
fixtures (``world_overrides``, ``<family>_files``). Each tiny component is built here only: a test
that needs one imports it; one only its own target's module needs may stay in that module."""
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
    from coolsd.cli.runner import compose as hydra_compose

    return hydra_compose(*overrides)


def _braced(d: dict) -> str:
    """A mapping as a Hydra override value: {k:v,...} (lists as [a,b])."""
    return "{" + ",".join(f"{k}:{json.dumps(list(v) if isinstance(v, tuple) else v)}" for k, v in d.items()) + "}"


# ------------------------------------------------------------------------------ random inputs
def emitted_tokens(res, L: int, N: int):
    """(sample b, token t, its depth j in its round (1 = the first), the round's max depth, the
    prefix before t) of every token a loop result emitted (chain rounds of at most ``L`` drafts,
    ``N`` tokens a sample): where the per-token signals of ``res`` are checked token by token."""
    for b in range(res.tokens.shape[0]):
        toks, t = res.tokens[b].tolist(), 0
        for n_new in res.round_lengths[b]:
            max_depth = min(L, N - t)
            for j in range(1, n_new + 1):
                yield b, t, j, max_depth, toks[:t]
                t += 1
        assert t == N


def random_ids(*shape: int, high: int, seed: int = 2) -> torch.Tensor:
    """Token ids uniform in [0, high), of ``shape``, from their own generator (not the global one)."""
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------ in-memory LlamaGen
def llamagen_gpt(seed: int = 0, dtype=torch.float64, init_std: float = 0.15, norm_noise: float = 0.2,
                 noise_dtype=None, **config):
    """A tiny LlamaGen GPT (``coolsd.models.llamagen.tiny(**config)``: dim 64, 2 layers, 4 heads,
    vocab 64, 8 text slots, caption dim 16, 4x4 grid), random weights (``torch.manual_seed(seed)``,
    ``init_std``) and RMSNorm weights 1 + ``norm_noise`` N(0, 1) (untouched for 0), the noise drawn
    in ``noise_dtype`` (default ``dtype``); in ``dtype``, eval mode. The defaults are the reference
    tests' model (test_llamagen)."""
    from coolsd.models.llamagen import LlamaGenGPT, tiny

    torch.manual_seed(seed)
    model = LlamaGenGPT(tiny(**config), init_std=init_std).to(noise_dtype or dtype)
    if norm_noise:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1 + norm_noise * torch.randn_like(p))
    return model.to(dtype).eval()


def llamagen_variants(dtype=torch.float64, seed: int = 0) -> dict:
    """variant -> the same tiny LlamaGen weights (``llamagen_gpt``, norm noise drawn in float32)
    under each ``LlamaGenConfig.variant`` ("upstream", "lantern"), in ``dtype``, eval mode."""
    from coolsd.models.llamagen import LlamaGenGPT

    base = llamagen_gpt(seed, dtype=torch.float32)
    out = {}
    for v in ("upstream", "lantern"):
        m = LlamaGenGPT(dataclasses.replace(base.config, variant=v))
        m.load_state_dict(base.state_dict())
        out[v] = m.to(dtype).eval()
    return out


def llamagen_cond(valid: list[int], dtype=torch.float64, seed: int = 1, draw_dtype=None) -> dict:
    """Left-padded random caption embeddings of the tiny config (``tiny()``: 8 text slots, caption
    dim 16) with ``valid[b]`` valid text slots at the end of row b, drawn in ``draw_dtype``
    (default ``dtype``) from their own generator, returned in ``dtype``; and their mask."""
    from coolsd.models.llamagen import tiny

    cfg = tiny()
    T = cfg.cls_token_num
    g = torch.Generator().manual_seed(seed)
    caption = torch.randn(len(valid), T, cfg.caption_dim, generator=g, dtype=draw_dtype or dtype).to(dtype)
    mask = torch.zeros(len(valid), T, dtype=torch.bool)
    for b, n in enumerate(valid):
        mask[b, T - n :] = True  # left padded: valid slots at the end
    return {"caption_embs": caption, "emb_mask": mask}


def engine_model(seed: int, dim: int = 64, n_layer: int = 2):
    """The engine tests' tiny float64 LlamaGen GPT: large weights (peaked distributions), plain norms."""
    return llamagen_gpt(seed, init_std=0.2, norm_noise=0, dim=dim, n_layer=n_layer)


def engine_cond(valid: list[int]) -> dict:
    """The engine tests' captions: ``llamagen_cond`` seeded by ``sum(valid)``."""
    return llamagen_cond(valid, seed=sum(valid))


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
    from coolsd.models.eagle.model import EagleHead
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


def write_hub_repo(cache: Path, repo: str, files: dict, commit: str = "0" * 40, ref: str = "main") -> Path:
    """A repo of the Hugging Face hub cache ``cache`` in the library's own layout: every file's
    content once under ``blobs/<sha256>``, linked from ``snapshots/<commit>/<path>``, and
    ``refs/<ref>`` naming the commit. ``files``: {path in the repo: a local file, or a folder whose
    files go under that path}. Returns the snapshot folder."""
    import hashlib
    import os
    import shutil

    root = cache / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / commit
    pairs = []
    for dest, src in files.items():
        src = Path(src)
        if src.is_dir():
            pairs += [(f"{dest}/{f.relative_to(src).as_posix()}".lstrip("/"), f) for f in sorted(src.rglob("*"))
                      if f.is_file()]
        else:
            pairs.append((dest, src))
    for dest, src in pairs:
        blob = root / "blobs" / hashlib.sha256(src.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            shutil.copyfile(src, blob)
        link = snap / dest
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    return snap


def write_llamagen_hub_cache(cache: Path, files: dict) -> Path:
    """The tiny LlamaGen files (``write_llamagen_files``) where ``conf/target/llamagen_xl.yaml`` and
    ``conf/draft/llamagen_xl.yaml`` name them by hub id, in a hub cache ``cache``."""
    write_hub_repo(cache, "peizesun/llamagen_t2i", {"t2i_XL_stage1_256.pt": files["gpt"], "vq_ds16_t2i.pt": files["vq"]},
                   commit="1" * 40)
    write_hub_repo(cache, "google/flan-t5-xl", {"": files["t5"]}, commit="2" * 40)
    write_hub_repo(cache, "jadohu/llamagen_drafter", {"": files["drafter"]}, commit="3" * 40)
    return cache


def llamagen_tiny_settings() -> list[str]:
    """The overrides that run ``target=llamagen_xl`` on its tiny files, file paths excepted."""
    return ["target.device=cpu", "target.dtype=float32", "target.t5_dtype=float32",
            f"target.gpt_config={_braced(TINY_GPT)}", f"+target.vq_config={_braced(TINY_LLAMAGEN_VQ)}"]


def llamagen_overrides(files: dict) -> list[str]:
    return [f"target.files.gpt={files['gpt']}", f"target.files.vq={files['vq']}", f"target.files.t5={files['t5']}",
            f"draft.path={files['drafter']}", *llamagen_tiny_settings()]


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
    config.json + model.safetensors, as ``coolsd.models.eagle.lumina.save_lumina_drafter``)."""
    from coolsd.models.eagle.lumina import LuminaEagleHead, save_lumina_drafter

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


def write_tiny_vae(path: Path) -> Path:
    """A random KL-16-layout VAE of ``TINY_VAE`` as MAR's ``kl16.ckpt`` ({"model": state dict})."""
    from coolsd.models.kl16_vae import KLVAE, KLVAEConfig

    vae = KLVAE(KLVAEConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in TINY_VAE.items()}))
    torch.save({"model": vae.state_dict()}, path)
    return path


def write_mar_files(d: Path) -> dict:
    """Target and draft ``checkpoint-last.pth`` (model + model_ema + argparse args) and kl16.ckpt."""
    from coolsd.models.mar import MAR, MARConfig

    torch.manual_seed(0)
    paths = {}
    for name in ("target", "draft"):
        m = MAR(MARConfig(**TINY_MAR))
        paths[name] = d / f"{name}.pth"
        torch.save({"model": m.state_dict(), "model_ema": m.state_dict(), "epoch": 1,
                    "args": argparse.Namespace(model="tiny")}, paths[name])
    paths["vae"] = write_tiny_vae(d / "kl16.ckpt")
    return paths


def mar_overrides(files: dict) -> list[str]:
    arch = _braced(TINY_MAR)
    return ["dataset=imagenet", "target.device=cpu", f"target.arch={arch}", f"draft.arch={arch}",
            f"+target.vae={_braced(TINY_VAE)}", "target.head.steps=3", f"target.files.checkpoint={files['target']}",
            f"target.files.vae={files['vae']}", f"draft.files.checkpoint={files['draft']}"]


# ------------------------------------------------------------------------------ in-memory MAR (test_mar)
TINY_MAR_REFERENCE = dict(seq_len=16, token_dim=4, encoder_dim=32, encoder_depth=2, encoder_heads=4, decoder_dim=32,
                          decoder_depth=2, decoder_heads=4, buffer_size=4, n_classes=10, head_width=32, head_depth=2)


def mar_reference_cfg():
    """The MARConfig of the tests against upstream's MAR code (test_mar)."""
    from coolsd.models.mar import MARConfig

    return MARConfig(**TINY_MAR_REFERENCE)


def randomised(module, seed: int = 0, std: float = 0.1):
    """Every parameter of ``module`` set to ``std`` N(0, 1) (in its dtype) from its own generator:
    upstream zero-inits some, which would hide their terms."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)
    return module


def tiny_mar_reference(seed: int = 0, dtype=torch.float64):
    """A MAR of ``mar_reference_cfg()`` in ``dtype``, eval mode, every parameter random (``randomised``)."""
    from coolsd.models.mar import MAR

    return randomised(MAR(mar_reference_cfg()).to(dtype).eval(), seed=seed)


def tiny_mar_head(seed: int = 2, dtype=torch.float64):
    """The DiffLoss MLP (``SimpleMLPAdaLN``) of ``mar_reference_cfg()``, eval mode, random (``randomised``)."""
    from coolsd.models.mar import SimpleMLPAdaLN

    c = mar_reference_cfg()
    return randomised(SimpleMLPAdaLN(c.token_dim, c.head_width, c.decoder_dim, c.head_depth).to(dtype).eval(), seed=seed)


# ------------------------------------------------------------------------------ in-memory xAR (test_xar)
TINY_XAR = dict(grid=4, cell=2, token_dim=4, dim=32, encoder_depth=2, decoder_depth=2, heads=2, n_classes=10)


def tiny_xar(seed: int = 0, dtype=torch.float64, std: float = 0.15, **geometry):
    """An XAR of ``TINY_XAR`` (4x4 tokens of 4 dims in 4 cells of 2x2, width 32, 2 + 2 blocks of 2 heads;
    ``geometry`` overrides e.g. grid / cell) in ``dtype``, eval mode, every parameter random (``randomised``)."""
    from coolsd.models.xar import XAR, XARConfig

    return randomised(XAR(XARConfig(**{**TINY_XAR, **geometry})).to(dtype).eval(), seed=seed, std=std)


def write_xar_files(d: Path) -> dict:
    """Target and draft xAR files in the released layout (flat state dicts with upstream's buffers) and
    kl16.ckpt, for ``target=xar_h`` on a 4x4 grid of 2x2 cells."""
    from coolsd.models.xar import upstream_state_dict

    paths = {}
    for seed, name in ((0, "target"), (1, "draft")):
        paths[name] = d / f"{name}.pth"
        torch.save(upstream_state_dict(tiny_xar(seed, dtype=torch.float32)), paths[name])
    paths["vae"] = write_tiny_vae(d / "kl16.ckpt")
    return paths


def xar_overrides(files: dict) -> list[str]:
    arch = _braced(TINY_XAR)
    return ["dataset=imagenet", "target.device=cpu", f"target.arch={arch}", f"draft.arch={arch}",
            f"+target.vae={_braced(TINY_VAE)}", "target.flow.num_steps=3", "target.flow.unit=2",
            f"target.files.checkpoint={files['target']}", f"target.files.vae={files['vae']}",
            f"draft.files.checkpoint={files['draft']}"]


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


def tiny_metric_scorers(tmp_path: Path, protocol: str = "lantern") -> dict:
    """``evaluate_run`` keyword arguments (scorers, protocol) for a real-target report on tiny files: a tiny random
    CLIP (``protocol`` "lantern": our ``ClipScorer``; "sjd": torchmetrics' ``CLIPScore``), moment
    features instead of Inception, reference statistics of three random COCO-named JPEGs (numbers
    meaningless; the reports' layout is what such tests check)."""
    import numpy as np
    from PIL import Image

    from coolsd.metrics.clip_score import ClipScorer
    from coolsd.metrics.clip_torchmetrics import TorchmetricsClipScorer
    from coolsd.metrics.image_metrics import ClipMetric, FidMetric
    from coolsd.metrics.reference import reference_statistics

    coco = tmp_path / "val2017"
    coco.mkdir()
    r = np.random.default_rng(0)
    for i in (1, 2, 3):
        Image.fromarray(r.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(coco / f"{i:012d}.jpg")
    feats = MomentFeatures()
    (tmp_path / "clip").mkdir()
    clip_dir = write_tiny_clip(tmp_path / "clip")
    if protocol == "sjd":
        from transformers import CLIPImageProcessor

        CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(str(clip_dir))
        clip = TorchmetricsClipScorer.from_pretrained(clip_dir)
    else:
        clip = ClipScorer.from_pretrained(clip_dir)
    reference = reference_statistics(sorted(coco.glob("*.jpg")), feats, tmp_path / "cache", "w")
    return {"scorers": {"clip_score": ClipMetric(clip), "fid": FidMetric(feats, reference, 5)}, "protocol": protocol}


# ------------------------------------------------------------------------------ metric networks
CLIP_WORDS = ["photo", "depicts", "cat", "dog", "red", "sits", "on", "the", "mat"]


def write_tiny_bpe(d):
    """vocab.json / merges.txt in CLIP's format: characters, their word-final ``</w>`` forms,
    merge results building CLIP_WORDS, then SOT and EOT (EOT the largest id, as in CLIP)."""
    import string

    chars = list(string.ascii_lowercase) + [".", ","]
    merges = []
    for w in CLIP_WORDS:
        syms = list(w[:-1]) + [w[-1] + "</w>"]
        cur = syms[0]
        for s in syms[1:]:
            if (cur, s) not in merges:
                merges.append((cur, s))
            cur += s
    toks = list(dict.fromkeys(chars + [c + "</w>" for c in chars] + [a + b for a, b in merges]))
    toks += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(toks)}
    (d / "vocab.json").write_text(json.dumps(vocab))
    (d / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return vocab


def write_tiny_clip(d):
    """A tiny random CLIPModel + tokenizer files saved in folder ``d`` (from_pretrained layout)."""
    from transformers import CLIPConfig, CLIPModel

    vocab = write_tiny_bpe(d)
    sot, eot = vocab["<|startoftext|>"], vocab["<|endoftext|>"]
    cfg = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=77,
                         bos_token_id=sot, eos_token_id=eot, pad_token_id=eot),
        vision_config=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8),
        projection_dim=16)
    torch.manual_seed(0)
    CLIPModel(cfg).eval().save_pretrained(str(d))
    return d


def random_inception(seed: int = 0):
    """The FID Inception-v3 with He-normal convs and non-trivial BatchNorm statistics, so
    activations neither vanish nor explode through the 94 layers (PyTorch's default init gives
    ~1e-8 features)."""
    import torch.nn as nn

    from coolsd.metrics.inception import InceptionV3

    g = torch.Generator().manual_seed(seed)
    model = InceptionV3()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                m.weight.normal_(0, (2 / m.weight[0].numel()) ** 0.5, generator=g)
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5, generator=g)
                m.bias.uniform_(-0.2, 0.2, generator=g)
                m.running_mean.uniform_(-0.2, 0.2, generator=g)
                m.running_var.uniform_(0.5, 1.5, generator=g)
        model.fc.weight.normal_(0, 0.02, generator=g)
    return model.requires_grad_(False).eval()  # as load_inception returns it


class MomentFeatures:
    """A cheap deterministic feature extractor (the interface evaluate / reference use): per
    channel mean, std and two quantiles of the image, 12 dims, any image size."""

    name, protocol, feature_dim = "moments", "raw", 12

    def __call__(self, images):
        import numpy as np

        out = []
        for img in images:
            x = np.asarray(img, np.float64).reshape(-1, 3) / 255
            out.append(np.concatenate([x.mean(0), x.std(0), *np.quantile(x, [0.25, 0.75], axis=0)]))
        return np.asarray(out).reshape(len(out), 12)


# ------------------------------------------------------------------------------ in-memory Harmon (test_harmon)
TINY_HARMON_LLM = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                   "vocab_size": 64, "max_position_embeddings": 256}
TINY_HARMON_MAR = {"seq_len": 16, "token_dim": 4, "encoder_dim": 24, "encoder_depth": 1, "encoder_heads": 2,
                   "decoder_dim": 24, "decoder_depth": 1, "decoder_heads": 2, "buffer_size": 2, "n_classes": 10,
                   "head_width": 16, "head_depth": 1}
TINY_HARMON_NULL = [5, 9, 2]  # the null prompt's ids in the tiny vocabulary


def tiny_harmon_cfg(grid: int = 4):
    """The HarmonConfig of ``tiny_harmon``: Qwen2 width 32 (2 layers, 4 heads, 2 KV heads, vocab 64), MAR on
    a 4x4 BASE grid (width 24 != 32: proj_in / proj_out change width), run at ``grid`` x ``grid``."""
    from coolsd.models.harmon import HarmonConfig, QwenConfig
    from coolsd.models.mar import MARConfig

    return HarmonConfig(QwenConfig(**TINY_HARMON_LLM), MARConfig(**TINY_HARMON_MAR), grid=grid)


def tiny_harmon(seed: int = 0, dtype=torch.float64, grid: int = 4, std: float = 0.15):
    """A Harmon of ``tiny_harmon_cfg(grid)`` in ``dtype``, eval mode, every parameter random (``randomised``;
    RMS / layer norm weights 1 + that noise, so that no norm is near zero), ``null_prompt`` TINY_HARMON_NULL."""
    from coolsd.models.harmon import Harmon

    m = randomised(Harmon(tiny_harmon_cfg(grid)), seed=seed, std=std)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if ("norm" in name or "_ln" in name) and name.endswith("weight"):
                p.add_(1.0)
    m.set_null_prompt(TINY_HARMON_NULL)
    return m.to(dtype).eval()


def write_harmon_tokenizer(path: Path) -> Path:
    """A word-level ``tokenizer.json`` (the ``tokenizers`` library's format, as Qwen2.5's) of the toy captions'
    words, the prompt template's words and Qwen's chat special tokens: at most TINY_HARMON_LLM's 64 ids."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from coolsd.toy.scenes import WORDS

    words = ["<unk>", *[w for w in WORDS if w != "<unk>"], "user", "assistant", "Generate", "an", "image", ":", "."]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(dict.fromkeys(words))}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    assert tok.get_vocab_size() <= TINY_HARMON_LLM["vocab_size"]
    tok.save(str(path))
    return path


def write_harmon_files(d: Path) -> dict:
    """Target and draft Harmon files in the released layout (flat state dicts, the tied lm_head included),
    kl16.ckpt and a tiny tokenizer.json, for ``target=harmon_1_5b`` on a 4x4 grid."""
    paths = {}
    for seed, name in ((0, "target"), (1, "draft")):
        sd = dict(tiny_harmon(seed, dtype=torch.float32).state_dict())
        sd["llm.lm_head.weight"] = sd["llm.model.embed_tokens.weight"]
        paths[name] = d / f"{name}.pth"
        torch.save(sd, paths[name])
    paths["vae"] = write_tiny_vae(d / "kl16.ckpt")
    paths["tokenizer"] = write_harmon_tokenizer(d / "tokenizer.json")
    return paths


def harmon_overrides(files: dict) -> list[str]:
    arch = "{llm:" + _braced(TINY_HARMON_LLM) + ",mar:" + _braced(TINY_HARMON_MAR) + ",grid:4}"
    return ["target.device=cpu", f"target.arch={arch}", f"draft.arch={arch}", "target.grid=4",
            f"+target.vae={_braced(TINY_VAE)}", "target.head.steps=3", f"target.files.checkpoint={files['target']}",
            f"target.files.vae={files['vae']}", f"target.files.tokenizer={files['tokenizer']}",
            f"draft.files.checkpoint={files['draft']}"]


# ------------------------------------------------------------------------------ Janus-Pro (test_janus, its world)
JANUS_SIDE = 4  # 4 x 4 image tokens of 2 px: 8 x 8 images
JANUS_CODES = 32  # VQ codebook


def _janus_tokens():
    from coolsd.models.janus import JanusTokens

    return JanusTokens(bos=1, pad=2, boi=4)


JANUS_TOKENS = _janus_tokens()  # the tiny vocabulary's BOS, pad and <begin_of_image>


def tiny_janus_config(side: int = JANUS_SIDE, attn: str = "sdpa"):
    """transformers' ``JanusConfig`` in miniature: Llama text model (hidden 32, 2 layers, 4 query / 2
    key-value heads, vocab 64), SigLIP-style vision tower (never used for generation; its
    ``image_size // patch_size`` sets the VQ grid), VQ of 32 codes with 2 levels (2 px a token)."""
    from transformers import JanusConfig, LlamaConfig
    from transformers.models.janus.configuration_janus import JanusVisionConfig, JanusVQVAEConfig

    t = JANUS_TOKENS
    text = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=256, pad_token_id=t.pad, bos_token_id=t.bos,
                       eos_token_id=3)
    vision = JanusVisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=4 * side,
                               patch_size=4, projection_dim=32, num_image_tokens=side * side, mlp_ratio=2.0)
    vq = JanusVQVAEConfig(embed_dim=8, num_embeddings=JANUS_CODES, latent_channels=32, base_channels=32,
                          channel_multiplier=[1, 1], num_res_blocks=1, projection_dim=32, image_token_embed_dim=32)
    cfg = JanusConfig(text_config=text, vision_config=vision, vq_config=vq, image_token_id=5)
    cfg._attn_implementation = attn  # the text and vision configs follow
    return cfg


def tiny_janus(seed: int = 0, dtype=torch.float64, attn: str = "sdpa"):
    """A tiny ``JanusForConditionalGeneration`` (``tiny_janus_config``) with every parameter random
    (matrices N(0, 1/fan_in), embeddings N(0, 1), norm weights 1 + 0.2 N(0, 1), biases 0.1 N(0, 1)):
    transformers' 0.02 init would make the image logits nearly flat, so greedy sequences would be
    constant. In ``dtype``, eval mode."""
    from transformers import JanusForConditionalGeneration

    model = JanusForConditionalGeneration(tiny_janus_config(attn=attn)).to(dtype).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
            if "embed" in name:
                p.copy_(noise)
            elif p.dim() >= 2:
                p.copy_(noise / p[0].numel() ** 0.5)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * noise)
            else:
                p.copy_(0.1 * noise)
    return model


def write_janus_tokenizer(path: Path) -> Path:
    """A word-level ``tokenizer.json`` (the ``tokenizers`` library's format, as Janus's) with Janus's
    special tokens at JANUS_TOKENS' ids and the chat template's role tokens: at most the tiny 64 ids."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from coolsd.toy.scenes import WORDS

    vocab = {"<unk>": 0, "<｜begin▁of▁sentence｜>": 1, "<｜▁pad▁｜>": 2, "<｜end▁of▁sentence｜>": 3,
             "<begin_of_image>": 4, "<image_placeholder>": 5, "<|User|>": 6, "<|Assistant|>": 7, ":": 8}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    assert len(vocab) <= 64
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<｜begin▁of▁sentence｜>", "<｜▁pad▁｜>",
                                                                   "<｜end▁of▁sentence｜>", "<begin_of_image>")])
    tok.add_tokens([AddedToken("<|User|>"), AddedToken("<|Assistant|>")])
    tok.save(str(path))
    return path


def write_janus_folder(d: Path, seed: int = 2, dtype=torch.float32) -> Path:
    """A transformers-format Janus-Pro folder of the tiny model: ``save_pretrained`` (config.json,
    model.safetensors, generation_config.json with the converter's pad / boi ids) and tokenizer.json."""
    model = tiny_janus(seed, dtype)
    model.generation_config.pad_token_id = JANUS_TOKENS.pad
    model.generation_config.boi_token_id = JANUS_TOKENS.boi
    model.save_pretrained(d)
    write_janus_tokenizer(d / "tokenizer.json")
    return d


def write_janus_files(d: Path) -> Path:
    """The tiny Janus-Pro folder the worlds run (``janus_overrides``)."""
    return write_janus_folder(d / "Janus-Pro-tiny")


def janus_overrides(folder) -> list[str]:
    """A ``write_janus_folder`` folder as ``target=janus_pro`` / ``janus_pro_7b``: CPU, float32,
    4 x 4 tokens of 2 px (``target.image_size`` = 8, ``target.vq_downsample`` = 2)."""
    return ["target.device=cpu", "target.dtype=float32", f"target.files.model={folder}",
            f"target.image_size={2 * JANUS_SIDE}", "target.vq_downsample=2"]


# ------------------------------------------------------------------------------ Emu3-Gen (test_emu3, its world)
EMU3_CODES = 32  # VQ codebook (visual tokens)
EMU3_GRID = 4  # 4 x 4 image tokens: an end-of-line after tokens 3, 7, 11
EMU3_IMAGE_AREA = (EMU3_GRID * 8) ** 2  # Emu3Processor's size rule: side / 8 tokens
EMU3_SPECIAL = {"<|endoftext|>": 0, "<|extra_203|>": 1, "<|extra_204|>": 2, "<|image start|>": 3,
                "<|image end|>": 4, "<|image token|>": 5, "<|extra_200|>": 6, "<|extra_201|>": 7,
                "<image>": 8}  # Emu3's names: pad, bos, eos, boi, eoi, image wrapper, end of line, end of frame
EMU3_WORDS = ["<unk>", *"0123456789*,.", "a", "red", "circle", "masterpiece", "film", "grained", "best", "quality",
              "lowres", "bad", "anatomy", "hands", "text", "blurry"]
EMU3_VOCAB = 80
EMU3_TEXT = dict(vocab_size=EMU3_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2)
EMU3_VQ = dict(codebook_size=EMU3_CODES, embed_dim=4, latent_channels=4, base_channels=32, channel_multiplier=[1, 2],
               num_res_blocks=1, attn_resolutions=[], temporal_downsample_factor=4, hidden_size=64,
               num_attention_heads=1)


def emu3_vocabulary_map() -> dict:
    """Emu3's token names on the tiny vocabulary: the specials, 32 visual tokens on shuffled ids
    9..40 (id != code + 9), words from 41."""
    K = EMU3_CODES
    perm = torch.randperm(K, generator=torch.Generator().manual_seed(7)).tolist()
    v = dict(EMU3_SPECIAL)
    v.update({f"<|visual token {c:06d}|>": 9 + perm[c] for c in range(K)})
    v.update({w: 9 + K + i for i, w in enumerate(EMU3_WORDS)})
    v.update({f"w{i}": i for i in range(9 + K + len(EMU3_WORDS), EMU3_VOCAB)})
    return v


def tiny_emu3(seed: int = 0, dtype=torch.float64, attn: str = "sdpa"):
    """An ``Emu3ForConditionalGeneration`` (text: hidden 32, 2 layers, 4 heads, 2 KV heads, vocab 80;
    VQ: 32 codes, 2 px a token), text weights N(0, 0.3^2), RMSNorm weights 1 + 0.2 N(0, 1)."""
    from transformers import Emu3Config, Emu3ForConditionalGeneration

    cfg = Emu3Config(vq_config=EMU3_VQ, text_config=EMU3_TEXT, vocabulary_map=emu3_vocabulary_map())
    cfg._attn_implementation = attn
    cfg.text_config._attn_implementation = attn
    torch.manual_seed(seed)
    model = Emu3ForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vqmodel" not in name:
                p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
    return model.to(dtype).eval()


def write_emu3_tokenizer(d: Path) -> Path:
    """An Emu3-style tokenizer folder (tokenizer.json, tokenizer_config.json with Emu3's special
    tokens: bos, boi, image wrapper, ...) over the tiny vocabulary's words."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    v = emu3_vocabulary_map()
    tok = Tokenizer(models.WordLevel({w: i for w, i in v.items() if w in EMU3_SPECIAL or w in EMU3_WORDS},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(s, special=True) for s in EMU3_SPECIAL])
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|extra_203|>", "eos_token": "<|extra_204|>",
        "pad_token": "<|endoftext|>", "extra_special_tokens": {
            "image_token": "<image>", "boi_token": "<|image start|>", "eoi_token": "<|image end|>",
            "image_wrapper_token": "<|image token|>", "eof_token": "<|extra_201|>"}}))
    return d


def write_emu3_folder(d: Path, seed: int = 2) -> Path:
    """A tiny Emu3-Gen-hf folder: config.json + model.safetensors (float32, VQ inside), the tokenizer
    files and preprocessor_config.json (Emu3ImageProcessor, mean = std = 0.5)."""
    from transformers import Emu3ImageProcessor

    tiny_emu3(seed, dtype=torch.float32).save_pretrained(str(d))
    write_emu3_tokenizer(d)
    Emu3ImageProcessor(image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(str(d))
    return d


def write_emu3_files(d: Path) -> Path:
    """The tiny Emu3-Gen-hf folder the worlds run (``emu3_overrides``)."""
    return write_emu3_folder(d / "Emu3-Gen-hf")


def emu3_overrides(folder) -> list[str]:
    """A ``write_emu3_folder`` folder as ``target=emu3``: CPU, float32, a 4 x 4 token grid
    (``target.image_area`` = 32 x 32 px at the processor's 8 px a token)."""
    return ["target.device=cpu", "target.dtype=float32", f"target.image_area={EMU3_IMAGE_AREA}",
            f"target.files.model={folder}"]


# ------------------------------------------------------------------------------ benchmarks
def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module (benchmarks are scripts, not a package), registered in
    ``sys.modules`` under ``bench_<name>`` so its dataclasses resolve their module."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(f"bench_{name}", Path(__file__).resolve().parents[1] / "benchmarks"
                                                  / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
