#!/usr/bin/env python
"""Regenerate the upstream-parity fixtures in ``tests/fixtures/upstream/`` from upstream checkouts.

The UPSTREAM classes are imported from the checkouts the user points at (``sys.path``; no upstream
code lives in this repository). Each family builds a tiny random-weight model with fixed seeds in
fp32, runs it with upstream's own inference code, and writes one safetensors file with

* ``w.<key>``: the weights in the upstream state-dict layout (what the upstream class holds; the
  weights are rounded to fp16 values before the run and stored as fp16, losslessly: half the bytes),
* ``in.<name>``: the inputs, ``out.<name>``: the upstream outputs,
* metadata ``config`` (JSON: the tiny config), ``tolerance`` (what the test asserts), ``upstream``,

plus ``MANIFEST.json`` (upstream repository, commit, the command that made each file, shapes and
the tolerance). ``tests/models/test_upstream_parity.py`` reads only these files.

Families: ``--llamagen`` (GPT t2i, VQ-16, T5 caption path), ``--lantern`` (its LlamaGen variant,
EAGLE heads for LlamaGen and Lumina-mGPT), ``--lumina`` (vendored Chameleon with Lumina's CFG
processor and row ends, Chameleon VQGAN), ``--mar`` (MAR, DiffLoss, KL-16), ``--xar`` (xAR's
network and its per-cell SDE sampler), ``--hf-chameleon`` (transformers' Chameleon, from the
installed package), and the SJD family's samplers, which have no weights (``sampler_*``: inputs,
every random draw recorded, outputs; read by tests/engine/test_upstream_samplers.py): ``--sjd``
(tyshiwo1/Accelerating-T2I-AR-with-SJD), ``--scd`` (junhyukso/SCD, MC-SJD), ``--gsd`` (junhyukso/GSD),
``--sjd-pac`` (KangJialiang/SJD-PAC), each run on a synthetic target (section "SJD-family samplers"),
and ``--zipar`` (ThisisBillhe/ZipAR's LlamaGen code: ``generate_zipar.generate`` on its ``gpt.py``, every
query's fed token, position, logits and zero cache slots, and the draws; read by
tests/engine/test_upstream_zipar.py), and ``--pjd`` (boyaliao/PJD's multi-row sampler, section "PJD
(sampler)"; read by tests/engine/test_upstream_samplers.py), and ``--disa`` (Qinyu-Allen-Zhao/DiSA's
``MAR_DiSA`` DiffLoss with ``diff_sampler="DiSA"``: the annealed step schedules, the respaced timesteps and
``DiffLoss.sample`` with recorded draws; torch and numpy only, ``.cuda()`` the identity while it runs).

Usage (each option optional; families not given keep their existing files)::

    python tools/make_upstream_fixtures.py --llamagen /tmp/upstream/llamagen --lantern /tmp/upstream/lantern \
        --lumina /tmp/upstream/lumina --mar /tmp/upstream/mar --xar /tmp/upstream/xar --hf-chameleon
    python tools/make_upstream_fixtures.py --sjd /tmp/upstream/sjd --scd /tmp/upstream/scd \
        --gsd /tmp/upstream/gsd --sjd-pac /tmp/upstream/sjd_pac
    python tools/make_upstream_fixtures.py --zipar /tmp/upstream/zipar
    python tools/make_upstream_fixtures.py --pjd /tmp/upstream/pjd
    python tools/make_upstream_fixtures.py --disa /tmp/disa

Environment: LANTERN's and Lumina's modelling code needs transformers 4.45.2 (LANTERN's pin;
transformers 5.x cannot build its configs), MAR's and xAR's need timm, xAR's also einops. Run
this script with an interpreter that has them, e.g. a scratch venv outside the repository that
sees our venv's torch (see tests/fixtures/upstream/README.md); the SJD-family schedulers need
transformers 4.45.2 and absl-py. Upstream imports this script
cannot satisfy are stubbed for that import only, each documented where it is done: LANTERN's T5
embedder (loads FLAN-T5-XL), Lumina's ``data.item_processor`` (tokenizer files), torchvision for
timm, xAR's unused ``flash_attn`` import (and its ``.cuda()`` calls, the identity while it runs).
The SJD-family samplers need no stub; their ``torch.multinomial`` is replaced while they run by an
inverse-CDF draw from a recorded uniform (``_Draws``: the same law), and SJD-PAC's hard-coded top-up
constants are set to the fixture's vocabulary. ZipAR's LlamaGen code needs nothing beyond torch and is
not stubbed; its ``sample`` draws by inverse CDF from recorded uniforms (``_zipar_case``).

The commit recorded for a checkout is ``git -C <checkout> rev-parse HEAD`` or, for an exported
tree (``git archive``), the 40-hex first line of ``<checkout>/UPSTREAM_COMMIT``.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib
import inspect
import json
import os
import shlex
import subprocess
import sys
import types
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "upstream"
UPSTREAM_REPOS = {"llamagen": "FoundationVision/LlamaGen", "lantern": "jadohu/LANTERN", "lumina": "Alpha-VLLM/Lumina-mGPT",
                  "mar": "LTH14/mar", "xar": "OliverRensu/xAR", "harmon": "wusize/Harmon",
                  "sjd": "tyshiwo1/Accelerating-T2I-AR-with-SJD", "scd": "junhyukso/SCD", "gsd": "junhyukso/GSD",
                  "sjd_pac": "KangJialiang/SJD-PAC", "zipar": "ThisisBillhe/ZipAR", "pjd": "boyaliao/PJD",
                  "disa": "Qinyu-Allen-Zhao/DiSA"}


# ------------------------------------------------------------------------------------ helpers
def checkout_commit(path: Path) -> str:
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        pass
    marker = path / "UPSTREAM_COMMIT"
    if marker.is_file():
        sha = marker.read_text().split()[0]
        if len(sha) == 40:
            return sha
    raise SystemExit(f"cannot tell the commit of {path}: not a git checkout and no UPSTREAM_COMMIT file "
                     f"(write the 40-hex commit into {marker})")


@contextlib.contextmanager
def upstream_path(root: Path, purge: tuple[str, ...]):
    """Import upstream modules from ``root``: prepended to sys.path, and the top-level package names
    ``purge`` (e.g. ``models``, ``utils``) dropped from sys.modules before and after, so two
    checkouts with the same package names do not see each other's modules."""
    def drop():
        for name in list(sys.modules):
            if name.split(".")[0] in purge:
                del sys.modules[name]
    drop()
    sys.path.insert(0, str(root))
    try:
        yield
    finally:
        sys.path.remove(str(root))
        drop()


def randomize(module: torch.nn.Module, seed: int, std: float = 0.15, norm_keys=("norm", "layernorm")) -> None:
    """Seeded random weights: normalisation weights 1 + 0.2 N(0, 1), every other floating
    parameter std * N(0, 1) (upstream's zero-initialised output layer would give zero logits)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if any(k in name for k in norm_keys) and name.endswith("weight"):
                p.copy_(1 + 0.2 * noise)
            else:
                p.copy_(std * noise)


def round_fp16(module: torch.nn.Module) -> None:
    """Round every floating PARAMETER to the nearest fp16 value (kept in fp32), BEFORE the upstream
    run: the model is still an fp32 model, and its weights are stored losslessly in half the bytes
    (``save`` writes exactly representable weights as fp16; the test casts them back to fp32).
    Buffers are left alone (RoPE inverse frequencies and the like are computed constants)."""
    with torch.no_grad():
        for t in module.parameters():
            if t.is_floating_point():
                t.copy_(t.half().float())


def save(out_dir: Path, name: str, family: str, weights: dict, inputs: dict, outputs: dict, config: dict,
         manifest: dict, repo: str, commit: str, source: str, tolerance: float, note: str) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for prefix, group in (("w.", weights), ("in.", inputs), ("out.", outputs)):
        for k, v in group.items():
            v = v.detach().contiguous().clone()
            if prefix == "w." and v.dtype == torch.float32 and torch.equal(v.half().float(), v):
                v = v.half()  # lossless (round_fp16); the test reads weights back as fp32
            tensors[prefix + k] = v
    meta = {"family": family, "config": json.dumps(config, sort_keys=True), "tolerance": repr(tolerance),
            "upstream": f"{repo}@{commit}"}
    path = out_dir / f"{name}.safetensors"
    save_file(tensors, str(path), metadata=meta)
    os.chmod(path, 0o644)
    manifest["files"][path.name] = {
        "family": family, "upstream_repo": repo, "upstream_commit": commit, "upstream_source": source,
        "command": manifest["command"], "tolerance_max_abs": tolerance, "note": note, "config": config,
        "bytes": path.stat().st_size,
        "shapes": {k: list(v.shape) for k, v in tensors.items() if not k.startswith("w.")},
        "n_weights": sum(v.numel() for k, v in tensors.items() if k.startswith("w.")),
    }
    print(f"wrote {path} ({path.stat().st_size / 1e3:.0f} kB)")


def left_padded_mask(valid: list[int], T: int) -> torch.Tensor:
    mask = torch.zeros(len(valid), T, dtype=torch.long)  # the T5 tokenizer's attention mask, flipped
    for b, n in enumerate(valid):
        mask[b, T - n:] = 1
    return mask


# tree verified in the GPT fixture: parent of each node (node 0 = root at depth 0), 9 nodes, depth 4
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 3, 3, 6]


def tree_paths(parents: list[int]) -> list[list[int]]:
    paths = []
    for i in range(len(parents)):
        p, j = [], i
        while j >= 0:
            p.append(j)
            j = parents[j]
        paths.append(p[::-1])
    return paths


# ------------------------------------------------------------------------------------ LlamaGen GPT
def make_llamagen_gpt(root: Path, out_dir: Path, manifest: dict) -> None:
    """Upstream ``autoregressive/models/gpt.py`` Transformer (t2i) run through upstream
    ``generate.generate`` (prefill + KV-cache decode, CFG, left-padded caption mask with the forced
    diagonal). ``generate.sample`` is replaced by a recorder that stores the CFG-combined logits of
    each step and returns the fixture's forced tokens, so every logit comes from upstream code."""
    commit = checkout_commit(root)
    with upstream_path(root, ("autoregressive", "utils", "tokenizer", "language", "dataset")):
        gpt = importlib.import_module("autoregressive.models.gpt")
        gen = importlib.import_module("autoregressive.models.generate")
        cfg = dict(dim=64, n_layer=2, n_head=4, vocab_size=256, cls_token_num=120, caption_dim=16,
                   block_size=16, multiple_of=16, norm_eps=1e-5, rope_base=10000.0)
        torch.manual_seed(0)
        model = gpt.Transformer(gpt.ModelArgs(model_type="t2i", **cfg)).eval()
        randomize(model, seed=1)
        round_fp16(model)
        T, N, V = cfg["cls_token_num"], cfg["block_size"], cfg["vocab_size"]
        g = torch.Generator().manual_seed(2)
        valid = [5, T, 1]
        emb_mask = left_padded_mask(valid, T)
        # as autoregressive/sample/sample_t2i.py: c_indices = caption_embs * emb_masks[:, :, None]
        caption = torch.randn(len(valid), T, cfg["caption_dim"], generator=g) * emb_mask[:, :, None]
        tokens = torch.randint(0, V, (len(valid), N), generator=g)

        def run(forced: torch.Tensor, cfg_scale: float) -> torch.Tensor:
            """Upstream generate() with ``forced`` (B, n) as the sampled tokens: logits (B, n, V),
            entry k = the distribution of token k given the caption and forced[:, :k]."""
            logits, step = [], [0]

            def recorder(lg, **kw):
                lg = lg[:, -1, :]
                logits.append(lg.clone())
                k = step[0]
                step[0] += 1
                return forced[:, k:k + 1].to(torch.int), torch.softmax(lg, -1)

            orig = gen.sample
            gen.sample = recorder
            try:
                with torch.no_grad():
                    gen.generate(model, caption, forced.shape[1], emb_masks=emb_mask.clone(), cfg_scale=cfg_scale)
            finally:
                gen.sample = orig
            return torch.stack(logits, 1)

        out = {"decode_logits_cfg7.5": run(tokens, 7.5), "decode_logits_cfg1": run(tokens, 1.0)}
        # tree: prefix of 3 image tokens, then 9 tree tokens; node i's logits = upstream run on the branch
        prefix = tokens[:, :3]
        tree_tokens = torch.randint(0, V, (len(valid), len(TREE_PARENTS)), generator=g)
        tree_logits = torch.zeros(len(valid), len(TREE_PARENTS), V)
        for i, path in enumerate(tree_paths(TREE_PARENTS)):
            seq = torch.cat([prefix, tree_tokens[:, path], torch.zeros(len(valid), 1, dtype=torch.long)], 1)
            tree_logits[:, i] = run(seq, 7.5)[:, -1]
        out["tree_logits_cfg7.5"] = tree_logits
        weights = dict(model.state_dict())
        weights = {k: v for k, v in weights.items() if "kv_cache" not in k and k != "freqs_cis"}
        inputs = {"caption": caption, "emb_mask": emb_mask, "tokens": tokens, "tree_prefix": prefix,
                  "tree_tokens": tree_tokens, "tree_parents": torch.tensor(TREE_PARENTS)}
        scale = out["decode_logits_cfg7.5"].abs().max().item()
        save(out_dir, "llamagen_gpt_t2i", "llamagen_gpt", weights, inputs, out, dict(cfg, logit_scale=scale, cfg_scale=7.5),
             manifest, UPSTREAM_REPOS["llamagen"], commit,
             "autoregressive/models/gpt.py (Transformer, t2i), autoregressive/models/generate.py (generate, sample recorded)",
             tolerance=2e-4,
             note="3 captions with 5/120/1 valid slots (left padded); prefill + 15 KV decode steps at CFG 7.5 and "
                  "unguided; 9-node depth-4 tree after a 3-token prefix, each node's logits from upstream run on its branch")


# ------------------------------------------------------------------------------------ VQ-16
def make_llamagen_vq(root: Path, out_dir: Path, manifest: dict) -> None:
    """Upstream ``tokenizer/tokenizer_image/vq_model.py`` VQModel.decode_code. The architecture is
    VQ-16's (l2-normalised codebook, GroupNorm 32, mid attention) at small widths: the upstream
    Encoder/Decoder classes built with ch=32, one res block per level (VQModel does not expose ch)."""
    commit = checkout_commit(root)
    with upstream_path(root, ("tokenizer", "utils")):
        vq = importlib.import_module("tokenizer.tokenizer_image.vq_model")
        cfg = dict(codebook_size=64, codebook_dim=8, ch=32, ch_mult=[1, 2], z_channels=32, num_res_blocks=1)
        torch.manual_seed(0)
        args = vq.ModelArgs(codebook_size=cfg["codebook_size"], codebook_embed_dim=cfg["codebook_dim"],
                            encoder_ch_mult=cfg["ch_mult"], decoder_ch_mult=cfg["ch_mult"], z_channels=cfg["z_channels"])
        model = vq.VQModel(args)
        model.encoder = vq.Encoder(ch=cfg["ch"], ch_mult=cfg["ch_mult"], num_res_blocks=cfg["num_res_blocks"],
                                   z_channels=cfg["z_channels"])
        model.decoder = vq.Decoder(ch=cfg["ch"], ch_mult=cfg["ch_mult"], num_res_blocks=cfg["num_res_blocks"],
                                   z_channels=cfg["z_channels"])
        model.eval()
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():  # GroupNorm affine and biases random too (defaults are 1 / 0)
            for name, p in model.named_parameters():
                if name.endswith("bias") or ("norm" in name and name.endswith("weight")):
                    base = 1.0 if name.endswith("weight") else 0.0
                    p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
        round_fp16(model)
        codes = {"codes_4x4": torch.randint(0, cfg["codebook_size"], (2, 16), generator=g),
                 "codes_5x5": torch.randint(0, cfg["codebook_size"], (1, 25), generator=g)}
        out = {}
        with torch.no_grad():
            for name, c in codes.items():
                gs = round(c.shape[1] ** 0.5)
                out[name.replace("codes", "decoded")] = model.decode_code(c, [c.shape[0], cfg["codebook_dim"], gs, gs])
        # decode path only (the encoder and the codebook_used bookkeeping buffer are not saved: size)
        weights = {k: v for k, v in model.state_dict().items()
                   if k.split(".")[0] in ("decoder", "post_quant_conv") or k == "quantize.embedding.weight"}
        save(out_dir, "llamagen_vq", "llamagen_vq", weights, codes, out, cfg, manifest,
             UPSTREAM_REPOS["llamagen"], commit, "tokenizer/tokenizer_image/vq_model.py (VQModel.decode_code)",
             tolerance=2e-5, note="decode 2x(4x4) and 1x(5x5) code grids")


# ------------------------------------------------------------------------------------ LANTERN
def _lantern_imports():
    """LANTERN's ``modeling_llamagen_kv`` imports VQ_16 and T5Embedder at module level and builds a
    FLAN-T5-XL embedder in ``LlamaForCausalLM.__init__``; the fixture needs neither, so the T5
    module is replaced by a stub (``T5Embedder`` returns None) for this import only."""
    stub = types.ModuleType("models.base_models.llamagen.t5")
    stub.T5Embedder = lambda *a, **k: None
    sys.modules["models.base_models.llamagen.t5"] = stub
    kv = importlib.import_module("models.kv_variants.modeling_llamagen_kv")
    return kv


def make_lantern_llamagen(root: Path, out_dir: Path, manifest: dict) -> None:
    """LANTERN's LlamaGen variant (``models/kv_variants/modeling_llamagen_kv.py``, the HF-style
    model its drafters' training features come from): prefill of left-padded captions with CFG
    (``[cond; uncond]`` with the same mask, as ``ea_model_llamagen.py`` builds them), and the
    teacher-forced full sequence as ``entrypoints/generate_train_data.py`` runs it. Its mask has no
    self-attention diagonal for padded text slots (``_expand_mask`` + ``_make_causal_mask``)."""
    commit = checkout_commit(root)
    with upstream_path(root, ("models", "entrypoints", "third_party")):
        kv = _lantern_imports()
        from transformers.models.llama import LlamaConfig

        cfg = dict(dim=64, n_layer=2, n_head=4, vocab_size=256, cls_token_num=120, caption_dim=16, block_size=16,
                   multiple_of=16, norm_eps=1e-5, rope_base=10000.0)
        ffn = 176  # LlamaGen's find_multiple(int(2 * 4 * 64 / 3), 16)
        hf = LlamaConfig(vocab_size=cfg["vocab_size"], hidden_size=cfg["dim"], intermediate_size=ffn,
                         num_hidden_layers=cfg["n_layer"], num_attention_heads=cfg["n_head"],
                         rms_norm_eps=cfg["norm_eps"], attention_bias=False, pretraining_tp=1)
        for k, v in dict(block_size=cfg["block_size"], num_classes=1000, input_type="t2i",
                         cls_token_num=cfg["cls_token_num"], caption_dim=cfg["caption_dim"], class_dropout_p=0.1,
                         token_dropout_p=0.1, resid_dropout_p=0.1, ffn_dropout_p=0.1, rope_base=cfg["rope_base"]).items():
            setattr(hf, k, v)
        torch.manual_seed(0)
        model = kv.LlamaForCausalLM(hf).eval()
        randomize(model, seed=4)
        round_fp16(model)
        T, N, V = cfg["cls_token_num"], cfg["block_size"], cfg["vocab_size"]
        g = torch.Generator().manual_seed(5)
        valid = [5, T, 1]
        emb_mask = left_padded_mask(valid, T)
        caption = torch.randn(len(valid), T, cfg["caption_dim"], generator=g) * emb_mask[:, :, None]
        tokens = torch.randint(0, V, (len(valid), N), generator=g)
        uncond = torch.zeros_like(caption) + model.model.cls_embedding.uncond_embedding
        cond_combined = torch.cat([caption, uncond])
        attn = torch.cat([emb_mask, emb_mask])
        full_mask = torch.cat([attn, torch.ones(attn.shape[0], N - 1, dtype=attn.dtype)], 1)
        full_ids = torch.cat([tokens, tokens])[:, :N - 1]

        def forward(mask_dtype):
            """LANTERN ran in bf16 (``--precision bf16``, the default of generate_images.py and
            generate_train_data.py): ``_expand_mask`` then fills padded keys with finfo(bf16).min
            while ``_make_causal_mask`` uses finfo(fp32).min, and the sum and the softmax are fp32.
            ``mask_dtype=torch.bfloat16`` reproduces exactly that mask in this fp32 run (the
            constant is exact in fp32); ``None`` is a plain fp32 run (both minima equal)."""
            orig = kv._expand_mask
            if mask_dtype is not None:
                kv._expand_mask = lambda m, dtype, tgt_len=None: orig(m, mask_dtype, tgt_len).to(dtype)
            try:
                with torch.no_grad():
                    pre = model(cond_idx=cond_combined, attention_mask=attn, output_hidden_states=True, return_dict=True)
                    full = model(cond_idx=cond_combined, input_ids=full_ids, attention_mask=full_mask,
                                 output_hidden_states=True, return_dict=True)
            finally:
                kv._expand_mask = orig
            return pre, full

        pre, full = forward(torch.bfloat16)
        pre32, full32 = forward(None)
        # logits only where they predict image tokens (the text slots' logits are never used)
        out = {"prefill_hidden": pre.hidden_states[-1], "full_hidden": full.hidden_states[-1],
               "full_logits_image": full.logits[:, T - 1:],
               "prefill_hidden_fp32mask": pre32.hidden_states[-1]}
        save(out_dir, "lantern_llamagen", "lantern_llamagen", dict(model.state_dict()),
             {"caption": caption, "emb_mask": emb_mask, "tokens": tokens}, out,
             dict(cfg, ffn_hidden=ffn, cfg_scale="[cond; uncond] rows, uncond = uncond_embedding"), manifest,
             UPSTREAM_REPOS["lantern"], commit,
             "models/kv_variants/modeling_llamagen_kv.py (LlamaForCausalLM; T5Embedder stubbed)", tolerance=2e-4,
             note="rows [cond x3; uncond x3], captions with 5/120/1 valid slots; prefill hidden (after final norm) of "
                  "every text slot and the teacher-forced sequence [text, x_0..x_14] (logits from slot T-1 on), with the mask "
                  "constants of LANTERN's bf16 runs (finfo(bf16).min on padded keys); prefill_hidden_fp32mask: the prefill in a plain fp32 run")


def make_lantern_eagle(root: Path, out_dir: Path, manifest: dict) -> None:
    """LANTERN's EAGLE-1 head for LlamaGen (``models/drafters/cnets_llamagen.py`` Model): a
    whole-sequence forward over (token, feature) pairs. input_type t2i fixes its RoPE grid to 16x16
    and 119 text slots (zero rotation), so positions 0..118 are text and 119 + j image token j."""
    commit = checkout_commit(root)
    with upstream_path(root, ("models", "entrypoints", "third_party")):
        cn = importlib.import_module("models.drafters.cnets_llamagen")
        EConfig = importlib.import_module("models.configs.configs").EConfig
        cfg = dict(hidden_size=64, num_attention_heads=4, intermediate_size=176, vocab_size=256, rms_norm_eps=1e-6,
                   num_hidden_layers=1, input_type="t2i", hidden_act="silu", bias=True)
        econf = EConfig(**{k: v for k, v in cfg.items() if k != "bias"})
        torch.manual_seed(0)
        head = cn.Model(econf, bias=True).eval()
        randomize(head, seed=6, std=0.1)
        round_fp16(head)
        head.gradient_checkpointing = False
        g = torch.Generator().manual_seed(7)
        B, n_text, n_img = 2, 119, 24
        L = n_text + n_img
        ids = torch.randint(0, cfg["vocab_size"], (B, L), generator=g)
        feats = torch.randn(B, L, cfg["hidden_size"], generator=g)
        lm_head = 0.1 * torch.randn(cfg["vocab_size"], cfg["hidden_size"], generator=g)
        # the root step of topK_genrate after a prefill with CFG: rows [cond x2; uncond x2] of 120 target
        # features (119 text slots + the last slot's), ids [0]*119 + [x_0] shared by the halves
        # (``input_ids[:, 1:]``), logits head(last hidden), then its cfg_logit_process
        cfg_feats = torch.randn(2 * B, n_text + 1, cfg["hidden_size"], generator=g)
        x0 = torch.randint(0, cfg["vocab_size"], (B,), generator=g)
        cfg_ids = torch.zeros(2 * B, n_text + 1, dtype=torch.long)
        cfg_ids[:, -1] = torch.cat([x0, x0])
        with torch.no_grad():
            hidden = head(feats, ids)
            logits = hidden @ lm_head.T
            root = cn.cfg_logit_process(head(cfg_feats, cfg_ids)[:, -1] @ lm_head.T, 7.5)
        save(out_dir, "lantern_eagle_llamagen", "lantern_eagle", dict(head.state_dict()),
             {"input_ids": ids, "features": feats, "lm_head": lm_head, "cfg_features": cfg_feats, "x0": x0},
             {"hidden": hidden, "logits": logits, "root_logits_cfg7.5": root},
             dict(cfg, block_size=256, n_text=n_text), manifest, UPSTREAM_REPOS["lantern"], commit,
             "models/drafters/cnets_llamagen.py (Model.forward, whole sequence, causal)", tolerance=1e-4,
             note="2 sequences of 119 text slots + 24 image entries; causal; logits = hidden @ lm_head.T; "
                  "root logits of topK_genrate after a CFG prefill (cfg_logit_process, scale 7.5)")


def make_lantern_eagle_lumina(root: Path, out_dir: Path, manifest: dict) -> None:
    """LANTERN's EAGLE-1 head for Lumina-mGPT (``models/drafters/cnets_lumina_mgpt.py`` Model, built
    from an ``EConfig`` as ``ea_model_lumina_mgpt.py`` does, with ``data/configs/lumina_mgpt_config.json``'s
    settings at tiny size): a whole-sequence causal forward over (BPE id, feature) pairs at positions
    0..L-1 (1D RoPE); Chameleon decoder layer WITH input_layernorm and (1, head_dim) q/k norms."""
    commit = checkout_commit(root)
    with upstream_path(root, ("models", "entrypoints", "third_party")):
        cn = importlib.import_module("models.drafters.cnets_lumina_mgpt")
        EConfig = importlib.import_module("models.configs.configs").EConfig
        cfg = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=256, rms_norm_eps=1e-5,
                   rope_theta=10000.0, num_hidden_layers=1, bias=True)
        econf = EConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=4, rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
                        max_position_embeddings=4096, attention_bias=False, attention_dropout=0.0, dropout=0.05,
                        mlp_bias=False, model_parallel_size=1, swin_norm=False, attn_implementation="eager")
        torch.manual_seed(0)
        head = cn.Model(econf, bias=True).eval()
        randomize(head, seed=17, std=0.1)
        round_fp16(head)
        head.gradient_checkpointing = False
        g = torch.Generator().manual_seed(18)
        B, L = 2, 40
        ids = torch.randint(0, cfg["vocab_size"], (B, L), generator=g)
        feats = torch.randn(B, L, cfg["hidden_size"], generator=g)
        with torch.no_grad():
            hidden = head(feats, ids)
        save(out_dir, "lantern_eagle_lumina", "lantern_eagle_lumina", dict(head.state_dict()),
             {"input_ids": ids, "features": feats}, {"hidden": hidden}, cfg, manifest, UPSTREAM_REPOS["lantern"],
             commit, "models/drafters/cnets_lumina_mgpt.py (Model.forward, whole sequence, causal)", tolerance=2e-5,
             note="2 sequences of 40 (id, feature) entries at positions 0..39; eval (no dropout)")


# ------------------------------------------------------------------------------------ Lumina-mGPT / Chameleon
LUMINA_IDS = dict(image_start=8197, image_end=8196, newline=8803, grid_base=8804)


def image_name(code: int) -> str:
    """Chameleon's image-token name of a VQ code: IMGIMG + its digits as letters A..J + Z."""
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(code)) + "Z"


def sparse_rows(weights: dict, keys: tuple[str, ...], live: torch.Tensor) -> dict:
    """The vocabulary-sized matrices zeroed outside ``live`` ids are stored as their live rows
    (``<key>.rows``) plus ``<key>.index``: the test rebuilds the dense matrix (zeros elsewhere)."""
    out = {}
    for k in keys:
        w = weights.pop(k)
        assert bool((w[~torch.isin(torch.arange(w.shape[0]), live)] == 0).all())
        out[f"{k}.rows"], out[f"{k}.index"] = w[live], live
    return out


def make_lumina_chameleon(root: Path, out_dir: Path, manifest: dict) -> None:
    """Lumina-mGPT's vendored Chameleon (``lumina_mgpt/model/chameleon/modeling_chameleon.py``,
    q/k-norm weights (1, head_dim)) generating a 4x4-latent image with row ends under Lumina's own
    CFG logits processor (``inference_solver.py``:
    ``LLMImageStartTriggeredUnbatchedClassifierFreeGuidanceLogitsProcessor``, its uncond context
    starting at ``<racm3:break>`` with its own DynamicCache), one step per forced token. The vocabulary
    is 8960 so the hard-coded ids (8197, 8803, 8804 + grids) exist; the embedding and lm_head rows of
    ids the fixture never uses are zero and not stored (size)."""
    commit = checkout_commit(root)
    with upstream_path(root / "lumina_mgpt", ("model", "data", "xllmx")):
        # inference_solver imports data.item_processor (xllmx, tokenizers); only the CFG processor is used
        for name in ("data", "data.item_processor"):
            stub = types.ModuleType(name)
            stub.FlexARItemProcessor = None
            stub.__path__ = []
            sys.modules[name] = stub
        mc = importlib.import_module("model.chameleon.modeling_chameleon")
        cc = importlib.import_module("model.chameleon.configuration_chameleon")
        solver = importlib.import_module("inference_solver")
        n_codes, V, h = 32, 8960, 4
        g = torch.Generator().manual_seed(8)
        code_to_bpe = 4 + torch.randperm(n_codes, generator=g)
        vmap = {image_name(c): int(code_to_bpe[c]) for c in range(n_codes)}
        cfg = dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, vocab_size=V,
                   rms_norm_eps=1e-5, rope_theta=10000.0)
        conf = cc.ChameleonConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-5,
                                  vocabulary_map=vmap, mask_image_logits=False, model_parallel_size=1,
                                  vq_config=dict(embed_dim=8, num_embeddings=16, base_channels=32, latent_channels=8,
                                                 channel_multiplier=[1], num_res_blocks=1, resolution=16),
                                  attn_implementation="eager")
        torch.manual_seed(0)
        model = mc.ChameleonForConditionalGeneration(conf).eval()
        prompts = [torch.randint(40, 8000, (7,), generator=g), torch.randint(40, 8000, (11,), generator=g)]
        prompts[0][0] = prompts[1][0] = 0  # a BOS-like first id
        struct = torch.tensor([LUMINA_IDS["image_start"], LUMINA_IDS["grid_base"] + h // 2,
                               LUMINA_IDS["grid_base"] + h // 2, LUMINA_IDS["newline"], LUMINA_IDS["image_end"]])
        live = torch.unique(torch.cat(prompts + [code_to_bpe, struct]))
        randomize(model, seed=9, std=0.15)
        with torch.no_grad():
            dead = ~torch.isin(torch.arange(V), live)
            model.model.embed_tokens.weight[dead] = 0
            model.lm_head.weight[dead] = 0
        round_fp16(model)
        codes = torch.randint(0, n_codes, (2, h * h), generator=g)
        cfg_scale = 3.0
        def run(prompt: torch.Tensor, image_codes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            """Lumina's generation forced to ``image_codes`` (a newline after every full row but
            the last), one step per token through a fresh CFG processor: (CFG, cond) logits over
            the image codes for every step that predicts an image token, (len(image_codes), n_codes)."""
            seq, kinds = prompt.tolist() + struct[:3].tolist(), []
            for j, code in enumerate(image_codes):
                seq.append(int(code_to_bpe[code]))
                kinds.append(True)
                if (j + 1) % h == 0 and j + 1 < h * h:
                    seq.append(LUMINA_IDS["newline"])
                    kinds.append(False)
            seq = torch.tensor(seq)[None]
            proc = solver.LLMImageStartTriggeredUnbatchedClassifierFreeGuidanceLogitsProcessor(
                cfg_scale, model, LUMINA_IDS["image_start"], LUMINA_IDS["image_end"], LUMINA_IDS["newline"], 32)
            start = len(prompt) + 3
            rows_cfg, rows_cond = [], []
            with torch.no_grad():
                for i, is_image in enumerate(kinds):  # predicting seq[start + i]
                    prefix = seq[:, :start + i]
                    scores = model(prefix).logits[:, -1].float()
                    guided = proc(prefix, scores.clone())
                    if is_image:
                        rows_cfg.append(guided[0, code_to_bpe])
                        rows_cond.append(scores[0, code_to_bpe])
            return torch.stack(rows_cfg), torch.stack(rows_cond)

        want_cfg, want_cond = zip(*[run(p, codes[b].tolist()) for b, p in enumerate(prompts)])
        # a tree after 2 committed image tokens, crossing the first row end (position 3): node i's
        # logits are those upstream gives after [prefix, branch to i] (after the newline if i ends a row)
        n_pre = 2
        tree_codes = torch.randint(0, n_codes, (2, len(TREE_PARENTS)), generator=g)
        tree_cfg = torch.zeros(2, len(TREE_PARENTS), n_codes)
        for b, p in enumerate(prompts):
            for i, path in enumerate(tree_paths(TREE_PARENTS)):
                branch = codes[b, :n_pre].tolist() + tree_codes[b, path].tolist()
                tree_cfg[b, i] = run(p, branch + [0])[0][-1]  # + a dummy code: the step predicting it
        weights = {k: v for k, v in model.state_dict().items() if not k.startswith("model.vqmodel.")}
        sparse = sparse_rows(weights, ("model.embed_tokens.weight", "lm_head.weight"), live)
        weights.update(sparse)
        inputs = {"prompt_0": prompts[0], "prompt_1": prompts[1], "codes": codes, "code_to_bpe": code_to_bpe,
                  "tree_parents": torch.tensor(TREE_PARENTS), "tree_codes": tree_codes,
                  "tree_prefix": codes[:, :n_pre]}
        out = {"image_logits_cfg3": torch.stack(want_cfg), "image_logits_cond": torch.stack(want_cond),
               "tree_logits_cfg3": tree_cfg}
        save(out_dir, "lumina_chameleon", "lumina", weights, inputs, out,
             dict(cfg, h_latent=h, w_latent=h, n_codes=n_codes, cfg_scale=cfg_scale, **LUMINA_IDS), manifest,
             "Alpha-VLLM/Lumina-mGPT", commit,
             "lumina_mgpt/model/chameleon/modeling_chameleon.py (ChameleonForConditionalGeneration), "
             "lumina_mgpt/inference_solver.py (LLMImageStartTriggeredUnbatchedClassifierFreeGuidanceLogitsProcessor)",
             tolerance=5e-5,
             note="2 prompts (7 / 11 ids), <racm3:break> h w, a 4x4 latent with a newline after rows 1-3; logits "
                  "over the 32 image codes (lm_head rows in code order) for every image token, CFG 3 and cond-only; a 9-node "
                  "depth-4 tree after 2 image tokens crossing the first row end, each node from upstream run on its branch")


def make_vqgan(root: Path, out_dir: Path, manifest: dict) -> None:
    """Lumina's ``chameleon_vae_ori`` (taming VQModel) decode as its ``ImageTokenizer.pil_from_img_toks``
    runs it (codebook rows -> post_quant_conv -> decoder), at small widths; plus the uint8 pixels its
    ``_pil_from_chw_tensor`` makes (clamp, (x + 1) / 2, * 255, truncation)."""
    commit = checkout_commit(root)
    with upstream_path(root / "lumina_mgpt", ("model",)):
        vq = importlib.import_module("model.chameleon_vae_ori.vqgan")
        it = importlib.import_module("model.chameleon_vae_ori.image_tokenizer")
        dd = dict(double_z=False, z_channels=32, resolution=16, in_channels=3, out_ch=3, ch=32, ch_mult=[1, 2],
                  num_res_blocks=1, attn_resolutions=[], dropout=0.0)
        n_embed, embed_dim = 64, 8
        torch.manual_seed(0)
        model = vq.VQModel(dd, n_embed, embed_dim).eval()
        g = torch.Generator().manual_seed(10)
        with torch.no_grad():
            model.quantize.embedding.weight.normal_(generator=g)
            for name, p in model.named_parameters():
                if name.endswith("bias") or ("norm" in name and name.endswith("weight")):
                    p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
        round_fp16(model)
        hh, ww = 4, 6
        codes = torch.randint(0, n_embed, (2, hh * ww), generator=g)
        fake = types.SimpleNamespace(_vq_model=model)
        fake._pil_from_chw_tensor = lambda t: it.ImageTokenizer._pil_from_chw_tensor(fake, t)
        import numpy as np
        with torch.no_grad():
            raw = torch.stack([model.decode(model.quantize.get_codebook_entry(c, (1, hh, ww, embed_dim)))[0] for c in codes])
            pix = torch.stack([torch.from_numpy(np.asarray(it.ImageTokenizer.pil_from_img_toks(fake, c, hh, ww)).copy())
                               for c in codes])
        weights = {k: v for k, v in model.state_dict().items() if k.split(".")[0] in ("decoder", "post_quant_conv", "quantize")}
        cfg = dict(n_embed=n_embed, embed_dim=embed_dim, ch=dd["ch"], ch_mult=dd["ch_mult"], num_res_blocks=1,
                   z_channels=dd["z_channels"], resolution=dd["resolution"], h=hh, w=ww)
        save(out_dir, "chameleon_vqgan", "chameleon_vqgan", weights, {"codes": codes},
             {"decoded": raw, "pixels_uint8": pix}, cfg, manifest, "Alpha-VLLM/Lumina-mGPT", commit,
             "lumina_mgpt/model/chameleon_vae_ori/vqgan.py (VQModel), image_tokenizer.py (pil_from_img_toks)",
             tolerance=1e-5, note="2 code grids of 4x6 (non-square); decoder output and upstream's uint8 pixels")


def make_hf_chameleon(out_dir: Path, manifest: dict) -> None:
    """transformers' ``ChameleonForConditionalGeneration`` (q/k-norm weights (num_heads, head_dim),
    distinct per head): the plain forward's last hidden state and logits on random ids."""
    import transformers
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration

    conf = ChameleonConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-5, vocabulary_map={},
                           vq_config=dict(embed_dim=8, num_embeddings=16, base_channels=32, latent_channels=8,
                                          channel_multiplier=[1], num_res_blocks=1, resolution=16),
                           attn_implementation="eager")
    torch.manual_seed(0)
    model = ChameleonForConditionalGeneration(conf).eval()
    randomize(model, seed=11)
    round_fp16(model)
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(0, 256, (2, 12), generator=g)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True, return_dict=True)
    weights = {k: v for k, v in model.state_dict().items() if not k.startswith("model.vqmodel.")}
    cfg = dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, vocab_size=256, rms_norm_eps=1e-5,
               rope_theta=10000.0)
    save(out_dir, "hf_chameleon", "hf_chameleon", weights, {"input_ids": ids},
         {"hidden": out.hidden_states[-1], "logits": out.logits}, cfg, manifest, "huggingface/transformers",
         f"v{transformers.__version__}", "transformers/models/chameleon/modeling_chameleon.py (pip package)",
         tolerance=2e-5, note="2 sequences of 12 random ids, causal, per-head q/k norms")


# ------------------------------------------------------------------------------------ T5 caption path
EDGE_CAPTIONS = [
    "A <b>bold</b> &amp; &quot;quoted&quot; caption", "see https://example.com/x?a=1 and www.test.org/page",
    "Photo by @someone #hashtag #another", "<person> riding a horse", "100% cotton, 2,000 units, 3.5kg",
    "IMG_1234.jpg a cat", "a dog\u2019s \u201cball\u201d \u2014 red", "Ｆｕｌｌｗｉｄｔｈ ｔｅｘｔ", "emoji \U0001F600 smile",
    "A%20URL%20encoded+caption", "   padded   spaces   ", "ALL CAPS CAPTION!!!", "a -- b --- c", "(parens) [brackets] {braces}",
    "free shipping on orders over $50", "1920x1080 wallpaper", "a photo of a cat ... ... ...", "x" * 300,
    "\u0440\u0443\u0441\u0441\u043a\u0438\u0439 \u0442\u0435\u043a\u0441\u0442 and \u4e2d\u6587", "a\tb\nc", "",
    # captions whose cleaning needs upstream's SECOND pass (edge punctuation, nested quotes, spam)
    "A plate of food,,", ";;A dog", "\" 'A cat' \"", "A dog, free shipping", "Server 192.168.0.1 rack",
    "this_is_my_cute_cat", "A cat\\nsleeping", "&amp;quot;Hi&amp;quot; there", "\ufb01sh on a plate", "Posted at 3:45 <br>",
    "A cat,a dog and a bird.Outside", "A ''big'' dog", "What a dog!!!",
]


def make_t5(root: Path, out_dir: Path, manifest: dict) -> None:
    """LlamaGen's ``language/t5.py`` ``T5Embedder``: its caption cleaning (``text_preprocessing``,
    two passes of the PixArt cleaner) on PartiPrompts, 500 COCO val2017 captions (LANTERN's prompt
    files, if given) and edge cases; its ``get_text_embeddings`` on a tiny random T5 encoder with a
    small word-level tokenizer (saved beside the fixture; the tokenizer is not under test, the
    call is: max_length, padding, truncation, special tokens), then the left padding of
    ``autoregressive/sample/sample_t2i.py`` (valid rows rotated to the end, mask flipped; the
    script's lines 95-105, re-expressed here because a script cannot be imported).
    ``T5Embedder.__init__`` downloads / loads FLAN-T5, so the object is made without it."""
    commit = checkout_commit(root)
    captions = list(EDGE_CAPTIONS)
    lantern = manifest.get("_lantern_root")
    if lantern:
        import csv
        with open(Path(lantern) / "data/prompts/PartiPrompts.tsv") as f:
            captions += [r["Prompt"] for r in csv.DictReader(f, delimiter="\t")]
        coco = json.loads((Path(lantern) / "data/prompts/captions_val2017.json").read_text())
        captions += [a["caption"] for a in coco["annotations"][:500]]
    with upstream_path(root, ("language",)):
        t5 = importlib.import_module("language.t5")
        emb = object.__new__(t5.T5Embedder)
        emb.use_text_preprocessing = True
        cleaned = [emb.text_preprocessing(c) for c in captions]
        (out_dir / "t5_captions.json").write_text(json.dumps({"captions": captions, "cleaned": cleaned}, indent=0) + "\n")
        manifest["files"]["t5_captions.json"] = {
            "family": "t5", "upstream_repo": UPSTREAM_REPOS["llamagen"], "upstream_commit": commit,
            "upstream_source": "language/t5.py (T5Embedder.text_preprocessing)", "command": manifest["command"],
            "tolerance_max_abs": 0.0, "note": f"{len(captions)} captions and upstream's cleaned text (exact match)"}
        print(f"wrote {out_dir / 't5_captions.json'} ({len(captions)} captions)")
        # tiny tokenizer + encoder
        from tokenizers import Tokenizer, models, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

        words = sorted({w for c in cleaned[:60] for w in c.split()})[:200]
        vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
        tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tk.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
        tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
        tok_dir = out_dir / "t5_tokenizer"
        tok_dir.mkdir(exist_ok=True)
        tok.save_pretrained(str(tok_dir))
        conf = T5Config(vocab_size=len(vocab), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                        feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False)
        torch.manual_seed(0)
        enc = T5EncoderModel(conf).eval()
        randomize(enc, seed=13, std=0.3, norm_keys=("layer_norm",))
        round_fp16(enc)
        emb.tokenizer, emb.model, emb.device, emb.model_max_length = tok, enc, torch.device("cpu"), 16
        # by cleaned length: the empty caption (only </s>), short, median, and the longest (truncated to 16)
        order = sorted(range(len(captions)), key=lambda i: (len(tok(cleaned[i])["input_ids"]), i))
        picks = [order[0], order[len(order) // 10], order[len(order) // 2], order[-1], order[-2]]
        texts = [captions[i] for i in picks]
        embs, mask = emb.get_text_embeddings(texts)
        # sample_t2i.py: new_emb_masks = flip(emb_masks); valid rows moved to the end
        new_mask = torch.flip(mask, dims=[-1])
        new_embs = torch.stack([torch.cat([e[int(m.sum()):], e[:int(m.sum())]]) for e, m in zip(embs, mask)])
        weights = dict(enc.state_dict())
        weights.pop("encoder.embed_tokens.weight", None)  # tied to shared.weight
        save(out_dir, "t5_features", "t5", weights, {"text_index": torch.tensor(picks)},
             {"caption_embs": new_embs, "emb_mask": new_mask, "right_padded_embs": embs, "attention_mask": mask},
             dict(conf.to_diff_dict(), max_length=16), manifest, UPSTREAM_REPOS["llamagen"], commit,
             "language/t5.py (T5Embedder.get_text_embeddings) + sample_t2i.py left padding", tolerance=2e-5,
             note="5 captions (indices into t5_captions.json) through a tiny random T5 encoder, max_length 16; "
                  "tokenizer in t5_tokenizer/")


# ------------------------------------------------------------------------------------ MAR
class _TorchvisionStub:
    """timm (imported by MAR's ``models/mar.py`` for ``Block``) imports torchvision, whose PyPI wheels
    do not import beside our torch build. Only ``timm.models.vision_transformer.Block`` is used, which
    never touches torchvision: this meta-path finder serves empty permissive ``torchvision*``
    modules for the duration of the MAR imports only."""

    def __enter__(self):
        import importlib.abc
        import importlib.machinery

        class Any_:
            def __init__(self, *a, **k): pass
            def __call__(self, *a, **k): return Any_()
            def __getattr__(self, n): return Any_()
            def __mro_entries__(self, bases): return (object,)

        class Stub(types.ModuleType):
            def __getattr__(self, name):
                if name.startswith("__"):
                    raise AttributeError(name)
                return Any_()

        class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
            def find_spec(self, name, path=None, target=None):
                if name == "torchvision" or name.startswith("torchvision."):
                    return importlib.machinery.ModuleSpec(name, self, is_package=True)

            def create_module(self, spec):
                m = Stub(spec.name)
                m.__path__, m.__version__ = [], "0.0.0+stub"
                return m

            def exec_module(self, m):
                pass

        self.finder = Finder()
        sys.meta_path.insert(0, self.finder)
        return self

    def __exit__(self, *exc):
        sys.meta_path.remove(self.finder)
        for name in list(sys.modules):
            if name == "torchvision" or name.startswith("torchvision."):
                del sys.modules[name]


def make_mar(root: Path, out_dir: Path, manifest: dict) -> None:
    """LTH14/mar ``models/mar.py``: ``forward_mae_encoder`` + ``forward_mae_decoder`` (the condition
    z of every position given the known tokens; MAE drops the masked tokens) with a class label and
    with ``fake_latent`` (CFG's unconditional branch, as ``sample_tokens`` builds it), and the DiffLoss
    network ``SimpleMLPAdaLN`` (``models/diffloss.py``) on (x, t, z). Tiny: 4x4 tokens of 16 dims,
    width 64, 2 + 2 blocks, buffer 4, head 2 x 64."""
    commit = checkout_commit(root)
    with _TorchvisionStub(), upstream_path(root, ("models", "diffusion", "util")):
        mm = importlib.import_module("models.mar")
        cfg = dict(seq_len=16, token_dim=16, encoder_dim=64, encoder_depth=2, encoder_heads=4, decoder_dim=64,
                   decoder_depth=2, decoder_heads=4, mlp_ratio=4.0, buffer_size=4, n_classes=10, head_width=64,
                   head_depth=2)
        torch.manual_seed(0)
        model = mm.MAR(img_size=64, vae_stride=16, patch_size=1, encoder_embed_dim=64, encoder_depth=2,
                       encoder_num_heads=4, decoder_embed_dim=64, decoder_depth=2, decoder_num_heads=4, mlp_ratio=4.0,
                       vae_embed_dim=16, class_num=10, buffer_size=4, diffloss_d=2, diffloss_w=64,
                       norm_layer=functools.partial(torch.nn.LayerNorm, eps=1e-6)).eval()  # as mar_base/large/huge
        randomize(model, seed=14, std=0.1, norm_keys=("norm", "_ln"))
        round_fp16(model)
        g = torch.Generator().manual_seed(15)
        B, L = 3, 16
        tokens = torch.randn(B, L, 16, generator=g)
        mask = torch.zeros(B, L)  # 1 = unknown (masked); equal counts per row (upstream's reshape)
        for b in range(B):
            mask[b, torch.randperm(L, generator=g)[:11]] = 1
        labels = torch.tensor([3, 7, -1])  # -1: the unconditional row (fake_latent)
        with torch.no_grad():
            ce = model.class_emb(labels.clamp(min=0))
            ce[labels < 0] = model.fake_latent
            z = model.forward_mae_decoder(model.forward_mae_encoder(tokens, mask, ce), mask)
            N = 8
            x = torch.randn(N, 16, generator=g)
            t = torch.randint(0, 1000, (N,), generator=g)
            c = torch.randn(N, 64, generator=g)
            head_out = model.diffloss.net(x, t, c)
        save(out_dir, "mar", "mar", dict(model.state_dict()),
             {"tokens": tokens, "mask": mask, "labels": labels, "head_x": x, "head_t": t, "head_z": c},
             {"z": z, "head_out": head_out}, cfg, manifest, "LTH14/mar", commit,
             "models/mar.py (forward_mae_encoder, forward_mae_decoder), models/diffloss.py (SimpleMLPAdaLN)",
             tolerance=2e-5, note="3 rows with 5 known of 16 tokens (labels 3, 7, unconditional); head on 8 (x, t, z)")


def make_kl16(root: Path, out_dir: Path, manifest: dict) -> None:
    """LTH14/mar ``models/vae.py`` AutoencoderKL decode (KL-16's architecture at small width: the
    upstream Decoder built with ch=32, ch_mult (1, 2), one res block; AutoencoderKL does not expose
    ch), on latents of a 4x4 and a 3x5 grid."""
    commit = checkout_commit(root)
    with upstream_path(root, ("models", "diffusion", "util")):
        vae = importlib.import_module("models.vae")
        cfg = dict(embed_dim=16, ch=32, ch_mult=[1, 2], num_res_blocks=1, z_channels=16, resolution=16)
        torch.manual_seed(0)
        model = vae.AutoencoderKL(embed_dim=16, ch_mult=(1, 2)).eval()
        model.decoder = vae.Decoder(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=16, resolution=16).eval()
        g = torch.Generator().manual_seed(16)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias") or ("norm" in name and name.endswith("weight")):
                    p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
        round_fp16(model)
        lat = {"latents_4x4": torch.randn(2, 16, 4, 4, generator=g), "latents_3x5": torch.randn(1, 16, 3, 5, generator=g)}
        with torch.no_grad():
            out = {k.replace("latents", "decoded"): model.decode(v) for k, v in lat.items()}
        weights = {k: v for k, v in model.state_dict().items() if k.split(".")[0] in ("decoder", "post_quant_conv")}
        save(out_dir, "kl16_vae", "kl16_vae", weights, lat, out, cfg, manifest, "LTH14/mar", commit,
             "models/vae.py (AutoencoderKL.decode)", tolerance=2e-5, note="decode-side weights only (size)")


# ------------------------------------------------------------------------------------ xAR
@contextlib.contextmanager
def _xar_environment():
    """What OliverRensu/xAR's ``models/xar.py`` needs beyond timm and einops, for its import and run
    only: ``flash_attn`` (imported at xar.py:21, never called) as an empty module, torchvision for timm
    (``_TorchvisionStub``; xar.py:11-12 use ``timm.layers.SwiGLU`` and two unused timm names), and
    ``torch.Tensor.cuda`` as the identity (``.cuda()`` is hard-coded at xar.py:456, 471 and
    sampler.py:74, 132, 176; this run is on the CPU). Everything is restored afterwards."""
    flash = types.ModuleType("flash_attn")
    flash.flash_attn_func = None
    had, saved = "flash_attn" in sys.modules, sys.modules.get("flash_attn")
    sys.modules["flash_attn"] = flash
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        with _TorchvisionStub():
            yield
    finally:
        torch.Tensor.cuda = cuda
        if had:
            sys.modules["flash_attn"] = saved
        else:
            sys.modules.pop("flash_attn", None)


@contextlib.contextmanager
def _patched(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield old
    finally:
        setattr(obj, name, old)


def make_xar(root: Path, out_dir: Path, manifest: dict) -> None:
    """OliverRensu/xAR ``models/xar.py`` (with ``models/rope.py``) and ``models/sampler.py`` on a tiny
    random xAR: width 32, 2 heads (head_dim 16), 2 + 2 blocks, SwiGLU hidden 85, at upstream's
    hard-coded geometry (16x16 tokens of 16 dims in 4 cells of 8x8; 1001 class rows).

    (a) The network without a cache: ``forward_mae_encoder`` + ``forward_mae_decoder`` on the whole
        cell-ordered sequence with ``self.mask`` (the training branch of ``Attention``, dropout 0;
        ``model.forward`` itself is not called: it draws its own label drop, times and noise), rows
        labelled 3, 7 and the null class 1000, each cell at its own time (condition rows cell-major,
        as xar.py:429 builds them).
    (b) ``sample_tokens(num_steps=4, cfg=3.0)`` for labels (3, 7) with injected noise: ``torch.randn``
        (the latents, xar.py:471) and ``torch.randn_like`` (the step noise, sampler.py:139) pop
        pre-drawn tensors in upstream's call order (per cell: one latent, then num_steps - 1 noises);
        ``sampler.get_score_from_velocity`` is wrapped to record the fp64 state and the raw fp64
        velocities (both CFG halves) of every step, ``model.sample_inference`` to check the call
        pattern (the context fed with the first step of cells 1-3 at t = 0, then cache-only calls).

    Size (< 1 MB): the inputs are fp16 values (stored as fp16; upstream ran them as fp32 / fp64), the
    states are stored as fp32 (upstream's are fp64: the rounding is 6e-8 relative), and upstream's
    per-block RoPE buffers, asserted equal across blocks, are stored once (config "shared_buffers"
    names the keys that hold the same tensor); the mask is stored as upstream holds it."""
    commit = checkout_commit(root)
    with _xar_environment(), upstream_path(root, ("models", "util")):
        xm = importlib.import_module("models.xar")
        sm = importlib.import_module("models.sampler")
        versions = ", ".join(f"{n} {importlib.import_module(n).__version__}" for n in ("timm", "einops"))
        model_cfg = dict(grid=16, cell=8, token_dim=16, dim=32, encoder_depth=2, decoder_depth=2, heads=2,
                         mlp_ratio=4.0, n_classes=1000)
        torch.manual_seed(0)
        model = xm.xAR(img_size=256, vae_stride=16, patch_size=1, encoder_embed_dim=32, encoder_depth=2,
                       encoder_num_heads=2, decoder_embed_dim=32, decoder_depth=2, decoder_num_heads=2, mlp_ratio=4,
                       vae_embed_dim=16, clusters=4).eval()
        randomize(model, seed=21, std=0.15, norm_keys=("norm", "_ln"))
        round_fp16(model)
        g = torch.Generator().manual_seed(22)
        n_cells, cell_len, C = 4, 64, 16

        # (a) the network, cache-free
        seq = torch.randn(3, n_cells * cell_len, C, generator=g).half()
        labels = torch.tensor([3, 7, 1000])
        t = torch.tensor([[0., 0., 0.37, 0.9], [1., 0.5, 0.5, 0.04], [0.25, 0.68, 0., 1.]])  # (row, cell)
        model.train()  # whole sequence with self.mask, no cache (xar.py:119-128); all dropouts are 0
        with torch.no_grad():
            cond = model.class_emb(labels).repeat(n_cells, 1) + model.time_embed((t.T.reshape(-1) * 1000).long())
            v_full = model.forward_mae_decoder(
                model.forward_mae_encoder(model.z_proj(seq.float()), cond, model.mask), cond, model.mask)
        model.eval()

        # (b) the sampler, injected noise
        num_steps, cfg_scale, s_labels = 4, 3.0, torch.tensor([3, 7])
        B = len(s_labels)
        latents = torch.randn(n_cells, B, cell_len, C, generator=g).half()
        eps = torch.randn(n_cells, num_steps - 1, B, cell_len, C, generator=g).half()
        queue = [item for s in range(n_cells)
                 for item in [("randn", latents[s])] + [("randn_like", e) for e in eps[s]]]

        def draw(kind, shape, dtype):
            want, value = queue.pop(0)
            assert want == kind and tuple(value.shape) == tuple(shape), (kind, want, tuple(shape))
            return value.to(dtype).clone()

        def randn(*size, **kw):
            shape = size[0] if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)) else size
            return draw("randn", shape, kw.get("dtype") or torch.float32)

        def randn_like(x, **kw):
            assert x.dtype == torch.float64  # the fp64 state (sampler.py:118, 139)
            return draw("randn_like", x.shape, x.dtype)

        states, vels, calls = [], [], []

        def score(vt, xt, t_, path_type="linear"):
            states.append(xt.clone())
            vels.append(vt.clone())
            return score_fn(vt, xt, t_, path_type=path_type)

        infer = model.sample_inference

        def sample_inference(x, label, time_input, update_cache, scale_index, mask=None):
            calls.append((x.shape[1], bool(update_cache), scale_index, mask is not None,
                          sorted(set((time_input * 1000).long().tolist()))))
            return infer(x, label, time_input, update_cache, scale_index, mask)

        model.sample_inference = sample_inference
        with _patched(torch, "randn", randn), _patched(torch, "randn_like", randn_like), \
                _patched(sm, "get_score_from_velocity", score) as score_fn, torch.no_grad():
            tokens = model.sample_tokens(num_steps, cfg=cfg_scale, label=s_labels)
        del model.sample_inference
        assert not queue and len(states) == n_cells * num_steps
        grid = torch.cat([torch.linspace(1., 0.04, num_steps, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)])
        for s in range(n_cells):  # the call pattern this fixture pins (xar.py:469-472, sampler.py:126-152, 186-196)
            for i in range(num_steps):
                n_tok, update, index, masked, steps = calls[s * num_steps + i]
                first = i == 0
                assert (n_tok, update, index, masked) == (2 * cell_len if first and s else cell_len, first, s, first)
                # the integer timestep of the fp32 time: 680 for t = 0.6799999999999999 (fp64: 679)
                t32 = int((grid[i].float() * 1000).long())
                assert steps == sorted({t32} | ({0} if first and s else set())), (s, i, steps, float(grid[i]))
        x_all = torch.stack(states).reshape(n_cells, num_steps, 2 * B, cell_len, C)
        assert torch.equal(x_all[:, :, :B], x_all[:, :, B:])  # both CFG halves carry the same state
        v_all = torch.stack(vels).reshape(n_cells, num_steps, 2 * B, cell_len, C)
        assert torch.equal(v_all, v_all.float().double())  # the model's fp32 output, cast up
        assert torch.equal(x_all[:, 0, :B], latents.double())

        state = dict(model.state_dict())
        shared = {}
        for name in ("freqs", "freqs_cos", "freqs_sin"):
            keys = sorted(k for k in state if k.endswith(f".attn.rope.{name}"))
            first = f"encoder_blocks.0.attn.rope.{name}"
            assert all(torch.equal(state[k], state[first]) for k in keys)
            shared[first] = [k for k in keys if k != first]
            for k in shared[first]:
                del state[k]
        config = {"model": model_cfg, "sample": {"num_steps": num_steps, "cfg": cfg_scale},
                  "shared_buffers": shared}
        save(out_dir, "xar", "xar", state,
             {"seq": seq, "labels": labels, "t": t, "sample_labels": s_labels, "latents": latents, "eps": eps},
             {"v_full": v_full, "states": x_all[:, 1:, :B].float(), "v": v_all.float(), "tokens": tokens},
             config, manifest, UPSTREAM_REPOS["xar"], commit,
             "models/xar.py (forward_mae_encoder, forward_mae_decoder, sample_inference, sample_tokens), "
             "models/rope.py (VisionRotaryEmbeddingFast), models/sampler.py (euler_maruyama_sampler)",
             tolerance=2e-5,
             note="(a) v_full: cache-free network on 3 rows (labels 3, 7, null 1000), each cell at its own t "
                  "(in.t (row, cell)); (b) sample_tokens(num_steps=4, cfg=3) for labels 3, 7 with injected noise: "
                  "in.latents (cell, B, 64, 16), in.eps (cell, step, B, 64, 16); out.v (cell, step, 2B, 64, 16) "
                  "raw velocities (labelled rows, then null rows), out.states (cell, step, B, 64, 16) = the state "
                  "after each stochastic step (fp64 upstream, stored fp32), out.tokens (B, 16, 16, 16); inputs "
                  f"are fp16 values; RoPE buffers stored once (config shared_buffers); run with {versions}")


# ------------------------------------------------------------------------------------ Harmon
HARMON_INSTRUCTION = "<|im_start|>user\n{input}<|im_end|>\n<|im_start|>assistant\n"  # configs/models/*.py:14


@contextlib.contextmanager
def _harmon_environment():
    """What wusize/Harmon's ``src/models/harmon.py`` and ``src/models/mar/*`` need beyond transformers
    4.45, timm and einops, for their import and run only: ``src.builder`` (an mmengine ``Registry``,
    src/builder.py) as a module whose ``BUILDER.build(x)`` returns x, so that prebuilt modules are passed
    in; torchvision for timm (``_TorchvisionStub``; mar.py:12 uses ``timm...Block`` only); and
    ``torch.Tensor.cuda`` as the identity (``.cuda()`` is hard-coded at diffloss.py:38, 43 and
    gaussian_diffusion.py:494, 504; this run is on the CPU). Enter it inside ``upstream_path``
    (which purges ``src.*``). Everything is restored afterwards."""
    builder = types.ModuleType("src.builder")
    builder.BUILDER = types.SimpleNamespace(build=lambda x: x)
    sys.modules["src.builder"] = builder
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.cuda = cuda
        sys.modules.pop("src.builder", None)


def make_harmon(root: Path, out_dir: Path, manifest: dict) -> None:
    """wusize/Harmon ``src/models/harmon.py`` (``Harmon.forward_mae_encoder``, ``sample``) with its MAR
    (``src/models/mar/mar.py``, ``diffloss.py``, ``diffusion/``) on a tiny random Harmon: a
    transformers 4.45.2 ``Qwen2ForCausalLM`` (hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 128,
    rope_theta 1e6, tied embeddings, eager attention), a MAR on a 4x4 BASE grid (encoder = decoder width
    48 != the LLM's 64, 2 + 2 blocks of 4 heads, buffer 4, 10 classes, DiffLoss 2 x 64, 10 respaced
    steps), ``proj_in`` / ``proj_out``; the VAE is a stub (``embed_dim`` 16; ``Harmon.decode`` returns the
    tokens: KL-16's decode has its own fixture, kl16_vae). Recipe: docs/design/harmon_upstream.md 4.2.

    Prompts: input ids given directly (no tokenizer): two conditional prompts of 7 and 3 valid ids and
    a "null prompt" of 5 ids, right-padded to 7 with id 127 (an "eos") under a boolean mask, as
    ``prepare_text_conditions`` builds them (harmon.py:171-185). Rows: [p7, p3, null, null].
    (a) / (b) / (c) conditions, as ``Harmon.sample`` computes them (harmon.py:219-240): prefill of the
        prompts into a ``DynamicCache``, ``forward_mae_encoder`` with the cache and the prompt mask,
        ``curtail_cache``, ``mar.forward_mae_decoder``: (a) 4x4 with 5 of 16 tokens known per row,
        (b) 6x6 (bilinear position embeddings) with 13 of 36 known, (c) 4x4 with nothing known.
    (d) the DiffLoss network ``mar.diffloss.net(x, t, c)`` on 8 random rows.
    (e) ``Harmon.sample`` with ``mar.sample_orders`` returning saved orders and ``torch.randn`` /
        ``torch.randn_like`` drawing from a seeded generator, every draw recorded:
        e1: cfg 3.0 (constant), 4x4, num_iter 16 (one token per iteration: the continuous loop's
        protocol), temperature 0.9, prompts [p7, p3 | null, null]; e2: cfg 1.0, 6x6, num_iter 4 (several
        tokens per iteration), temperature 0.9, prompts [p7, p3]. Per iteration: the known mask before
        it, the mask of the tokens it predicts (upstream's ``mask_to_pred``, cond half), the initial
        noise (one ``randn``; its rows follow the row-major ``nonzero`` order of ``mask_to_pred``) and
        the K = 10 ``randn_like`` draws of the chain in call order (timestep K-1 first), of which only
        the conditional rows are stored (the unconditional half's noise moves rows that
        ``forward_with_cfg`` discards, diffloss.py:241-249), and the tokens after it.
    The head's v output is kept inside [-1, 1] (its v rows of ``final_layer.linear`` scaled by 0.2
    before the fp16 rounding; asserted for every call) because coolsd clamps v where upstream does not.
    A random head's epsilon is not the noise it sees, and the first respaced step (t = 999,
    alpha_bar ~ 2e-9) amplifies that error by 1 / sqrt(alpha_bar) ~ 2e4: the sampled tokens reach ~1e5,
    so the sample tolerance (config "sample_rel_tolerance") is relative to the largest upstream token."""
    commit = checkout_commit(root)
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.cache_utils import DynamicCache

    with _TorchvisionStub(), upstream_path(root, ("src",)), _harmon_environment():
        hm = importlib.import_module("src.models.harmon")
        mm = importlib.import_module("src.models.mar.mar")
        import transformers
        versions = ", ".join(f"{n} {importlib.import_module(n).__version__}"
                             for n in ("transformers", "timm", "einops"))
        assert transformers.__version__ == "4.45.2", versions
        llm_cfg = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "vocab_size": 128, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
                   "max_position_embeddings": 512}
        mar_cfg = {"seq_len": 16, "token_dim": 16, "encoder_dim": 48, "encoder_depth": 2, "encoder_heads": 4,
                   "decoder_dim": 48, "decoder_depth": 2, "decoder_heads": 4, "mlp_ratio": 4.0, "buffer_size": 4,
                   "n_classes": 10, "head_width": 64, "head_depth": 2}
        torch.manual_seed(0)
        llm = Qwen2ForCausalLM._from_config(Qwen2Config(tie_word_embeddings=True, **llm_cfg),
                                            attn_implementation="eager")
        mar = mm.MAR(img_size=64, vae_stride=16, patch_size=1, encoder_embed_dim=48, encoder_depth=2,
                     encoder_num_heads=4, decoder_embed_dim=48, decoder_depth=2, decoder_num_heads=4, mlp_ratio=4.0,
                     vae_embed_dim=16, buffer_size=4, class_num=10, diffloss_d=2, diffloss_w=64,
                     num_sampling_steps="10", norm_layer=functools.partial(torch.nn.LayerNorm, eps=1e-6))

        class VAEStub(torch.nn.Module):
            embed_dim = 16  # read by Harmon.token_embed_dim (harmon.py:72-73)

        model = hm.Harmon(vae=VAEStub(), vae_scale=0.2325, llm=llm, mar=mar, tokenizer=None,
                          prompt_template={"INSTRUCTION": HARMON_INSTRUCTION}).eval()
        assert model.llm.lm_head.weight is model.llm.model.embed_tokens.weight  # tied
        randomize(model, seed=31, std=0.1, norm_keys=("norm", "_ln"))
        with torch.no_grad():
            out_layer = model.mar.diffloss.net.final_layer.linear
            out_layer.weight[16:] *= 0.2  # the v half of the output (diffloss.py:245)
            out_layer.bias[16:] *= 0.2
        round_fp16(model)
        model.decode = lambda z: z.clone()  # the VAE stub: sample() returns the tokens (B, m, n, 16)

        g = torch.Generator().manual_seed(32)
        T, pad = 7, 127
        p7, p3, null = (torch.randint(0, 120, (n,), generator=g) for n in (7, 3, 5))

        def padded(rows):
            ids = torch.full((len(rows), T), pad, dtype=torch.long)
            am = torch.zeros(len(rows), T, dtype=torch.bool)
            for b, r in enumerate(rows):
                ids[b, :len(r)], am[b, :len(r)] = r, True
            return ids, am

        ids4, am4 = padded([p7, p3, null, null])

        def conditions(tokens, mask, m, n):  # Harmon.sample's per-iteration computation (harmon.py:219-240)
            emb = model.llm.get_input_embeddings()(ids4)
            cache = model.llm_model(inputs_embeds=emb, attention_mask=None, position_ids=None,
                                    past_key_values=DynamicCache.from_legacy_cache(), return_dict=True,
                                    use_cache=True).past_key_values
            x_enc = model.forward_mae_encoder(tokens.view(len(tokens), m, n, -1), mask, past_key_values=cache,
                                              attention_mask=am4)
            model.curtail_cache(cache, T)
            assert cache.get_seq_length() == T
            return model.mar.forward_mae_decoder(x_enc, mask, image_shape=(m, n))

        def random_mask(B, L, n_known):  # 1 = unknown; equal counts per row (upstream's reshape)
            mask = torch.ones(B, L)
            for b in range(B):
                mask[b, torch.randperm(L, generator=g)[:n_known]] = 0
            return mask

        inputs = {"ids": ids4, "prompt_mask": am4, "p7": p7, "p3": p3, "null_prompt": null}
        outputs = {}
        with torch.no_grad():
            for name, side, n_known in (("a", 4, 5), ("b", 6, 13), ("c", 4, 0)):
                L = side * side
                tokens = torch.randn(4, L, 16, generator=g)
                mask = random_mask(4, L, n_known)
                inputs.update({f"{name}_tokens": tokens, f"{name}_mask": mask})
                outputs[f"{name}_z"] = conditions(tokens, mask, side, side)
            N = 8
            hx, ht, hc = torch.randn(N, 16, generator=g), torch.randint(0, 1000, (N,), generator=g), \
                torch.randn(N, 48, generator=g)
            inputs.update({"head_x": hx, "head_t": ht, "head_z": hc})
            outputs["head_out"] = model.mar.diffloss.net(hx, ht, hc)

        # (e) end-to-end samples with injected orders and recorded draws
        net = model.mar.diffloss.net
        forward = net.forward
        v_max = [0.0]

        def net_forward(x, t, c):
            out = forward(x, t, c)
            half = len(x) // 2 if len(x) > 1 and cfg_now[0] != 1.0 else len(x)
            v_max[0] = max(v_max[0], out[:half, 16:].abs().max().item())
            return out

        net.forward = net_forward
        cfg_now = [1.0]
        samples = {}
        torch_randn = torch.randn  # the originals, for the patched draws below
        for name, cfg, side, num_iter, prompt_rows in (("e1", 3.0, 4, 16, [p7, p3, null, null]),
                                                        ("e2", 1.0, 6, 4, [p7, p3])):
            L, bsz = side * side, len(prompt_rows)
            half = bsz // 2 if cfg != 1.0 else bsz
            ids, am = padded(prompt_rows)
            orders = torch.stack([torch.randperm(L, generator=g) for _ in range(half)])
            orders_all = torch.cat([orders, orders]) if cfg != 1.0 else orders
            draw_gen = torch.Generator().manual_seed(33 if name == "e1" else 34)
            draws, masks = [], []

            # the patched functions below run inside this iteration only: default arguments bind its state
            def randn(*size, draw_gen=draw_gen, draws=draws, **kw):
                shape = size[0] if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)) else size
                x = torch_randn(*shape, generator=draw_gen)
                draws.append(("randn", x))
                return x.clone()

            def randn_like(x, draw_gen=draw_gen, draws=draws, **kw):
                e = torch_randn(x.shape, generator=draw_gen, dtype=x.dtype)
                draws.append(("randn_like", e))
                return e.clone()

            def by_order(mask_len, order, bsz_, seq_len, masks=masks, mask_by_order=hm.mask_by_order):
                out = mask_by_order(mask_len, order, bsz_, seq_len)
                masks.append(out.clone())
                return out

            tokens_after = []

            def diff_sample(z, temperature=1.0, cfg=1.0, sample_fn=model.mar.diffloss.sample,
                            tokens_after=tokens_after):
                out = sample_fn(z, temperature, cfg)
                tokens_after.append(out.clone())
                return out

            cfg_now[0] = cfg
            with _patched(model.mar, "sample_orders", lambda bsz_, seq_len=None, o=orders_all: o.clone()), \
                    _patched(hm, "mask_by_order", by_order), _patched(model.mar.diffloss, "sample", diff_sample), \
                    _patched(torch, "randn", randn), _patched(torch, "randn_like", randn_like), torch.no_grad():
                final = model.sample(input_ids=ids, attention_mask=am, num_iter=num_iter, cfg=cfg,
                                     cfg_schedule="constant", temperature=0.9, image_shape=(side, side))
            del model.mar.sample_orders, model.mar.diffloss.sample  # the instance patches (_patched restores
            # by setattr; the class attributes are the originals)
            assert len(masks) == num_iter and len(tokens_after) == num_iter
            K = 10
            assert len(draws) == num_iter * (K + 1)
            known = torch.zeros(half, L, dtype=torch.bool)  # before each iteration
            known_steps, pred_steps, init, eps = [], [], [], []
            for s in range(num_iter):
                kind, x0 = draws[s * (K + 1)]
                assert kind == "randn"
                chain = draws[s * (K + 1) + 1:(s + 1) * (K + 1)]
                assert all(k == "randn_like" for k, _ in chain)
                # mask_to_pred (harmon.py:254-257): unknown now and not masked next (mask_next is a subset of
                # the mask, both prefixes of the order); every unknown token at the last iteration
                pred = ~known & ~masks[s][:half] if s < num_iter - 1 else ~known
                n_pred = int(pred.sum())
                assert x0.shape == (n_pred, 16), (x0.shape, n_pred)
                assert all(e.shape == (n_pred * (bsz // half), 16) for _, e in chain)
                known_steps.append(known.clone())
                pred_steps.append(pred.clone())
                init.append(x0)
                eps.append(torch.stack([e[:n_pred] for _, e in chain]))  # (K, n_pred, 16), draw order
                known = known | pred
            assert bool(known.all())
            # tokens after each iteration: rebuild from the diffusion outputs (cond rows, nonzero order)
            tok = torch.zeros(half, L, 16)
            per_step = []
            for s in range(num_iter):
                tok[pred_steps[s]] = tokens_after[s][:int(pred_steps[s].sum())]
                per_step.append(tok.clone())
            final = final[:half].reshape(half, L, 16) if cfg != 1.0 else final.reshape(half, L, 16)
            assert torch.equal(per_step[-1], final)
            inputs.update({f"{name}_ids": ids, f"{name}_prompt_mask": am, f"{name}_orders": orders,
                           f"{name}_known": torch.stack(known_steps), f"{name}_pred": torch.stack(pred_steps),
                           f"{name}_init": torch.cat(init), f"{name}_eps": torch.cat(eps, 1)})
            outputs.update({f"{name}_tokens": final, f"{name}_steps": torch.stack(per_step)})
            samples[name] = {"cfg": cfg, "grid": side, "num_iter": num_iter, "temperature": 0.9, "rows": bsz}
        del net.forward
        assert v_max[0] < 1.0, v_max  # coolsd's step_gaussian clamps v to [-1, 1] (upstream does not)

        config = {"llm": llm_cfg, "mar": mar_cfg, "base_grid": 4, "diffusion_steps": 10, "samples": samples,
                  "sample_rel_tolerance": 1e-5, "pad_id": pad, "max_abs_v": round(v_max[0], 4)}
        weights = dict(model.state_dict())
        assert not any(k.startswith("vae.") for k in weights)
        save(out_dir, "harmon", "harmon", weights, inputs, outputs, config, manifest, "wusize/Harmon", commit,
             "src/models/harmon.py (prepare_forward_input, extract_visual_feature, forward_mae_encoder, curtail_cache, "
             "sample), src/models/mar/mar.py (forward_mae_encoder / decoder, get_*_pos_embed), "
             "src/models/mar/diffloss.py, src/models/mar/diffusion/", tolerance=2e-5,
             note="rows [p7, p3, null, null] right-padded to 7 with id 127; (a) 4x4 5 known, (b) 6x6 13 known "
                  "(bilinear pos embeds), (c) 4x4 none known: out.<x>_z; (d) head on 8 (x, t, z); (e) Harmon.sample "
                  "e1 (cfg 3, 4x4, num_iter 16) and e2 (cfg 1, 6x6, num_iter 4), temperature 0.9, injected orders, "
                  "recorded draws: in.<e>_known / _pred (iteration, B, L), _init (sum n_pred, 16) and _eps "
                  "(K, sum n_pred, 16) in draw order (timestep K-1 first), cond rows in row-major nonzero order; "
                  "out.<e>_steps tokens after each iteration (scale ~1e5: random head); sample tolerance 1e-5 "
                  f"relative to the largest token; run with {versions}")


# ------------------------------------------------------------------------------------ DiSA (MAR)
_DISA_SCHEDULES = ((50, 5, 64), (8, 3, 7))  # (diff_upper_steps, diff_lower_steps, ar_num_iter)
_DISA_STRATEGIES = ("linear", "cosine", "constant", "two-stage")  # DiffLoss.sample's branches (diffloss.py:89-98)


def _disa_sample(dl, z, cfg: float, step: int, num_iter: int, temperature: float, draws: list, replay=None,
                 forward=None) -> tuple[torch.Tensor, list]:
    """One upstream ``DiffLoss.sample`` with ``torch.randn`` / ``torch.randn_like`` drawing from a
    seeded generator (``draws`` is a Generator: every draw appended to the list returned) or popping
    ``replay`` (a list of tensors; ``torch.randn`` without a dtype keeps the replayed tensor's, so an fp64
    replay runs upstream in fp64), and ``.cuda()`` the identity.
    ``forward`` (optional) wraps the net's forward (an instance attribute while it runs)."""
    gen, record, queue = draws, [], None if replay is None else list(replay)
    torch_randn = torch.randn

    def take(shape, dtype):  # dtype None: torch's default (a replayed draw keeps its own dtype)
        if queue is not None:
            v = queue.pop(0)
            assert tuple(v.shape) == tuple(shape), (tuple(v.shape), tuple(shape))
            v = v.to(dtype or v.dtype).clone()
        else:
            v = torch_randn(*shape, generator=gen, dtype=dtype or torch.float32)
        record.append(v.clone())
        return v

    def randn(*size, **kw):
        shape = size[0] if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)) else size
        return take(shape, kw.get("dtype"))

    def randn_like(x, **kw):
        return take(x.shape, kw.get("dtype") or x.dtype)

    if forward is not None:
        dl.net.forward = forward
    try:
        with _patched(torch, "randn", randn), _patched(torch, "randn_like", randn_like), \
                _patched(torch.Tensor, "cuda", lambda self, *a, **k: self), torch.no_grad():
            out = dl.sample(z, temperature=temperature, cfg=cfg, step=step, ar_num_iter=num_iter)
    finally:
        if forward is not None:
            del dl.net.forward
    assert queue is None or not queue, f"{len(queue)} replayed draws unused"
    return out, record


def make_disa(root: Path, out_dir: Path, manifest: dict) -> None:
    """Qinyu-Allen-Zhao/DiSA ``MAR_DiSA/models/diffloss.py`` (``DiffLoss`` with ``diff_sampler="DiSA"``:
    one ``create_diffusion(str(k), noise_schedule="cosine")`` per nominal step count k in [lower, upper],
    ``sample`` picks one per AR iteration) and ``MAR_DiSA/diffusion/`` (``create_diffusion``, whose
    default ``clip_timesteps`` = 950 clips the respaced timesteps, ``SpacedDiffusion``,
    ``p_sample_loop``). Torch and numpy only; ``.cuda()`` (diffloss.py:81/86, gaussian_diffusion.py:504)
    is the identity while upstream runs.

    (a) Schedules: for (upper, lower, ar_num_iter) in ``_DISA_SCHEDULES`` and every annealing strategy,
        upstream's ``sample`` is called for each AR step with ``gen_diffusion`` replaced by probes that
        record the index it picks (its own expression): ``out.steps_<strategy>_<upper>_<lower>_<num_iter>``
        = lower + that index. ``out.timesteps_<k>`` = the sorted original timesteps of the respaced
        diffusion of nominal k (``use_timesteps``, asserted equal to its ``timestep_map``), every k in
        [3, 50] (the two settings' DiffLoss agree on the shared k).
    (b) Sampling: a tiny DiffLoss (4 channels, z 8, depth 1, width 32, upper 8, lower 3, linear) with
        random fp16-exact weights (the v rows of ``final_layer.linear`` scaled by 0.2 so v stays in
        [-1, 1], asserted: coolsd clamps v where upstream does not), ``sample`` at AR steps 0, 3, 6 of 7,
        cfg 1 and 3, temperature 0.9, every ``randn`` / ``randn_like`` recorded in call order."""
    src = root / "MAR_DiSA" if (root / "MAR_DiSA").is_dir() else root
    commit = checkout_commit(root)
    with upstream_path(src, ("models", "diffusion", "util")):
        dm = importlib.import_module("models.diffloss")
        diffusion = importlib.import_module("diffusion")
        clip = inspect.signature(diffusion.create_diffusion).parameters["clip_timesteps"].default
        T = 1000
        outputs, inputs = {}, {}

        # (a) schedules: upstream's own index expression, the respaced timesteps of every nominal k
        class Probe:
            def __init__(self, i, used):
                self.i, self.used = i, used

            def p_sample_loop(self, *a, **k):
                self.used.append(self.i)
                return torch.zeros(1)

        timesteps = {}
        for upper, lower, num_iter in _DISA_SCHEDULES:
            torch.manual_seed(0)
            dl = dm.DiffLoss(target_channels=4, z_channels=8, depth=1, width=32, diff_upper_steps=upper,
                             diff_lower_steps=lower, diff_sampler="DiSA")
            assert len(dl.gen_diffusion) == upper - lower + 1
            for i, gd in enumerate(dl.gen_diffusion):
                k = lower + i
                ts = sorted(gd.use_timesteps)
                assert ts == list(gd.timestep_map) and len(ts) == gd.num_timesteps, k
                assert timesteps.setdefault(k, ts) == ts, k  # the same create_diffusion(str(k)) in both
            real, used = dl.gen_diffusion, []
            dl.gen_diffusion = [Probe(i, used) for i in range(len(real))]
            for strategy in _DISA_STRATEGIES:
                dl.diff_annealing_strategy = strategy
                used.clear()
                for step in range(num_iter):
                    _disa_sample(dl, torch.zeros(1, 8), 1.0, step, num_iter, 1.0, torch.Generator().manual_seed(0))
                assert len(used) == num_iter
                outputs[f"steps_{strategy}_{upper}_{lower}_{num_iter}"] = torch.tensor(used, dtype=torch.int64) + lower
            dl.gen_diffusion = real
        for k, ts in sorted(timesteps.items()):
            outputs[f"timesteps_{k}"] = torch.tensor(ts, dtype=torch.int64)

        # (b) sampling with the tiny head
        upper, lower, num_iter, temperature, strategy = 8, 3, 7, 0.9, "linear"
        net_cfg = dict(in_channels=4, model_channels=32, out_channels=8, z_channels=8, num_res_blocks=1)
        torch.manual_seed(0)
        dl = dm.DiffLoss(target_channels=4, z_channels=8, depth=1, width=32, grad_checkpointing=False,
                         diff_upper_steps=upper, diff_lower_steps=lower, diff_annealing_strategy=strategy,
                         diff_sampler="DiSA").eval()
        assert {k: getattr(dl.net, k) for k in ("in_channels", "model_channels", "out_channels", "num_res_blocks")} \
            == {k: v for k, v in net_cfg.items() if k != "z_channels"}
        assert dl.net.cond_embed.in_features == net_cfg["z_channels"]
        randomize(dl.net, seed=41, std=0.15, norm_keys=("norm", "_ln"))
        with torch.no_grad():
            out_layer = dl.net.final_layer.linear
            out_layer.weight[4:] *= 0.2  # the v half of the output (gaussian_diffusion.py:285-292)
            out_layer.bias[4:] *= 0.2
        round_fp16(dl.net)
        g = torch.Generator().manual_seed(42)
        B = 3
        z, z_unc = torch.randn(B, 8, generator=g), torch.randn(B, 8, generator=g)
        inputs.update({"z": z, "z_uncond": z_unc})
        net_forward = dl.net.forward
        v_max, max_err, scale, cases = [0.0], {}, {}, {}

        for c, (step, cfg) in enumerate((s, f) for s in (0, 3, 6) for f in (1.0, 3.0)):
            z_in = z if cfg == 1.0 else torch.cat([z, z_unc])
            calls = []

            def forward(x, t, c, net_forward=net_forward, calls=calls, cfg=cfg):  # called with c= (model_kwargs)
                out = net_forward(x, t, c)
                assert bool((t == t[0]).all())
                calls.append(int(t[0]))
                half = len(x) // 2 if cfg != 1.0 else len(x)  # forward_with_cfg: only the cond half's v is used
                v_max[0] = max(v_max[0], out[:half, 4:].abs().max().item())
                return out

            tokens, draws = _disa_sample(dl, z_in, cfg, step, num_iter, temperature,
                                         torch.Generator().manual_seed(50 + c), forward=forward)
            n = len(calls)
            sid = int(outputs[f"steps_{strategy}_{upper}_{lower}_{num_iter}"][step]) - lower
            assert calls == timesteps[lower + sid][::-1], (calls, sid)  # the chain ran gen_diffusion[sid]
            rows = len(z_in)
            assert tokens.shape == (rows, 4) and len(draws) == n + 1
            assert draws[0].shape == (B, 4) and all(d.shape == (rows, 4) for d in draws[1:])
            # the last step (respaced t = 0) draws a noise it does not use: replay with it zeroed
            again, _ = _disa_sample(dl, z_in, cfg, step, num_iter, temperature, None,
                                    replay=draws[:-1] + [torch.zeros_like(draws[-1])])
            assert torch.equal(again, tokens)
            # fp32 error estimate: the same run in fp64 (the net in fp64; upstream's fp32 sinusoidal embedding
            # and fp32 diffusion coefficients (_extract_into_tensor) are kept in both runs)
            dl64 = copy.deepcopy(dl).double()
            te = dl64.net.time_embed
            te.forward = lambda t, te=te: te.mlp(te.timestep_embedding(t, te.frequency_embedding_size).double())
            ref, _ = _disa_sample(dl64, z_in.double(), cfg, step, num_iter, temperature, None,
                                  replay=[d.double() for d in draws])
            name = f"s{step}_cfg{int(cfg)}"
            max_err[name] = (tokens.double() - ref).abs().max().item()
            scale[name] = tokens.abs().max().item()
            if all(d.shape == draws[0].shape for d in draws):
                inputs[f"draws_{name}"] = torch.stack(draws)
            else:
                for i, d in enumerate(draws):
                    inputs[f"draw{i}_{name}"] = d
            outputs[f"sample_{name}"] = tokens
            if cfg == 1.0:
                outputs[f"n_steps_s{step}"] = torch.tensor(n, dtype=torch.int64)
                outputs[f"ts_s{step}"] = torch.tensor(calls, dtype=torch.int64)
            else:
                assert n == int(outputs[f"n_steps_s{step}"]) and calls == outputs[f"ts_s{step}"].tolist()
            cases[name] = {"step": step, "cfg": cfg, "draw_seed": 50 + c, "nominal_steps": lower + sid, "n_steps": n,
                           "rows": rows, "max_abs": round(scale[name], 4),
                           "fp64_max_abs_diff": float(f"{max_err[name]:.3g}")}
        assert v_max[0] < 1.0, v_max  # coolsd's step_gaussian clamps v to [-1, 1] (upstream does not)

    config = dict(net_cfg, target_channels=4, upper=upper, lower=lower, strategy=strategy, temperature=temperature,
                  ar_num_iter=num_iter, T=T, noise_schedule="cosine", clip_timesteps=clip, learn_sigma=True,
                  schedules=[list(s) for s in _DISA_SCHEDULES], strategies=list(_DISA_STRATEGIES), cases=cases,
                  max_abs_v=round(v_max[0], 4))
    worst = max(max_err.values())
    note = ("(a) out.steps_<strategy>_<upper>_<lower>_<ar_num_iter> (ar_num_iter,): the nominal step count "
            "lower + schedule_id of each AR step, from upstream's DiffLoss.sample (gen_diffusion replaced by index "
            "probes); out.timesteps_<k>: sorted original timesteps of create_diffusion(str(k)) (clip_timesteps "
            f"{clip}: duplicates merged, so k >= 22 runs fewer than k steps). (b) DiffLoss.sample (DiSA, upper 8, "
            "lower 3, linear, ar_num_iter 7, temperature 0.9) at steps 0, 3, 6, cfg 1 (z, B = 3) and cfg 3 "
            "(cat[z, z_uncond]): in.draws_s<step>_cfg1 (n_steps + 1, B, 4) stacked, in.draw<i>_s<step>_cfg3 (draw 0 "
            "(B, 4), duplicated by upstream for both halves; draws 1.. (2B, 4), one per p_sample, independent per "
            "half); the last p_sample (respaced t = 0) draws a noise it does not add (asserted); out.sample_* "
            "upstream's return (cfg 3: 2B rows, the second half diverged and is discarded by MAR); out.n_steps_s<step>, "
            f"out.ts_s<step> the original timesteps the net saw. Measured max abs diff of this fp32 run vs the same "
            f"run with the net in fp64: {worst:.2g} (tokens up to {max(scale.values()):.3g}: a random head's eps is "
            "amplified by 1 / sqrt(alpha_bar(950)) ~ 13 at the first step); tolerance 1e-4 absolute")
    save(out_dir, "disa", "disa", dict(dl.net.state_dict()), inputs, outputs, config, manifest,
         UPSTREAM_REPOS["disa"], commit,
         "MAR_DiSA/models/diffloss.py (DiffLoss DiSA: __init__, sample; SimpleMLPAdaLN forward, forward_with_cfg), "
         "MAR_DiSA/diffusion/__init__.py (create_diffusion), respace.py (space_timesteps, SpacedDiffusion), "
         "gaussian_diffusion.py (p_sample_loop, p_sample, p_mean_variance)", tolerance=1e-4, note=note)


# ------------------------------------------------------------------------------------ SJD-family samplers
# SJD (tyshiwo1/Accelerating-T2I-AR-with-SJD), MC-SJD / SCD (junhyukso/SCD), GSD (junhyukso/GSD) and
# SJD-PAC (KangJialiang/SJD-PAC): their samplers are plain functions and classes of one scheduler
# module each, entangled with Lumina-mGPT's HF generation loop only through the tensors they are
# handed. Here they run on a synthetic target (below) with their own code for everything that decides
# tokens: the target samples (``sampling_logits2tokens``), the verification and the next window
# (``SpeculativeSampler.__call__`` via ``prefix_matching_next_tokens``; ``SJDPACSpeculativeSampler``),
# the random top-ups (``get_multi_token_for_preparation``). What the loop does between them (append
# the matched tokens, carry the unmatched ones, roll the KV cache back) is a few lines of glue here
# (``_jacobi_case``), written from ``_sample`` / ``prepare_inputs_for_generation_jacobi`` /
# ``push_forward_model_kwargs_and_inputs``. Every random draw is recorded (``_Draws``).


class _Draws:
    """Records every random draw of the upstream code it wraps, in order: ``torch.rand`` and
    ``torch.randint`` as they are (their outputs saved), and ``torch.multinomial`` REPLACED by an
    inverse-CDF draw from recorded uniforms: draw j of a row is the token where ``u_j * mass`` falls
    in the CDF (token order) of the row with the draws before j zeroed (draws without replacement,
    successive sampling: the law of torch's ``multinomial(replacement=False)``; torch's own draw,
    argmax p / Exp(1) noise, has no uniform a test could replay). Upstream's code, its probabilities
    and its control flow are unchanged; only the source of its multinomial noise is. Also sets the
    default dtype to float64 so upstream's ``torch.rand`` and sums run in float64."""

    def __init__(self):
        self.events: list[dict] = []

    def __enter__(self):
        self._orig = {k: getattr(torch, k) for k in ("rand", "randint", "multinomial")}
        self._dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        orig_rand, orig_randint = self._orig["rand"], self._orig["randint"]

        def rand(*shape, **kw):
            out = orig_rand(*shape, **kw)
            self.events.append({"kind": "rand", "out": out.detach().clone(), "generator": kw.get("generator")})
            return out

        def randint(*args, **kw):
            out = orig_randint(*args, **kw)
            self.events.append({"kind": "randint", "out": out.detach().clone(), "args": args})
            return out

        def multinomial(probs, num_samples, replacement=False, *, generator=None):
            if replacement:
                raise NotImplementedError("the SJD-family samplers draw without replacement")
            flat = probs.reshape(-1, probs.shape[-1])
            if ((flat > 0).sum(-1) < num_samples).any():
                raise ValueError("a row with fewer positive entries than draws: torch's tie-breaking would decide")
            u = orig_rand((flat.shape[0], num_samples), generator=generator, dtype=torch.float64)
            rest, toks = flat.to(torch.float64).clone(), []
            for j in range(num_samples):
                cdf = rest.cumsum(-1)
                t = torch.searchsorted(cdf.contiguous(), (u[:, j : j + 1] * cdf[:, -1:]).contiguous(), right=True)
                last = rest.shape[-1] - 1 - torch.flip(rest > 0, dims=[-1]).to(torch.int8).argmax(-1, keepdim=True)
                t = torch.minimum(t, last)
                toks.append(t)
                rest = rest.scatter(-1, t, 0.0)
            out = torch.cat(toks, -1).reshape(*probs.shape[:-1], num_samples)
            self.events.append({"kind": "multinomial", "probs": flat.detach().clone(), "u": u, "out": out.clone()})
            return out

        torch.rand, torch.randint, torch.multinomial = rand, randint, multinomial
        return self

    def __exit__(self, *exc):
        for k, v in self._orig.items():
            setattr(torch, k, v)
        torch.set_default_dtype(self._dtype)

    def take(self, kind: str) -> dict:
        """The oldest unread event, which must be of ``kind``."""
        ev = self.events.pop(0)
        assert ev["kind"] == kind, f"expected a {kind} draw, upstream made a {ev['kind']} draw"
        return ev


class _TabularTarget:
    """The synthetic target: logits(context) = a * A[len(context) % P] + b * B[context[-1]] (float64,
    seeded): a distribution that depends on the position (so the next iteration's sample at a
    position often agrees with the last one, as on images) and on the token before it (so a draft's
    context matters: a rejected token changes the p of every later slot)."""

    def __init__(self, V: int, seed: int, a: float, b: float, P: int = 7):
        g = torch.Generator().manual_seed(seed)
        self.A = torch.randn(P, V, generator=g, dtype=torch.float64)
        self.B = torch.randn(V, V, generator=g, dtype=torch.float64)
        self.a, self.b, self.P = a, b, P

    def logits(self, context: list[int]) -> torch.Tensor:
        return self.a * self.A[len(context) % self.P] + self.b * self.B[context[-1]]


def _recording(sampler, p: torch.Tensor):
    """``sampler`` (a ``SpeculativeSampler``) as a callable that keeps its own return (which
    ``prefix_matching_next_tokens`` splits) in ``raw["ret"]``, and the draft slot of every residual
    draw it makes (``reject_sampling_single_token``) in ``resid_calls``, in order."""
    raw, resid_calls = {}, []
    bound_call, single = type(sampler).__call__.__get__(sampler), sampler.reject_sampling_single_token

    def record_call(*a, **kw):
        raw["ret"] = bound_call(*a, **kw)
        return raw["ret"]

    def record_single(token_advanced_prob, token_draft_prob, **kw):
        # which slot: the row of p it was handed (a view of p: advanced_prob[b, i - 1, :])
        assert token_advanced_prob.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
        k = (token_advanced_prob.storage_offset() - p.storage_offset()) // p.stride(1)
        resid_calls.append(k + 1)  # the draft slot i tested against p[i - 1]
        return single(token_advanced_prob=token_advanced_prob, token_draft_prob=token_draft_prob, **kw)

    sampler.reject_sampling_single_token = record_single
    return record_call, raw, resid_calls


def _jacobi_case(mod, family: str, target: _TabularTarget, prompt: list[int], W: int, V: int, rounds: int,
                 generator: torch.Generator) -> list[dict]:
    """``rounds`` Jacobi iterations of one sample (batch 1, window W: the root and W-1 drafts, all in
    the active range) with upstream's functions of ``mod``; returns one record per round."""
    from transformers.generation.logits_process import LogitsProcessorList

    gsd = family == "gsd"
    # empty: Lumina's image-token mask and top-2000 warper leave a vocabulary of V image tokens unchanged
    identity = LogitsProcessorList()
    img_vocab = torch.arange(V)
    collected = list(prompt)
    tcs = torch.nn.functional.one_hot(torch.tensor([collected]), V).double()  # temporary_collected_scores
    carry, carry_scores = None, None
    n = W - 1
    out = []
    for _ in range(rounds):
        with _Draws() as draws:
            ids = torch.tensor([collected])
            n_carry = 0 if carry is None else min(carry.shape[1], n)
            extra = {"temporary_collected_logits": tcs} if gsd else {}  # GSD's draft logits: never read
            rand_tokens, rand_scores = mod.get_multi_token_for_preparation(
                img_vocab=img_vocab, rand_token_num=n - n_carry, input_ids=ids, temporary_collected_scores=tcs,
                device="cpu", multi_token_init_scheme="random", generator=generator, **extra)[:2]
            parts = [ids[:, -1:]] + ([carry[:, :n_carry]] if n_carry else []) + [rand_tokens]
            window = torch.cat(parts, 1)
            q = torch.cat([tcs[:, -1:]] + ([carry_scores[:, :n_carry]] if n_carry else []) + [rand_scores], 1)
            ctx = collected[:-1]
            logits = torch.stack([target.logits(ctx + window[0, : k + 1].tolist()) for k in range(W)]).unsqueeze(0)
            res = mod.sampling_logits2tokens(
                logits, ids, torch.ones(1, dtype=torch.long), 0, output_token_num=W, logits_processor=identity,
                logits_warper=None, do_sample=True, has_eos_stopping_criteria=False, do_cfg=False, generator=generator)
            next_tokens, p = res[0], res[1]
            sampler = mod.SpeculativeSampler(
                generator=generator, reject_sampling_relative_ids=-torch.ones(1, dtype=torch.long),
                reject_sampling_draft_token_logits=torch.zeros((1, V), dtype=torch.long),  # upstream's dtype (ids')
                sampling_last_draft_token=torch.zeros((1,), dtype=torch.long))
            record_call, raw, resid_calls = _recording(sampler, p)
            kw = {"model_input_ids": window, "next_tokens": next_tokens, "next_token_scores": p,
                  "is_prefilling_phase": False, "input_token_scores": q, "prefix_token_sampler": record_call,
                  "logits_processor": identity, "logits_warper": None, "all_collected_input_ids": ids}
            if gsd:
                kw.update(next_token_logits=res[2], input_token_logits=None,
                          head_img_sims=torch.zeros(V, V))  # embedding distances 0: that filter passes all (not ours)
                num_matched, matched, unmatched, matched_scores, unmatched_scores = \
                    mod.prefix_matching_next_tokens(**kw)[:5]
            else:
                num_matched, matched, unmatched, matched_scores, unmatched_scores = \
                    mod.prefix_matching_next_tokens(**kw)
        fm, res_tokens, res_scores = raw["ret"]
        ev = draws.events
        # the draws in upstream's order: top-up ids, the target samples, the acceptance uniforms
        # (GSD: and an unused second table), one residual draw per rejection
        topup = draws.take("randint")["out"][0]  # drawn (empty) even when nothing is topped up
        tgt = draws.take("multinomial")
        rs = draws.take("rand")["out"]
        if gsd:
            draws.take("rand")  # rs2 = torch.rand(...) without the generator: never read
        resid = [draws.take("multinomial") for _ in resid_calls]
        assert not ev, f"unexpected upstream draws: {[e['kind'] for e in ev]}"
        rec = {
            "window": window[0], "window_q": q[0], "n_carry": n_carry, "logits": logits[0], "p": p[0],
            "u_target": tgt["u"][:, 0], "target_tokens": next_tokens[0], "rs": rs[0],
            "topup": torch.cat([torch.full((n_carry,), -1, dtype=torch.long), topup.long()]),
            "resid_slot": resid_calls, "resid_u": [e["u"][0, 0] for e in resid],
            "resid_probs": [e["probs"][0] for e in resid], "resid_token": [int(e["out"].flatten()[0]) for e in resid],
            "first_misaligned": int(fm[0]), "next_tokens": res_tokens[0], "next_scores": res_scores[0],
        }
        assert torch.equal(tgt["probs"], p[0]) and torch.equal(tgt["out"][:, 0], next_tokens[0])
        out.append(rec)
        # the loop's glue (push_forward_model_kwargs_and_inputs): append the matched tokens, carry the rest
        collected += matched[0].tolist()
        tcs = torch.cat([tcs[:, -1:], matched_scores], 1)
        carry, carry_scores = (unmatched, unmatched_scores) if num_matched < W else (None, None)
    return out


def _stack_rounds(records: list[dict], W: int, V: int, per_slot_resid: bool) -> tuple[dict, dict]:
    """The per-round records as fixed-shape tensors: inputs (what upstream was handed, its draws) and
    outputs (what it returned)."""
    R = len(records)
    inp = {k: torch.stack([r[k] for r in records]) for k in
           ("window", "window_q", "logits", "u_target", "rs", "topup")}
    inp["n_carry"] = torch.tensor([r["n_carry"] for r in records])
    outp = {k: torch.stack([r[k] for r in records]) for k in ("p", "target_tokens", "next_tokens", "next_scores")}
    outp["first_misaligned"] = torch.tensor([r["first_misaligned"] for r in records])
    if per_slot_resid:  # one residual draw per rejected slot (MC-SJD tests every slot)
        u = torch.full((R, W), -1.0, dtype=torch.float64)  # -1: no draw
        tok = torch.full((R, W), -1, dtype=torch.long)
        probs = torch.zeros(R, W, V, dtype=torch.float64)
        for i, r in enumerate(records):
            for s, uu, pr, t in zip(r["resid_slot"], r["resid_u"], r["resid_probs"], r["resid_token"]):
                u[i, s], probs[i, s], tok[i, s] = uu, pr, t
        inp["resid_u"], outp["resid_probs"], outp["resid_token"] = u, probs, tok
    else:  # at most one (SJD, GSD stop at the first rejection): at slot resid_slot (-1: none)
        u = torch.full((R,), -1.0, dtype=torch.float64)  # -1: no draw
        slot, tok = torch.full((R,), -1, dtype=torch.long), torch.full((R,), -1, dtype=torch.long)
        probs = torch.zeros(R, V, dtype=torch.float64)
        for i, r in enumerate(records):
            assert len(r["resid_slot"]) <= 1
            if r["resid_slot"]:
                u[i], slot[i], probs[i], tok[i] = r["resid_u"][0], r["resid_slot"][0], r["resid_probs"][0], \
                    r["resid_token"][0]
        inp["resid_u"], outp["resid_slot"], outp["resid_probs"], outp["resid_token"] = u, slot, probs, tok
    return inp, outp


_JACOBI_SOURCES = {
    "sjd": ("scheduler", "scheduler.jacobi_iteration_lumina_mgpt", "scheduler/jacobi_iteration_lumina_mgpt.py"),
    "scd": ("lumina1", "scheduler.jacobi_iteration_lumina_mgpt_SCDMC",
            "lumina1/scheduler/jacobi_iteration_lumina_mgpt_SCDMC.py"),
    "gsd": ("scheduler", "scheduler.jacobi_iteration_lumina_mgpt", "scheduler/jacobi_iteration_lumina_mgpt.py"),
}
# (V, W, target a, target b, cases, rounds): chosen so the fixture holds rejections at every slot,
# all-accepted rounds, and (MC-SJD) drafts the coupling keeps and moves after the first rejection
_JACOBI_SETUP = {"sjd": (16, 6, 2.0, 0.5, 4, 5), "scd": (16, 6, 2.0, 0.5, 4, 5), "gsd": (32, 6, 1.5, 0.5, 3, 4)}


def _make_jacobi_family(family: str, root: Path, out_dir: Path, manifest: dict) -> None:
    sub, modname, source = _JACOBI_SOURCES[family]
    base = root / sub if sub != "scheduler" else root
    V, W, a, b, n_cases, n_rounds = _JACOBI_SETUP[family]
    with upstream_path(base, ("scheduler",)):
        mod = importlib.import_module(modname)
        target_seed, records, prompts = 7, [], []
        for c in range(n_cases):
            torch.manual_seed(100 + c)  # the top-ups' torch.randint uses the global generator
            gen = torch.Generator().manual_seed(200 + c)  # upstream's self.generator
            prompt = [c % V, (3 * c + 1) % V]
            prompts.append(prompt)
            records += _jacobi_case(mod, family, _TabularTarget(V, target_seed, a, b), prompt, W, V, n_rounds, gen)
    inp, outp = _stack_rounds(records, W, V, per_slot_resid=family == "scd")
    inp["case"] = torch.arange(n_cases).repeat_interleave(n_rounds)
    config = {"V": V, "W": W, "cases": n_cases, "rounds": n_rounds, "prompts": prompts, "dtype": "float64",
              "target": {"a": a, "b": b, "P": 7, "seed": target_seed,
                         "logits": "a * A[len(context) % P] + b * B[context[-1]], A, B ~ N(0, 1) (float64)"},
              "img_vocab": f"0..{V - 1}", "logits_processor": "LogitsProcessorList() (identity)",
              "logits_warper": None}
    if family == "gsd":
        config["gsd"] = {"window": 14, "p_thr": 0.15, "d_thr": 0.5, "head_img_sims": "zeros (every distance passes)"}
    sampler = {"sjd": "SpeculativeSampler.__call__ (stops at the first rejection)",
               "scd": "SpeculativeSampler.__call__ (MC: tests every slot, no break)",
               "gsd": "SpeculativeSampler.__call__ (grouped acceptance)"}[family]
    name = {"sjd": "sampler_sjd", "scd": "sampler_mc_sjd", "gsd": "sampler_gsd"}[family]
    note = (f"{n_cases} samples x {n_rounds} Jacobi iterations (batch 1, window W={W}: root + {W - 1} drafts, "
            f"V={V} image tokens) on a synthetic tabular target; per round r: in.window / in.window_q (the "
            "drafts and the q upstream tests them with; slot 0 = root), in.n_carry (drafts carried from the "
            "last round; the rest are top-ups: in.topup = upstream's torch.randint ids, -1 where carried), "
            "in.logits (fed to sampling_logits2tokens), out.p (its advanced_prob), in.u_target / "
            "out.target_tokens (the target samples at every slot), in.rs (the acceptance uniforms, "
            "torch.rand (W, V): draft i is tested with rs[i, window[i]] against p[i - 1]), in.resid_u / "
            "out.resid_probs / out.resid_token (the residual draws: "
            + ("one per rejected slot, (R, W)" if family == "scd" else "at most one, at out.resid_slot")
            + "), out.first_misaligned (the sampler's first rejected slot, W if none), out.next_tokens / "
            "out.next_scores (the sampler's resampled_target_tokens / _scores: [:fm] emitted, [fm:] the "
            "next window's drafts and their q). torch.multinomial replaced by a recorded inverse-CDF draw "
            "(tools/make_upstream_fixtures.py _Draws); float64")
    save(out_dir, name, name, {}, inp, outp, config, manifest, UPSTREAM_REPOS[family], checkout_commit(root),
         f"{source} ({sampler}, prefix_matching_next_tokens, sampling_logits2tokens, "
         "get_multi_token_for_preparation)", 1e-12, note)


def make_sjd_sampler(root: Path, out_dir: Path, manifest: dict) -> None:
    """tyshiwo1/Accelerating-T2I-AR-with-SJD ``scheduler/jacobi_iteration_lumina_mgpt.py``: SJD."""
    _make_jacobi_family("sjd", root, out_dir, manifest)


def make_scd_sampler(root: Path, out_dir: Path, manifest: dict) -> None:
    """junhyukso/SCD ``lumina1/scheduler/jacobi_iteration_lumina_mgpt_SCDMC.py``: MC-SJD (maximal coupling)."""
    _make_jacobi_family("scd", root, out_dir, manifest)


def make_gsd_sampler(root: Path, out_dir: Path, manifest: dict) -> None:
    """junhyukso/GSD ``scheduler/jacobi_iteration_lumina_mgpt.py``: GSD's grouped acceptance."""
    _make_jacobi_family("gsd", root, out_dir, manifest)


def _pac_tree_layout(mod, L: int, K: int, D: int):
    """Upstream's tree (``generate_tree_mask_and_retrieve``): its parents, each node's rank path
    (rank = tree_indices // M, the candidate row a node reads) and the leaf rows (``retrieve``)."""
    mask, retrieve, from_tree_ids = mod.generate_tree_mask_and_retrieve(L, K, D)
    M = retrieve.shape[1]
    depth = mask.sum(-1) - 1
    parents = [-1] + [max((j for j in range(i) if mask[i, j]), key=lambda j: int(depth[j])) for i in range(1, L)]
    paths = [()]
    for i in range(1, L):
        paths.append(paths[parents[i]] + (int(from_tree_ids[i]) // M,))
    return retrieve, from_tree_ids, torch.tensor(parents), paths, M


def _pac_case(mod, target: _TabularTarget, prompt: list[int], L: int, K: int, D: int, V: int, img_start: int,
              rounds: int, generator: torch.Generator) -> tuple[list[dict], dict]:
    """``rounds`` SJD-PAC iterations of one sample (batch 1, L tree nodes, the root included) with
    ``SJDPACSpeculativeSampler``; the glue (``_sample`` / ``push_forward_model_kwargs_and_inputs``):
    the target's p at every node in its path's context, gathered along upstream's leaf rows
    (``retrieve``; a padded index -1 reads the window's last node, as upstream's
    ``logits[0, retrieve_indices]``), the next tree ``sampled_tokens.flatten()[from_tree_ids]`` and
    its q ``res_p``."""
    retrieve, from_tree_ids, parents, paths, M = _pac_tree_layout(mod, L, K, D)
    sampler = mod.SJDPACSpeculativeSampler(generator=generator)
    # upstream hard-codes Lumina's image tokens 4..8195 for its top-ups (uniform q = 1 / 8192):
    # the same constants for this vocabulary's image tokens img_start..V-1
    sampler.img_start, sampler.img_end, sampler.uni_val = img_start, V, 1.0 / (V - img_start)
    mod.setup_speculative_tree_buffers(sampler, K, D, "cpu")
    img_vocab = torch.arange(img_start, V)
    collected = list(prompt)
    with _Draws() as draws:
        add_tokens, add_scores = mod.get_multi_token_for_preparation(img_vocab, V, L - 1, torch.tensor([collected]),
                                                                      "cpu")
    init_ids = draws.take("randint")["out"]
    nodes = torch.cat([torch.tensor([collected[-1]]), add_tokens[0]])
    q_in = torch.hstack((torch.zeros_like(add_scores[:, :1]), add_scores)).double()[:, :M]  # read: columns 0..M-1
    out = []
    for _ in range(rounds):
        ctx = collected[:-1]
        node_path_tokens = []
        for i in range(L):  # the node's tokens from the root
            seq, j = [], i
            while j >= 0:
                seq.append(int(nodes[j]))
                j = int(parents[j])
            node_path_tokens.append(seq[::-1])
        node_p = torch.stack([torch.softmax(target.logits(ctx + s), -1) for s in node_path_tokens])
        advanced = node_p[retrieve]  # (leaf rows, M, V); -1 reads node L - 1
        draft_tokens = torch.hstack((nodes, torch.tensor([-1])))[retrieve]
        with _Draws() as draws:
            acc_len1, acc_row, sampled, res_p = sampler(draft_tokens=draft_tokens, draft_prob=q_in.clone(),
                                                        advanced_prob=advanced.clone())
        rnd = draws.take("rand")["out"]
        mult = draws.take("multinomial")
        assert not draws.events
        new_nodes = sampled.flatten()[from_tree_ids]
        out.append({"nodes": nodes.clone(), "q_in": q_in[0].clone(), "node_p": node_p, "rnd": rnd,
                    "mult_u": mult["u"], "mult_probs": mult["probs"], "acc_len": acc_len1 - 1, "acc_row": acc_row,
                    "sampled": sampled.clone(), "res_p": res_p[0].clone(), "next_nodes": new_nodes.clone()})
        collected += draft_tokens[acc_row, 1:acc_len1].tolist() + [int(new_nodes[0])]
        nodes, q_in = new_nodes, res_p
    layout = {"retrieve": retrieve, "from_tree_ids": from_tree_ids, "parents": parents, "init_ids": init_ids[0],
              "paths": [list(p) for p in paths], "M": M}
    return out, layout


def make_sjd_pac_sampler(root: Path, out_dir: Path, manifest: dict) -> None:
    """KangJialiang/SJD-PAC ``scheduler/sjd_pac_iteration_lumina_mgpt.py``: ``SJDPACSpeculativeSampler``
    (tree verification by leaf rows, adaptive continuation, proactive drafting) with
    ``generate_tree_mask_and_retrieve`` / ``setup_speculative_tree_buffers`` / ``get_multi_token_for_preparation``."""
    L, K, D, V, img_start = 16, 3, 3, 20, 4
    a, b, target_seed, cases, n_rounds = _PAC_SETUP
    n_cases = len(cases)
    records, prompts, layout = [], [], None
    with upstream_path(root, ("scheduler",)):
        mod = importlib.import_module("scheduler.sjd_pac_iteration_lumina_mgpt")
        for c in cases:
            torch.manual_seed(300 + c)  # initial top-ups (randint) and the sampler's multinomial: global generator
            gen = torch.Generator().manual_seed(400 + c)  # the sampler's torch.rand
            prompt = [img_start + c % (V - img_start), img_start + (5 * c + 2) % (V - img_start)]
            prompts.append(prompt)
            recs, lay = _pac_case(mod, _TabularTarget(V, target_seed, a, b), prompt, L, K, D, V, img_start, n_rounds,
                                  gen)
            records += recs
            assert layout is None or torch.equal(layout["retrieve"], lay["retrieve"])
            layout = lay
    inp = {k: torch.stack([r[k] for r in records]) for k in ("nodes", "q_in", "node_p", "rnd", "mult_u")}
    outp = {k: torch.stack([r[k] for r in records]) for k in ("sampled", "res_p", "next_nodes")}
    outp["resid"] = torch.stack([r["mult_probs"] for r in records])
    outp["acc_len"] = torch.tensor([r["acc_len"] for r in records])
    outp["acc_row"] = torch.tensor([r["acc_row"] for r in records])
    inp["case"] = torch.arange(n_cases).repeat_interleave(n_rounds)
    for k in ("retrieve", "from_tree_ids", "parents"):
        inp[k] = layout[k]
    M = layout["M"]
    config = {"V": V, "L": L, "K": K, "D": D, "M": M, "img_start": img_start, "cases": cases, "rounds": n_rounds,
              "prompts": prompts, "paths": layout["paths"], "dtype": "float64",
              "target": {"a": a, "b": b, "P": 7, "seed": target_seed,
                         "logits": "a * A[len(context) % P] + b * B[context[-1]], A, B ~ N(0, 1) (float64)"},
              "sampler_constants": {"img_start": img_start, "img_end": V, "uni_val": 1.0 / (V - img_start)}}
    note = (f"{n_cases} samples x {n_rounds} iterations (batch 1) of upstream's sampler on a tree of L={L} nodes "
            f"(tree_width K={K}, tree_depth D={D}: a full {K}-ary tree over depths 1..{D - 1}, then the rank-0 "
            f"chain to depth {M - 1}; = our pac_tree(window={M}, width={K}, depth={D})), V={V} (image tokens "
            f"{img_start}..{V - 1}) on a synthetic tabular target; per round: in.nodes (L) upstream's node "
            "tokens (node 0 = root; upstream's node order, config.paths its rank paths), in.q_in (M, V) the "
            "draft_prob by depth, in.node_p (L, V) the target at each node (the sampler gets node_p[retrieve]), "
            "in.rnd (leaf rows, M-1) its torch.rand, in.mult_u (M, K) the uniforms of its one "
            "torch.multinomial(res_p, K), out.acc_len / out.acc_row (accepted drafts, leaf row), "
            "out.resid (M, V) the rows it drew from (rows >= acc_len's residuals, then the uniform top-up rows), "
            "out.sampled (K, M) the candidates (column 0 row 0: the emitted token), out.res_p (M, V) the "
            "next draft_prob, out.next_nodes (L) the next tree; in.retrieve / from_tree_ids / parents: the "
            "tree. Upstream's top-up constants set to this vocabulary (img_start, img_end, uni_val). "
            "torch.multinomial replaced by a recorded inverse-CDF draw without replacement (_Draws); float64")
    save(out_dir, "sampler_sjd_pac", "sampler_sjd_pac", {}, inp, outp, config, manifest, UPSTREAM_REPOS["sjd_pac"],
         checkout_commit(root), "scheduler/sjd_pac_iteration_lumina_mgpt.py (SJDPACSpeculativeSampler.__call__, "
         "generate_tree_mask_and_retrieve, setup_speculative_tree_buffers, get_multi_token_for_preparation)",
         1e-12, note)


# target a, b, seed; case seeds, rounds: of the first 150 seeds, cases that show upstream's deviations
# (tests/engine/test_upstream_samplers.py): 10 and 12 a longest-row choice that is not recursive
# rejection's (about 2% of rounds on this target), 2 and 5 all-accepted rounds, 5 (its first round) and
# 91 (a later one) a tested sibling duplicating an earlier one (q = 0), 2 drafts the stale test rejects
# at a branching depth, 5 a carried depth right after an accepted sibling subtree's leaf
_PAC_SETUP = (2.0, 0.3, 7, [2, 5, 10, 12, 91], 4)


# ------------------------------------------------------------------------------------ PJD (sampler)
# boyaliao/PJD ``scheduler/jacobi_iteration_lumina_mgpt.py``: its ``SpeculativeSampler.__call__`` verifies
# every active row of a forward at once (a row's segment of the window: its anchor, then its drafts),
# ``JacobiSampler.prefix_matching_next_tokens`` splits each row's outputs into the committed and the
# unmatched ones (the next forward's drafts), ``sampling_logits2tokens`` draws the target samples and
# ``get_multi_token_for_preparation`` the random top-ups. They run here on a synthetic target over an
# H x W grid; what the loop does between forwards (the window updates, row starts and ends: upstream
# ``_sample``, docs/design/row_parallel_upstream.md section 1) is glue written from that reading
# (``_pjd_case``), scaled to a tiny grid (window and start below, upstream 8 and 8).
# (V, grid H, W, window, start, target a, b, cases): chosen so the fixture holds top-row rejections
# and all-accepted rounds, lower rows that accept, reject, and keep drafts by the 1/2 rule, v = 1 rows
_PJD_SETUP = (8, 4, 8, 4, 2, 2.5, 1.0, 8)


class _GridTarget:
    """The synthetic target of the PJD fixture: the logits of the output that predicts grid cell k
    from an input token x are a * A[k % P] + b * B[x] (float64, seeded; x = V is the row-start token,
    upstream's end of line). A distribution that depends on the cell and on the input, so a carried
    draft's acceptance depends on what was committed before it."""

    def __init__(self, V: int, seed: int, a: float, b: float, P: int = 5):
        g = torch.Generator().manual_seed(seed)
        self.A = torch.randn(P, V, generator=g, dtype=torch.float64)
        self.B = torch.randn(V + 1, V, generator=g, dtype=torch.float64)
        self.a, self.b, self.P = a, b, P

    def logits(self, cell: int, x: int) -> torch.Tensor:
        return self.a * self.A[cell % self.P] + self.b * self.B[x]


def _pjd_case(mod, sampler_cls, target: _GridTarget, H: int, W: int, V: int, window: int, start: int,
              generator: torch.Generator) -> list[dict]:
    """One image of PJD's schedule on an H x W grid (batch 1) with upstream's functions of ``mod``;
    returns one record per forward. Row r's image tokens are counted by ``n[r]`` (upstream's
    ``row_token_num`` less its leading w / end of line); a row's anchor is its latest token, or the
    row-start token V before its first one."""
    from types import SimpleNamespace

    from transformers.generation.logits_process import LogitsProcessorList

    identity = LogitsProcessorList()  # Lumina's image mask and top-2000 leave V image tokens unchanged
    img_vocab = torch.arange(V)
    jacobi = mod.renew_sampler(type("Model", (torch.nn.Module,), {}))  # upstream's mixin over a model class
    grid = [[] for _ in range(H)]
    # token (0, 0): a plain sample (upstream's first image step, v = 1)
    with _Draws() as draws:
        p00 = torch.softmax(target.logits(0, V), -1)
        t00 = int(torch.multinomial(p00.unsqueeze(0), 1, generator=generator)[0, 0])
    draws.take("multinomial")
    grid[0].append(t00)
    ongoing = [0]
    v = torch.zeros(H, dtype=torch.long)
    keep, jac = torch.zeros(H, dtype=torch.long), torch.zeros(H, dtype=torch.long)
    carry = {0: ([], [])}
    v[0] = min(W - 1, window)
    jac[0] = v[0] - 1
    out = []
    while ongoing:
        with _Draws() as draws:
            ids = torch.tensor([[t for row in grid for t in row]])
            tcs = torch.zeros(1, ids.shape[1], V, dtype=torch.float64)  # committed scores: never read here
            rand_tokens, rand_scores = mod.get_multi_token_for_preparation(
                img_vocab=img_vocab, rand_token_num=jac, ongoing_row_list=torch.tensor(ongoing), input_ids=ids,
                temporary_collected_scores=tcs, device="cpu")
            toks, q, cells, rows_of = [], [], [], []
            used = 0
            for r in ongoing:
                anchor = grid[r][-1] if grid[r] else V
                toks.append(anchor)
                q.append(torch.zeros(V, dtype=torch.float64))  # the anchor is never tested
                ct, cs = carry[r]
                toks += ct[: int(keep[r])]
                q += cs[: int(keep[r])]
                toks += rand_tokens[0, used: used + int(jac[r])].tolist()
                q += list(rand_scores[0, used: used + int(jac[r])])
                used += int(jac[r])
                cells += [r * W + len(grid[r]) + j for j in range(int(v[r]))]
                rows_of += [r] * int(v[r])
            window_ids = torch.tensor([toks])
            window_q = torch.stack(q).unsqueeze(0)
            logits = torch.stack([target.logits(c, x) for c, x in zip(cells, toks)]).unsqueeze(0)
            next_tokens, p = mod.sampling_logits2tokens(
                logits, ids, torch.ones(1, dtype=torch.long), 0, output_token_num=len(toks),
                logits_processor=identity, logits_warper=None, do_sample=True, has_eos_stopping_criteria=False,
                do_cfg=False, generator=generator)
            sampler = sampler_cls(
                generator=generator, reject_sampling_relative_ids=-torch.ones(1, dtype=torch.long),
                reject_sampling_draft_token_logits=torch.zeros((1, V), dtype=torch.long),
                sampling_last_draft_token=torch.zeros((1,), dtype=torch.long))
            record_call, raw, resid_calls = _recording(sampler, p)
            state = SimpleNamespace(ongoing_row_list=torch.tensor(ongoing), verify_num=v.clone())
            m, n_unmatched, matched, unmatched, _, unmatched_s = jacobi.prefix_matching_next_tokens(state, model_input_ids=window_ids, next_tokens=next_tokens,
                                             next_token_scores=p, input_token_scores=window_q,
                                             prefix_token_sampler=record_call, logits_processor=identity,
                                             logits_warper=None, all_collected_input_ids=ids)
        fm, res_tokens, res_scores = raw["ret"]
        topup = draws.take("randint")["out"][0]
        tgt = draws.take("multinomial")
        rs = draws.take("rand")["out"]
        resid = [draws.take("multinomial") for _ in resid_calls]
        assert not draws.events, f"unexpected upstream draws: {[e['kind'] for e in draws.events]}"
        assert torch.equal(tgt["probs"], p[0]) and torch.equal(tgt["out"][:, 0], next_tokens[0])
        out.append({"rows": list(ongoing), "v": [int(v[r]) for r in ongoing], "keep": [int(keep[r]) for r in ongoing],
                    "n": [len(grid[r]) for r in ongoing], "window": window_ids[0], "window_q": window_q[0],
                    "cells": torch.tensor(cells), "logits": logits[0], "p": p[0], "u_target": tgt["u"][:, 0],
                    "target_tokens": next_tokens[0], "rs": rs[0], "topup": topup.long(),
                    "resid_slot": resid_calls, "resid_u": [e["u"][0, 0] for e in resid],
                    "resid_probs": [e["probs"][0] for e in resid], "first_misaligned": list(fm[0]),
                    "next_tokens": res_tokens[0], "next_scores": res_scores[0], "matched": m.clone()})
        # the glue (upstream _sample, after verification): commit, carry, new windows, row starts and ends
        mt, ut, us_ = matched[0].tolist(), unmatched[0].tolist(), list(unmatched_s[0])
        done = []
        for i, r in enumerate(list(ongoing)):
            k, left = int(m[i]), int(n_unmatched[i])
            grid[r] += mt[:k]
            mt = mt[k:]
            carry[r] = (ut[:left], us_[:left])
            ut, us_ = ut[left:], us_[left:]
            v[r] = min(W - len(grid[r]), window) if i == 0 else min(len(grid[ongoing[i - 1]]) - len(grid[r]), window)
            keep[r] = left if left < v[r] - 1 else v[r] - 1
            jac[r] = v[r] - 1 - keep[r]
            if len(grid[r]) >= start and r < H - 1 and r + 1 not in ongoing and not grid[r + 1]:
                ongoing.append(r + 1)
                v[r + 1] = min(len(grid[r]), window)
                jac[r + 1], keep[r + 1] = v[r + 1] - 1, 0
                carry[r + 1] = ([], [])
            if len(grid[r]) == W:
                v[r] = keep[r] = jac[r] = 0
                done.append(r)
        for r in done:
            ongoing.remove(r)
        if ongoing:  # the new top row: top-row windows
            top = ongoing[0]
            v[top] = min(W - len(grid[top]), window)
            keep[top] = min(len(carry[top][0]), v[top] - 1)
            jac[top] = v[top] - 1 - keep[top]
    assert all(len(row) == W for row in grid)
    return out, t00


def make_pjd_sampler(root: Path, out_dir: Path, manifest: dict) -> None:
    """boyaliao/PJD ``scheduler/jacobi_iteration_lumina_mgpt.py``: PJD's multi-row verification."""
    V, H, W, window, start, a, b, n_cases = _PJD_SETUP
    with upstream_path(root, ("scheduler",)):
        mod = importlib.import_module("scheduler.jacobi_iteration_lumina_mgpt")
        records, firsts = [], []
        for c in range(n_cases):
            torch.manual_seed(300 + c)  # the top-ups' torch.randint uses the global generator
            gen = torch.Generator().manual_seed(400 + c)  # upstream's self.generator
            recs, t00 = _pjd_case(mod, mod.SpeculativeSampler, _GridTarget(V, 11, a, b), H, W, V, window, start, gen)
            for rec in recs:
                rec["case"] = c
            records += recs
            firsts.append(t00)
    R, N = len(records), H * window  # N: the most inputs a forward holds
    inp = {"case": torch.tensor([r["case"] for r in records]),
           "rows": torch.full((R, H), -1, dtype=torch.long), "v": torch.zeros(R, H, dtype=torch.long),
           "keep": torch.zeros(R, H, dtype=torch.long), "n": torch.zeros(R, H, dtype=torch.long),
           "window": torch.full((R, N), -1, dtype=torch.long), "window_q": torch.zeros(R, N, V, dtype=torch.float64),
           "logits": torch.zeros(R, N, V, dtype=torch.float64), "u_target": torch.full((R, N), -1.0, dtype=torch.float64),
           "rs": torch.zeros(R, N, V, dtype=torch.float64), "topup": torch.full((R, N), -1, dtype=torch.long),
           "resid_u": torch.full((R, N), -1.0, dtype=torch.float64)}
    outp = {"p": torch.zeros(R, N, V, dtype=torch.float64), "target_tokens": torch.full((R, N), -1, dtype=torch.long),
            "first_misaligned": torch.full((R, H), -1, dtype=torch.long), "matched": torch.full((R, H), -1, dtype=torch.long),
            "next_tokens": torch.full((R, N), -1, dtype=torch.long), "next_scores": torch.zeros(R, N, V, dtype=torch.float64),
            "resid_probs": torch.zeros(R, N, V, dtype=torch.float64), "resid_token": torch.full((R, N), -1, dtype=torch.long)}
    for i, r in enumerate(records):
        k, L = len(r["rows"]), r["window"].shape[0]
        for key in ("rows", "v", "keep", "n"):
            inp[key][i, :k] = torch.tensor(r[key])
        outp["first_misaligned"][i, :k] = torch.tensor(r["first_misaligned"])
        outp["matched"][i, :k] = r["matched"]
        for key in ("window", "window_q", "logits", "u_target", "rs"):
            inp[key][i, :L] = r[key]
        inp["topup"][i, : r["topup"].shape[0]] = r["topup"]
        for key in ("p", "target_tokens", "next_tokens", "next_scores"):
            outp[key][i, :L] = r[key]
        for s, uu, pr in zip(r["resid_slot"], r["resid_u"], r["resid_probs"]):
            inp["resid_u"][i, s] = uu
            outp["resid_probs"][i, s] = pr
            outp["resid_token"][i, s] = r["next_tokens"][s - 1]
    config = {"V": V, "H": H, "W": W, "window": window, "start": start, "cases": n_cases, "forwards": R,
              "first_tokens": firsts, "dtype": "float64", "keep_above": 0.5,
              "target": {"a": a, "b": b, "P": 5, "seed": 11,
                         "logits": "a * A[cell % P] + b * B[input token], A, B ~ N(0, 1) (float64); "
                                   "input token V = a row's start (upstream's end of line)"},
              "img_vocab": f"0..{V - 1}", "logits_processor": "LogitsProcessorList() (identity)"}
    note = (f"{n_cases} images of an {H} x {W} grid (batch 1, V={V}, window {window}, row r+1 starts when row r has "
            f"{start} tokens) on a synthetic target; one record per forward f (inputs padded with -1 / 0 to "
            f"N={N}): in.rows / .v / .keep / .n (the active rows, top first, their windows, carried drafts and "
            "committed tokens before the forward), in.window / .window_q (each row's anchor then its drafts, and "
            "the q upstream tests them with), in.topup (get_multi_token_for_preparation's torch.randint ids, in "
            "row order), in.logits, out.p (sampling_logits2tokens' probabilities), in.u_target / "
            "out.target_tokens (the target samples), in.rs (the acceptance uniforms, torch.rand (N, V): draft i "
            "is tested with rs[i, window[i]] against p[i - 1]), in.resid_u / out.resid_probs / out.resid_token "
            "(the top row's residual draw, at the rejected input slot), out.first_misaligned (the sampler's per "
            "row index), out.matched (prefix_matching_next_tokens' commits per row), out.next_tokens / "
            "out.next_scores (the sampler's resampled tokens and scores: a row's first out.matched outputs are "
            "committed, the rest are the next forward's drafts). torch.multinomial replaced by a recorded "
            "inverse-CDF draw (_Draws); float64. Upstream code: an excerpt of the module (the four definitions "
            "named in upstream_source, code lines verbatim) from the code index's copy; no git snapshot could "
            "be had")
    save(out_dir, "sampler_pjd", "sampler_pjd", {}, inp, outp, config, manifest, UPSTREAM_REPOS["pjd"],
         checkout_commit(root), "scheduler/jacobi_iteration_lumina_mgpt.py (SpeculativeSampler.__call__, "
         "JacobiSampler.prefix_matching_next_tokens, sampling_logits2tokens, get_multi_token_for_preparation)",
         1e-12, note)


# ------------------------------------------------------------------------------------ ZipAR (LlamaGen)
# (case, cfg_scale, temperature, top_k, uniform seed): guided at upstream's cfg 2.0 with plain softmax;
# unguided with a temperature and a top-k, so the sampler's warping is compared too
_ZIPAR_CASES = (("cfg2", 2.0, 1.0, 0, 21), ("cfg1", 1.0, 0.9, 12, 22))


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token where ``u * mass`` falls in the CDF (token order) of each row of ``probs`` (float64),
    the last token with mass if rounding overshoots: ``_Draws``' draw, the law of ``torch.multinomial``."""
    p = probs.to(torch.float64)
    cdf = p.cumsum(-1)
    t = torch.searchsorted(cdf.contiguous(), (u.unsqueeze(-1) * cdf[:, -1:]).contiguous(), right=True)[:, 0]
    last = p.shape[-1] - 1 - torch.flip(p > 0, dims=[-1]).to(torch.int8).argmax(-1)
    return torch.minimum(t, last)


def _zipar_case(gen, model, caption, emb_mask, T: int, N: int, cfg_scale: float, temperature: float, top_k: int,
                seed: int) -> dict:
    """One run of upstream's ``generate_zipar.generate`` (t2i, batch = the real rows + one PROBE row,
    the last) with its model's ``forward`` and ``generate_zipar.sample`` wrapped to record, and
    ``torch.multinomial`` replaced inside ``sample``: the real rows draw by inverse CDF from a recorded
    uniform (the same law), the probe row "draws" the image index of the cell being sampled, so its
    fed tokens are the grid indices of what every query fed (aux copies included; upstream's own
    bookkeeping moves them; its final tokens must come out as 0..N-1). Per forward: the fed tokens,
    ``input_pos``, upstream's CFG-combined logits of every query (its formula; each ``sample`` call's
    logits are checked to be one of them, bit for bit) and, read from every layer's static
    ``KVCache`` after the forward wrote its entries, the image slots whose keys and values are all zero
    (not written yet)."""
    B = caption.shape[0] - 1  # real rows; the probe is the last
    forwards, state = [], {}
    g = torch.Generator().manual_seed(seed)
    orig_forward, orig_sample, orig_multinomial = model.forward, gen.sample, torch.multinomial

    def forward(idx, cond_idx, input_pos=None, *args, **kw):
        logits, loss = orig_forward(idx, cond_idx, input_pos, *args, **kw)
        if cfg_scale > 1.0:  # generate_zipar's combination (prefill, decode_one_token, decode_n_tokens_zipar)
            cond_l, uncond_l = torch.split(logits, len(logits) // 2, dim=0)
            comb = uncond_l + (cond_l - uncond_l) * cfg_scale
        else:
            comb = logits
        zero = torch.stack([((layer.attention.kv_cache.k_cache[:, :, T:T + N] == 0).all(-1).all(1)
                             & (layer.attention.kv_cache.v_cache[:, :, T:T + N] == 0).all(-1).all(1))
                            for layer in model.layers])  # (layers, rows, N)
        assert (zero == zero[0, 0]).all(), "zero slots differ between layers or rows"
        pos = input_pos.to(torch.long).clone()
        m = pos.shape[0]
        fed = None if idx is None else idx[: B + 1].clone()  # the cond half (the uncond half is the same)
        forwards.append({"pos": pos, "fed": fed, "logits": comb.clone(),
                         "zero": ((T + torch.arange(N)).unsqueeze(0) <= pos.unsqueeze(1)) & zero[0, 0],
                         "sampled": [False] * m, "u": torch.full((m, B), float("nan"), dtype=torch.float64),
                         "probs": torch.zeros(m, B, comb.shape[-1]), "tok": torch.full((m, B), -1)})
        return logits, loss

    def multinomial(probs, num_samples, replacement=False, *, generator=None):
        assert num_samples == 1 and probs.shape[0] == B + 1
        u = torch.rand(B, generator=g, dtype=torch.float64)
        state["u"], state["probs"] = u, probs[:B].clone()
        return torch.cat([_inverse_cdf(probs[:B], u), torch.tensor([state["cell"]])]).unsqueeze(1)

    def sample(logits, **kw):
        f = forwards[-1]
        lg = logits[:, -1, :]
        cols = [j for j in range(f["logits"].shape[1]) if torch.equal(f["logits"][:, j], lg)]
        assert len(cols) == 1, f"sample() got logits that are not exactly one query's of the last forward: {cols}"
        j = cols[0]
        state["cell"] = int(f["pos"][j]) - T + 1  # the query at position p draws cell p - T + 1 (checked below)
        torch.multinomial = multinomial
        try:
            idx, probs = orig_sample(logits, **kw)
        finally:
            torch.multinomial = orig_multinomial
        f["sampled"][j] = True
        f["u"][j], f["probs"][j], f["tok"][j] = state["u"], state["probs"], idx[:B, 0]
        return idx, probs

    model.reset_zipar()  # as sample_c2i_ddp_zipar.py does after every batch
    model.forward = forward
    gen.sample = sample
    try:
        with torch.no_grad():
            ids = gen.generate(model, caption, N, emb_masks=emb_mask.clone(), cfg_scale=cfg_scale,
                               temperature=temperature, top_k=top_k, top_p=1.0)
    finally:
        del model.forward
        gen.sample = orig_sample
        torch.multinomial = orig_multinomial
    assert ids.shape == (B + 1, N)
    assert torch.equal(ids[B], torch.arange(N)), f"probe row: {ids[B].tolist()}"  # each draw landed in its cell
    # flatten to entries (one per query, feed order); entry 0 = the prefill's last text slot (position -1)
    e = {k: [] for k in ("fwd", "pos", "fed_index", "fed_tokens", "logits", "zero", "sample", "u", "probs", "tok")}
    for k, f in enumerate(forwards):
        cols = [len(f["pos"]) - 1] if k == 0 else range(len(f["pos"]))  # the prefill: its last slot only
        for j in cols:
            p = int(f["pos"][j]) - T
            e["fwd"].append(k)
            e["pos"].append(p)
            e["fed_index"].append(-1 if f["fed"] is None else int(f["fed"][B, j]))
            e["fed_tokens"].append(torch.full((B,), -1) if f["fed"] is None else f["fed"][:B, j])
            e["logits"].append(f["logits"][:B, j])
            e["zero"].append(f["zero"][j])
            e["sample"].append(p + 1 if f["sampled"][j] else -1)
            e["u"].append(f["u"][j]), e["probs"].append(f["probs"][j]), e["tok"].append(f["tok"][j])
    out = {"fwd": torch.tensor(e["fwd"]), "pos": torch.tensor(e["pos"]), "fed_index": torch.tensor(e["fed_index"]),
           "sample": torch.tensor(e["sample"]), "fed_tokens": torch.stack(e["fed_tokens"], 1),
           "logits": torch.stack(e["logits"], 1), "zero_slots": torch.stack(e["zero"]),
           "u": torch.stack(e["u"], 1), "probs": torch.stack(e["probs"], 1), "drawn": torch.stack(e["tok"], 1),
           "tokens": ids[:B].clone()}
    s = out["sample"] >= 0
    assert sorted(out["sample"][s].tolist()) == list(range(N))  # every cell drawn once
    assert torch.equal(out["tokens"][:, out["sample"][s]], out["drawn"][:, s])  # and kept as drawn
    return out


def make_zipar_llamagen(root: Path, out_dir: Path, manifest: dict) -> None:
    """ThisisBillhe/ZipAR ``LlamaGen-ZipAR/autoregressive/models/generate_zipar.py`` (``generate``:
    prefill, row 0 by ``decode_n_tokens``, the rest by ``decode_n_tokens_zipar``) on its ``gpt.py``
    ``Transformer`` (t2i: our class has no c2i path; a left-padded caption as ``sample_t2i.py`` feeds
    it), a 5 x 5 grid, ``zipar_window_size`` 2 (row r-1 then leads row r by 4 of 5 tokens when row r+1
    starts, so the auxiliary token comes from an unfinished row: upstream's ``need_clear_last_kvcache``
    case). Nothing is stubbed; ``_zipar_case`` records (see there)."""
    src = root / "LlamaGen-ZipAR" if (root / "LlamaGen-ZipAR").is_dir() else root
    commit = checkout_commit(root)
    H, window = 5, 2
    with upstream_path(src, ("autoregressive", "utils", "tokenizer", "language", "dataset")):
        gpt = importlib.import_module("autoregressive.models.gpt")
        gen = importlib.import_module("autoregressive.models.generate_zipar")
        cfg = {"dim": 32, "n_layer": 2, "n_head": 2, "vocab_size": 32, "cls_token_num": 120, "caption_dim": 16,
               "block_size": H * H, "multiple_of": 16, "norm_eps": 1e-5, "rope_base": 10000.0}
        torch.manual_seed(0)
        model = gpt.Transformer(gpt.ModelArgs(model_type="t2i", **cfg)).eval()
        randomize(model, seed=5, std=0.3)
        round_fp16(model)
        model.zipar_window_size = window  # as sample_c2i_ddp_zipar.py sets it
        weights = {k: v.clone() for k, v in model.state_dict().items() if "kv_cache" not in k and k != "freqs_cis"}
        T, N = cfg["cls_token_num"], cfg["block_size"]
        g = torch.Generator().manual_seed(6)
        valid = [7, T, T]  # two real captions (7 and 120 valid slots), the probe row last
        emb_mask = left_padded_mask(valid, T)
        caption = torch.randn(len(valid), T, cfg["caption_dim"], generator=g) * emb_mask[:, :, None]
        inputs = {"caption": caption[:-1], "emb_mask": emb_mask[:-1]}
        outputs, cases = {}, {}
        for name, cfg_scale, temperature, top_k, seed in _ZIPAR_CASES:
            rec = _zipar_case(gen, model, caption, emb_mask, T, N, cfg_scale, temperature, top_k, seed)
            for k in ("fwd", "pos", "fed_index", "sample", "fed_tokens", "u"):
                inputs[f"{name}.{k}"] = rec[k]
            for k in ("logits", "zero_slots", "probs", "drawn", "tokens"):
                outputs[f"{name}.{k}"] = rec[k]
            cases[name] = {"cfg_scale": cfg_scale, "temperature": temperature, "top_k": top_k, "top_p": 1.0,
                           "uniform_seed": seed, "entries": int(rec["pos"].shape[0]),
                           "forwards": int(rec["fwd"].max()) + 1,
                           "entries_with_zero_slots": int(rec["zero_slots"].any(-1).sum()),
                           "logit_scale": round(rec["logits"].abs().max().item(), 3)}
    config = dict(cfg, height=H, width=H, window=window, valid=valid[:-1], cases=cases)
    note = (f"upstream generate() on a {H}x{H} grid, window {window}, batch 2 (left-padded captions, {valid[0]} and "
            f"{T} valid slots) + a probe row (not stored) whose draws are the cells' indices; per case (cfg2: cfg 2.0, "
            "temperature 1; cfg1: unguided, temperature 0.9, top-k 12), one entry per query in feed order (entry 0: "
            "the prefill's last text slot, position -1): in.<case>.fwd (forward, 0 = prefill), .pos (input_pos - "
            "cls_token_num), .fed_index (the grid index of the fed token, from the probe row), .fed_tokens (B, E), "
            ".sample (the cell its output draws, -1 unused), .u (B, E) the uniform of the draw (NaN unused); "
            "out.<case>.logits (B, E, V) after CFG, .zero_slots (E, N) image slots <= the query's position still "
            "all-zero in every layer's static cache when it ran, .probs (B, E, V) the warped p upstream drew from, "
            ".drawn (B, E), .tokens (B, N) generate()'s output. torch.multinomial replaced inside sample() by an "
            "inverse-CDF draw from the recorded uniform (float64 CDF; the same law); fp32 model, weights fp16-exact")
    save(out_dir, "zipar_llamagen", "zipar_llamagen", weights, inputs, outputs, config, manifest,
         UPSTREAM_REPOS["zipar"], commit,
         "LlamaGen-ZipAR/autoregressive/models/generate_zipar.py (generate, decode_n_tokens_zipar, sample "
         "recorded), LlamaGen-ZipAR/autoregressive/models/gpt.py (Transformer t2i, KVCache, reset_zipar)",
         tolerance=1e-4, note=note)


# ------------------------------------------------------------------------------------ main
FAMILIES = {
    "llamagen": [make_llamagen_gpt, make_llamagen_vq],
    "lantern": [make_lantern_llamagen, make_lantern_eagle, make_lantern_eagle_lumina],
    "lumina": [make_lumina_chameleon, make_vqgan],
    "mar": [make_mar, make_kl16],
    "xar": [make_xar],
    "harmon": [make_harmon],
    "sjd": [make_sjd_sampler],
    "scd": [make_scd_sampler],
    "gsd": [make_gsd_sampler],
    "sjd_pac": [make_sjd_pac_sampler],
    "zipar": [make_zipar_llamagen],
    "pjd": [make_pjd_sampler],
    "disa": [make_disa],
}
EXTRA = {"llamagen": [make_t5]}  # run after every family (make_t5 reads LANTERN's prompt files when given)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llamagen", type=Path, help="checkout of FoundationVision/LlamaGen")
    ap.add_argument("--lantern", type=Path, help="checkout of jadohu/LANTERN")
    ap.add_argument("--lumina", type=Path, help="checkout of Alpha-VLLM/Lumina-mGPT")
    ap.add_argument("--mar", type=Path, help="checkout of LTH14/mar")
    ap.add_argument("--xar", type=Path, help="checkout of OliverRensu/xAR")
    ap.add_argument("--harmon", type=Path, help="checkout of wusize/Harmon (git archive; UPSTREAM_COMMIT)")
    ap.add_argument("--sjd", type=Path, help="checkout of tyshiwo1/Accelerating-T2I-AR-with-SJD (sampler only)")
    ap.add_argument("--scd", type=Path, help="checkout of junhyukso/SCD (MC-SJD sampler only)")
    ap.add_argument("--gsd", type=Path, help="checkout of junhyukso/GSD (sampler only)")
    ap.add_argument("--sjd-pac", type=Path, help="checkout of KangJialiang/SJD-PAC (sampler only)")
    ap.add_argument("--zipar", type=Path,
                    help="checkout of ThisisBillhe/ZipAR (its root or LlamaGen-ZipAR/; git archive: UPSTREAM_COMMIT)")
    ap.add_argument("--pjd", type=Path,
                    help="boyaliao/PJD's scheduler/ (the sampler's definitions; UPSTREAM_COMMIT)")
    ap.add_argument("--disa", type=Path,
                    help="checkout of Qinyu-Allen-Zhao/DiSA (its root or MAR_DiSA/; git archive: UPSTREAM_COMMIT)")
    ap.add_argument("--hf-chameleon", action="store_true",
                    help="also make the transformers ChameleonForConditionalGeneration fixture (installed package)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    torch.set_default_dtype(torch.float32)
    torch.use_deterministic_algorithms(True)
    out_dir = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    mpath = out_dir / "MANIFEST.json"
    manifest = json.loads(mpath.read_text()) if mpath.is_file() else {"files": {}}
    cmd = ["python", "tools/make_upstream_fixtures.py", *(argv if argv is not None else sys.argv[1:])]
    manifest["command"] = shlex.join(cmd)  # recorded in every file entry this run writes
    manifest["torch"] = torch.__version__
    try:
        import transformers
        manifest["transformers"] = transformers.__version__
    except ImportError:
        pass
    given = {name: getattr(args, name) for name in FAMILIES if getattr(args, name) is not None}
    if not given and not args.hf_chameleon:
        ap.error("give at least one upstream checkout (--llamagen, --lantern, --lumina, --mar, --xar, --harmon, "
                 "--sjd, --scd, --gsd, --sjd-pac, --zipar, --pjd, --disa) "
                 "or --hf-chameleon")
    for name, root in given.items():
        if not root.is_dir():
            raise SystemExit(f"--{name} {root}: not a directory (a checkout of {UPSTREAM_REPOS[name]})")
        for make in FAMILIES[name]:
            make(root.resolve(), out_dir, manifest)
    if "lantern" in given:
        manifest["_lantern_root"] = str(given["lantern"].resolve())
    for name, root in given.items():
        for make in EXTRA.get(name, []):
            make(root.resolve(), out_dir, manifest)
    manifest.pop("_lantern_root", None)
    if args.hf_chameleon:
        make_hf_chameleon(out_dir, manifest)
    manifest["files"] = dict(sorted(manifest["files"].items()))
    mpath.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(f"wrote {mpath}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
