"""EAGLE-1 feature drafter for Lumina-mGPT (LANTERN's ``models/drafters/cnets_lumina_mgpt.py``
``Model``, driven as ``models/ea_model_lumina_mgpt.py`` drives it; jadohu/LANTERN @ 3a56e45).

A separate model file, not a generalisation of ``coolsd.models.eagle.model`` (LlamaGen's head): the
differences are structural, not parameters --

* the decoder layer is a full Chameleon layer (``coolsd.models.chameleon.ChameleonDecoderLayer``):
  layer 0 KEEPS ``input_layernorm`` (LlamaGen's EAGLE-1 head drops it), and attention has
  Chameleon's per-head q/k LayerNorm, stored as ONE (1, head_dim) affine shared by every head
  (LANTERN's config has ``model_parallel_size = 1``; ``ChameleonLayerNorm.repeat_param``
  repeat-interleaves it over heads);
* 1D RoPE over the WHOLE token sequence (text prompt, ``<racm3:break>``, the two grid-size
  tokens, image tokens AND the row-end newlines), positions ``attention_mask.cumsum(-1) - 1``;
* the embedding covers Chameleon's full BPE vocabulary (65536): the drafter's inputs are BPE
  ids, its logits (through the target's frozen ``lm_head``) are restricted to the image codes.
* residual dropout (LANTERN's config: ``dropout: 0.05``) in training only.

State-dict keys (LANTERN's, ``strict=True``): ``embed_tokens.weight``, ``fc.weight``,
``fc.bias``, ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
``layers.0.self_attn.{q,k}_norm.{weight,bias}`` (1, head_dim),
``layers.0.mlp.{gate,up,down}_proj.weight``, ``layers.0.{input,post_attention}_layernorm.weight``.

Sequence layout (EAGLE-1, ``topK_generate``): drafter entry i is (BPE id s_{i+1}, target feature
f_i) at logical position i (the position of the FEATURE's token, one less than the target's
position of s_{i+1}); its output predicts f_{i+1}, whose logits predict s_{i+2}.
* Conditional half: s = [prompt ids, <racm3:break>, h-grid, w-grid, image tokens with a
  newline after every row but the last]; the text prompt is a prefix of entries (the
  target hands over every prefill slot's feature: ``LuminaTarget(prefill_features="all")``).
* Unconditional half: LANTERN zero-pads its features on the left and masks every slot before
  ``<racm3:break>`` (``attn_mask`` of ``EaLumina_mGPT.generate``), so its first visible entry
  is (h-grid, f_uncond[<racm3:break>]) at position 0; here those masked entries simply do not
  exist (per-row cache lengths).
* Logits: ``uncond + s * (cond - uncond)`` over the image codes (LANTERN: over the full vocab,
  then ``MultiModalLogitsProcessor`` suppresses every non-image id: the same distribution).

Structural tokens are never drafted (docs/methods.md#3-lantern-and-lantern): the loop sees image codes only, as with
``LuminaTarget``. LANTERN's drafter drafts the newline as a forced tree node; here the adapter
inserts it: for every image entry that ends a row (not the last row) a newline entry follows
in the same ``forward``, its input feature the drafter's own output at the row-end token, and
the node reports the NEWLINE's output (which predicts the next row's first token), exactly as
the target reports it. DEVIATION: on verified context LANTERN feeds the newline entry the
target's feature at the row-end token; ``LuminaTarget`` hands over one feature per image token
(the one after its newline), so the drafter's own prediction of that feature stands in (one
entry per row of 48; everything else uses the target's features).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

import torch
import torch.nn as nn

from coolsd.engine import batch_invariant
from coolsd.engine.host_reads import host_checks
from coolsd.engine.model_protocol import StepOut, id_list
from coolsd.models.blocks import compute_dtype
from coolsd.models.chameleon import ChameleonConfig, ChameleonDecoderLayer, HeadLayerNorm, rope_1d
from coolsd.models.eagle.model import head_logits, read_drafter_folder, warn_variant_mismatch
from coolsd.models.guided import GuidedCacheModel
from coolsd.models.kv_cache import KVCache
from coolsd.models.row_ends import RowEndTarget
from coolsd.util.loading import BadInputFile, check_state_dict, read_torch_checkpoint

LUMINA_DRAFTER_SOURCE = (
    "LANTERN's trained Lumina-mGPT drafter folder (ckpts/lumina_mgpt/trained_drafters/: config.json + "
    "pytorch_model.bin or model.safetensors; a release was reported in github.com/jadohu/LANTERN issue #1), "
    "or train one: python -m coolsd.cli.train_drafter target=lumina_mgpt")


# ---------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class LuminaEagleConfig:
    hidden_size: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int  # the full BPE vocabulary (the embedding's rows)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    num_hidden_layers: int = 1
    bias: bool = True  # fc bias (LANTERN: config "bias", default on)
    dropout: float = 0.0  # residual dropout while training (LANTERN's config: 0.05)

    def __post_init__(self):
        self.chameleon()  # hidden a multiple of the heads, even head_dim
        if self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers must be >= 1, got {self.num_hidden_layers}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def chameleon(self) -> ChameleonConfig:
        """The Chameleon config of the drafter's decoder layers (RoPE table, norms)."""
        return ChameleonConfig(hidden_size=self.hidden_size, num_layers=self.num_hidden_layers,
                               num_heads=self.num_attention_heads, intermediate_size=self.intermediate_size,
                               vocab_size=self.vocab_size, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta)

    @classmethod
    def for_target(cls, target: ChameleonConfig, **overrides) -> "LuminaEagleConfig":
        """LANTERN's drafter for a Chameleon target: its width, heads, FFN size, vocabulary, eps, theta."""
        base = dict(hidden_size=target.hidden_size, num_attention_heads=target.num_heads,
                    intermediate_size=target.intermediate_size, vocab_size=target.vocab_size,
                    rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta)
        base.update(overrides)
        return cls(**base)

    @classmethod
    def from_lantern(cls, config: Mapping[str, Any]) -> "LuminaEagleConfig":
        """From LANTERN's drafter ``config.json`` (``data/configs/lumina_mgpt_config.json``).
        Settings this implementation does not have are refused, not ignored."""
        wanted = {"hidden_act": "silu", "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
                  "swin_norm": False, "model_parallel_size": 1}
        bad = {k: config.get(k, v) for k, v in wanted.items() if config.get(k, v) != v}
        heads = config.get("num_attention_heads")
        if config.get("num_key_value_heads", heads) != heads:
            bad["num_key_value_heads"] = config["num_key_value_heads"]
        if bad:
            raise ValueError(f"unsupported drafter config settings {bad}; supported: {wanted}, no grouped-query attention")
        try:
            return cls(hidden_size=int(config["hidden_size"]), num_attention_heads=int(heads),
                       intermediate_size=int(config["intermediate_size"]), vocab_size=int(config["vocab_size"]),
                       rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
                       rope_theta=float(config.get("rope_theta", 10000.0)),
                       num_hidden_layers=int(config.get("num_hidden_layers", 1)), bias=bool(config.get("bias", True)),
                       dropout=float(config.get("dropout", 0.0)))
        except (KeyError, TypeError) as e:
            raise ValueError(f"drafter config.json lacks or mistypes {e}") from None

    def to_lantern_json(self) -> dict:
        """A LANTERN-style ``config.json`` that ``from_lantern`` (and LANTERN's ``EConfig``) reads."""
        return {"architectures": ["ChameleonForConditionalGeneration"], "model_type": "chameleon",
                "hidden_act": "silu", "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_attention_heads,
                "num_hidden_layers": self.num_hidden_layers, "rms_norm_eps": self.rms_norm_eps,
                "rope_theta": self.rope_theta, "rope_scaling": None, "vocab_size": self.vocab_size,
                "attention_bias": False, "mlp_bias": False, "swin_norm": False, "model_parallel_size": 1,
                "attention_dropout": 0.0, "dropout": self.dropout, "bias": self.bias}

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# LANTERN's data/configs/lumina_mgpt_config.json (Lumina-mGPT 7B)
LUMINA_MGPT_DRAFTER = LuminaEagleConfig(hidden_size=4096, num_attention_heads=32, intermediate_size=11008,
                                        vocab_size=65536, dropout=0.05)


# ---------------------------------------------------------------------------------------- head
class LuminaEagleHead(nn.Module):
    """(BPE ids, features, positions) -> predicted features, LANTERN's ``Model.forward``:
    ``x = fc(cat(embed(ids), f))`` then Chameleon decoder layers, NO final norm (the frozen
    target ``lm_head`` reads the output directly, ``head(out_hidden)`` upstream)."""

    def __init__(self, cfg: LuminaEagleConfig, embed_weight: Optional[torch.Tensor] = None):
        super().__init__()
        self.config = cfg
        self._ccfg = cfg.chameleon()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if embed_weight is not None:
            if tuple(embed_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
                raise ValueError(f"embedding must be {(cfg.vocab_size, cfg.hidden_size)}, got {tuple(embed_weight.shape)}")
            with torch.no_grad():
                self.embed_tokens.weight.copy_(embed_weight)
        self.embed_tokens.weight.requires_grad_(False)  # frozen, as upstream
        self.layers = nn.ModuleList(ChameleonDecoderLayer(self._ccfg) for _ in range(cfg.num_hidden_layers))
        for layer in self.layers:  # LANTERN's q/k norms: one (1, head_dim) affine shared by the heads
            layer.self_attn.q_norm = HeadLayerNorm(1, cfg.head_dim)
            layer.self_attn.k_norm = HeadLayerNorm(1, cfg.head_dim)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    @classmethod
    def from_target(cls, model: nn.Module, seed: Optional[int] = None, **overrides) -> "LuminaEagleHead":
        """A fresh head for a ``ChameleonLM``: its config, its token embedding (copied), dtype and
        device; ``seed`` fixes the initialisation (PyTorch's default Linear init)."""
        cfg = LuminaEagleConfig.for_target(model.config, **overrides)
        emb = model.model.embed_tokens.weight.detach()
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            head = cls(cfg, emb)
        return head.to(device=emb.device, dtype=emb.dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def forward(self, ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                attend: Optional[torch.Tensor] = None, cache: Optional[KVCache] = None,
                valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """ids, positions (B, m); features (B, m, H) -> (B, m, H). Without ``cache``: attention
        over these entries only, ``attend`` (m, m) / (B, m, m) bool (default causal). With it:
        the entries become pending, ``attend`` (m, P+m) / (B, m, P+m) as ``KVCache.prepare``."""
        B, m = ids.shape
        dev = self.device
        x = self.fc(torch.cat([self.embed_tokens(ids.to(dev)).to(self.dtype), features.to(dev, self.dtype)], dim=-1))
        cos, sin = rope_1d(positions.to(dev), self._ccfg, compute_dtype(self.dtype))
        if cache is None:
            if attend is None:
                attend = torch.ones(m, m, dtype=torch.bool, device=dev).tril()
            step = attend.to(dev, torch.bool).expand(B, m, m).unsqueeze(1)
        else:
            step = cache.prepare(attend.to(dev, torch.bool), m, valid)
        for i, layer in enumerate(self.layers):  # upstream ChameleonDecoderLayer.forward, dropout on both residuals
            h = x + self.drop(layer.self_attn(layer.input_layernorm(x), cos, sin, cache, i, step))
            x = h + self.drop(layer.mlp(layer.post_attention_layernorm(h)))
        if cache is not None:
            cache.advance(m)
        return x

    @staticmethod
    def lantern_state(state_dict: Mapping[str, torch.Tensor]) -> dict:
        """A LANTERN drafter state dict in this module's layout: ``module.`` stripped, rotary
        buffers some versions saved (``rotary_emb.inv_freq`` / ``cos_cached`` / ``sin_cached``) dropped."""
        return {k[len("module."):] if k.startswith("module.") else k: v for k, v in state_dict.items()
                if ".rotary_emb." not in k}


# ---------------------------------------------------------------------------------------- drafter
class LuminaEagleDrafter(GuidedCacheModel):
    """``ARModel`` over image codes for ``ModelDrafter``: a ``LuminaEagleHead`` with the text
    prefix, CFG halves and newline entries of the module docstring.

    Bookkeeping mirrors ``LuminaTarget``: caller pending entry -> cache pending index
    (``_p_int``) and its newline's (``_p_nl``, -1 for none); ``commit`` keeps the newline after a
    kept row-end token. Shapes never depend on tensor values (no host reads a round): every new
    entry gets a newline slot, used only where it ends a row. A newline's input feature is this
    forward's output at its row-end token, so a forward whose entries attend earlier NEW entries
    (the verified context) runs in passes, as many as its mask can need; a tree level (siblings
    only) is one pass: its entries, then their newline slots.
    """

    def __init__(self, head: LuminaEagleHead, lm_head_weight: torch.Tensor, code_to_bpe: torch.Tensor, *,
                 h_latent: int, w_latent: int, cfg_scale: float, tokens, cache_headroom: int = 128,
                 compile: bool = False):
        V, H = head.config.vocab_size, head.config.hidden_size
        if isinstance(lm_head_weight, nn.Module):
            lm_head_weight = lm_head_weight.weight
        if tuple(lm_head_weight.shape) != (V, H):
            raise ValueError(f"lm_head weight must be {(V, H)}, got {tuple(lm_head_weight.shape)}")
        self.head = head.eval()
        self.rows = code_to_bpe.to(head.device, torch.long)
        self.lm_head_weight = lm_head_weight.detach()
        self.code_head = self.lm_head_weight[self.rows]  # (n_codes, H): the image vocabulary's lm_head rows
        self.tokens = tokens
        self.h_latent, self.w_latent = int(h_latent), int(w_latent)
        self.n_image_tokens = self.h_latent * self.w_latent
        self.cfg_scale = float(cfg_scale)
        # compile: the drafter's forwards run inside ``ModelDrafter``'s compiled expansion
        # (``coolsd.engine.compiled``) over a static cache; the passes of a forward then come from
        # its entry count alone (no host read inside a graph), and every pass adds 2m pending
        # entries: four times the spare slots
        self.compiled = bool(compile)
        self.cache_headroom = 4 * cache_headroom if compile else cache_headroom
        self.vocab_size = int(self.rows.numel())
        self._alone: Optional[list] = None  # under coolsd.engine.batch_invariant: one batch-1 drafter per sample

    @classmethod
    def for_target(cls, head: LuminaEagleHead, target: Any, compile: bool = False) -> "LuminaEagleDrafter":
        """lm_head, image vocabulary, grid, CFG scale and structural ids of a ``LuminaTarget``."""
        return cls(head, target.model.lm_head.weight, target.vocab.code_to_bpe, h_latent=target.h_latent,
                   w_latent=target.w_latent, cfg_scale=target.cfg_scale, tokens=target.tokens, compile=compile)

    @property
    def device(self) -> torch.device:
        return self.head.device

    def _joined(self, features: torch.Tensor) -> torch.Tensor:
        """(B, m, 2, H) [cond, uncond] -> (2B, m, H); (B, m, H) unguided."""
        if self.guided:
            if features.dim() != 4 or features.shape[2] != 2:
                raise ValueError(f"a guided drafter needs [cond, uncond] features (B, m, 2, H), got {tuple(features.shape)}")
            return torch.cat([features[:, :, 0], features[:, :, 1]])
        if features.dim() != 3:
            raise ValueError(f"features must be (B, m, H), got {tuple(features.shape)}")
        return features

    # The pending entries are kept as ``LuminaTarget`` keeps them (caller pending entry -> cache
    # pending index, ``_p_int``, and its newline's, ``_p_nl``): their reset, count and commit are
    # ``RowEndTarget``'s, over this drafter's cache
    _reset_pending = RowEndTarget._reset_pending
    _pending_count = RowEndTarget._pending_count
    commit = RowEndTarget.commit

    # ------------------------------------------------------------------ ARModel
    @torch.no_grad()
    def begin(self, cond: Any, batch_size: int, context: Optional[StepOut] = None) -> None:
        """Prefill the committed prefix: cond rows (s_{i+1}, f_i) for i = 0..L-2 over prompt +
        structural tokens, uncond rows (h-grid, f[break]), (w-grid, f[h-grid]); the first
        ``forward`` brings the entry (x_0, f[w-grid])."""
        if context is None or context.hidden is None:
            raise ValueError("the Lumina EAGLE drafter needs the target's prefill features "
                             "(LuminaTarget(prefill_features='all'))")
        dev = self.device
        if isinstance(cond, torch.Tensor) and cond.dim() == 2:
            cond = list(cond)
        self._alone = None
        if batch_invariant.active() and batch_size > 1:
            # every sample computed as alone, bit for bit (coolsd.engine.batch_invariant), as LuminaTarget does
            self.batch_size = batch_size
            self.cache = None  # freed before the per-sample caches are allocated
            self._alone = [LuminaEagleDrafter(self.head, self.lm_head_weight, self.rows, h_latent=self.h_latent,
                                              w_latent=self.w_latent, cfg_scale=self.cfg_scale, tokens=self.tokens,
                                              cache_headroom=self.cache_headroom) for _ in range(batch_size)]
            for b, d in enumerate(self._alone):
                d.begin(cond[b : b + 1], 1, StepOut(logits=context.logits[b : b + 1], hidden=context.hidden[b : b + 1]))
            return None
        prompts = [id_list(p) for p in cond]
        if len(prompts) != batch_size:
            raise ValueError(f"cond must be {batch_size} prompt-id sequences")
        t = self.tokens
        struct = [t.image_start, t.grid_base + self.h_latent // 2, t.grid_base + self.w_latent // 2]
        seqs = [p + struct for p in prompts]
        feats = self._joined(context.hidden.to(dev))  # (n, Lc, H), right-aligned per row
        Lc = feats.shape[1]
        if max(len(s) for s in seqs) > Lc:
            raise ValueError(f"the target handed over {Lc} prefill features, the prompts need {max(len(s) for s in seqs)} "
                             "(build the target with prefill_features='all')")
        self.batch_size = batch_size
        rows = [s[1:] for s in seqs] + ([struct[1:]] * batch_size if self.guided else [])
        n = len(rows)
        lens = torch.tensor([len(r) for r in rows], device=dev)
        E = max(len(r) for r in rows)  # host-known: no read of ``lens``
        ids = torch.zeros(n, E, dtype=torch.long, device=dev)
        x = torch.zeros(n, E, feats.shape[-1], dtype=self.head.dtype, device=dev)
        for b, r in enumerate(rows):
            ids[b, : len(r)] = torch.tensor(r, device=dev)
            x[b, : len(r)] = feats[b, Lc - len(r) - 1 : Lc - 1]  # f_0 .. f_{L-2} (the last slot's comes with x_0)
        self.cache = self._new_cache(n, E)
        causal = torch.ones(E, E, dtype=torch.bool, device=dev).tril()
        self.head(ids, x, torch.arange(E, device=dev).expand(n, E), causal, self.cache, valid=lens)
        self.cache.commit(torch.arange(E, device=dev).expand(n, E), lens)
        self._offset = lens  # position of image token 0's entry, per internal row (cond L-1, uncond 2)
        self._reset_pending()
        return None

    def _new_cache(self, n: int, prefix: int) -> KVCache:
        c, h = self.head.config, self.head
        # the sequence's known maximum (as ``LuminaTarget._new_cache``): a decode never grows the cache
        committed = prefix + self.n_image_tokens + self.h_latent
        return self._cache_for((c.num_hidden_layers, n, c.num_attention_heads, c.head_dim, h.dtype, h.device),
                               committed + self.cache_headroom, 64, committed)

    def _mask(self, Ac: torch.Tensor, caller_to_int: torch.Tensor, nl_prev: torch.Tensor, total: int) -> torch.Tensor:
        """(B, r, total) bool over cache pending entries for r rows whose caller-column visibility
        is ``Ac`` (B, r, C): each visible column's entry, plus its newline where it has one
        (``nl_prev`` (B, C'), C' <= C columns that may have one)."""
        B, r, C = Ac.shape
        A = torch.zeros(B, r, total + 1, dtype=torch.bool, device=Ac.device)  # last column: a dump
        A[:, :, caller_to_int] = Ac
        Cn = nl_prev.shape[1]
        add = Ac[:, :, :Cn] & (nl_prev >= 0).unsqueeze(1)
        idx = torch.where(add, nl_prev.unsqueeze(1).expand(B, r, Cn), total)
        A.scatter_(2, idx, add | A.gather(2, idx))
        return A[:, :, :total]

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend: torch.Tensor,
                features: Optional[torch.Tensor] = None) -> StepOut:
        """tokens: (B, m) codes; positions: (B, m) image-token indices j, stepping by one along
        every chain of new entries (a new entry's position is one more than that of the latest
        new entry it attends: a tree's depths, a context's consecutive tokens); attend (m, P+m) or
        (B, m, P+m) over the caller's pending entries then the new ones; features (B, m, [2,] H):
        the target's (or this drafter's) feature at each entry's previous token."""
        if self._alone is not None:
            outs = [d.forward(tokens[b : b + 1], positions[b : b + 1] if positions.shape[0] > 1 else positions,
                              attend[b : b + 1] if attend.dim() == 3 else attend, features[b : b + 1])
                    for b, d in enumerate(self._alone)]
            return StepOut(logits=torch.cat([o.logits for o in outs]), hidden=torch.cat([o.hidden for o in outs]))
        if self.cache is None:
            raise RuntimeError("call begin() first")
        if features is None:
            raise ValueError("an EAGLE drafter needs the target's features")
        dev, B = self.device, self.batch_size
        tokens, j = tokens.to(dev), positions.to(dev).expand(tokens.shape)
        if tokens.shape[0] != B:
            raise ValueError(f"begin() was called for batch {B}, got {tokens.shape[0]}")
        m = tokens.shape[1]
        P = self._p_int.numel()
        Ac = attend.to(dev, torch.bool).expand(B, m, P + m)
        if Ac.shape[-1] != P + m:
            raise ValueError(f"attend must be (.., {m}, {P + m}), got {tuple(attend.shape)}")
        feats = self._joined(features.to(dev, self.head.dtype))
        row_end = ((j + 1) % self.w_latent == 0) & (j + 1 < self.n_image_tokens) & (j >= 0)  # (B, m)
        rel = j + torch.div(j, self.w_latent, rounding_mode="floor")  # (B, m) entry position - image token 0's
        pos = self._double(rel) + self._offset.unsqueeze(1)
        ids = self._double(self.rows[tokens])
        nl_ids = torch.full_like(ids, self.tokens.newline)
        ar_m = torch.arange(m, device=dev)
        # sees_nl[b, c, c']: new entry c sees the newline of the earlier new row-end entry c'
        sees_nl = Ac[:, :, P:] & torch.ones(m, m, dtype=torch.bool, device=dev).tril(-1) & row_end.unsqueeze(1)

        # Every new entry has a newline slot, masked out (never attended, never committed) unless
        # it ends a row in that sample, so the shapes never depend on the positions' values. A
        # newline's input feature is this forward's output at its row-end entry, so the entries
        # run in passes: pass r sees the newlines pass r - 1 made, and every entry with at most r
        # row ends among the new entries it attends is exact after pass r. Positions step by one
        # along a chain, so an entry that attends n earlier new entries has at most ceil(n / w) of
        # them at row ends: passes = 1 + that bound, from the mask alone.
        # Compiled: the bound for an entry that attends every earlier new entry (a level of siblings
        # runs a pass more than it needs; every pass after the last needed one recomputes the same
        # outputs into entries nothing attends).
        most = m - 1 if self.compiled else self._most_attended_new(attend, Ac, P, m)
        passes = 1 + -(-max(most, 0) // self.w_latent)
        if self.compiled:  # a static cache never grows
            self.cache.check_headroom(2 * m * passes, self.cache_headroom)
        if host_checks() and bool((sees_nl.sum(-1) >= passes).any()):
            raise ValueError("positions must step by one along every chain of new entries")
        caller_to_int = self._p_int
        for r in range(passes):
            Pi = self.cache.n_pending
            tok_int = Pi + ar_m  # this pass's entries, then their newline slots at Pi + m + ar_m
            A = self._mask(Ac, torch.cat([caller_to_int, tok_int]), self._p_nl, Pi + m)
            if r:  # the previous pass's newlines (the m slots just before this pass's entries)
                A[:, :, Pi - m : Pi] |= sees_nl
            h_tok = self.head(ids, feats, pos, self._double(A), self.cache)
            # a newline sees what its entry sees, the entry and itself (an unused slot too: its
            # attention row is never empty, so its output stays finite)
            A2 = torch.zeros(B, m, Pi + 2 * m, dtype=torch.bool, device=dev)
            A2[:, :, : Pi + m] = A
            A2[:, ar_m, tok_int] = True
            A2[:, ar_m, tok_int + m] = True
            h_nl = self.head(nl_ids, h_tok, pos + 1, self._double(A2), self.cache)
        self._p_int = torch.cat([caller_to_int, tok_int])
        self._p_nl = torch.cat([self._p_nl, torch.where(row_end, tok_int + m, -1)], 1)
        # a row-end node reports its newline's output (it predicts the next row's first token)
        out = torch.where(self._double(row_end).unsqueeze(-1), h_nl, h_tok)
        return self._guided_out(head_logits(out, self.code_head), out)

    def _most_attended_new(self, attend: torch.Tensor, Ac: torch.Tensor, P: int, m: int) -> int:
        """The most earlier new entries one new entry attends (in any sample): one host read per
        mask object, memoised (the memo holds the mask, so an id is never reused while it is there;
        a drafter's masks are made once per tree and context length)."""
        memo = self.__dict__.setdefault("_attended_memo", {})
        hit = memo.get((id(attend), P, m))
        if hit is None or hit[0] is not attend:
            if len(memo) > 256:
                memo.clear()
            hit = memo[(id(attend), P, m)] = (attend, int(Ac[:, :, P:].tril(-1).sum(-1).max()) if m else 0)
        return hit[1]



# ---------------------------------------------------------------------------------------- loading
def load_lumina_eagle_head(folder, target, variant: Optional[str] = None) -> LuminaEagleHead:
    """LANTERN's Lumina-mGPT drafter folder (``config.json`` + ``pytorch_model.bin`` or
    ``model.safetensors``), strictly loaded for the ``LuminaTarget`` ``target`` (width and
    vocabulary must match it). Every failure is one ``coolsd.util.errors.InputFileError`` naming the file."""

    what = "a LANTERN Lumina-mGPT drafter config.json (hidden_size, num_attention_heads, intermediate_size, vocab_size)"
    d, weights, raw, cfg = read_drafter_folder(folder, "Lumina-mGPT EAGLE drafter folder", what, LUMINA_DRAFTER_SOURCE,
                                               LuminaEagleConfig.from_lantern)
    t = target.model.config
    if (cfg.hidden_size, cfg.vocab_size) != (t.hidden_size, t.vocab_size):
        raise BadInputFile(f"drafter {d} is for hidden {cfg.hidden_size}, vocab {cfg.vocab_size}; the target has "
                           f"{t.hidden_size}, {t.vocab_size} (a drafter of another target; get {LUMINA_DRAFTER_SOURCE})")
    warn_variant_mismatch(raw, variant, d)
    state = LuminaEagleHead.lantern_state(
        read_torch_checkpoint(weights, "Lumina-mGPT EAGLE drafter weights", LUMINA_DRAFTER_SOURCE))
    head = LuminaEagleHead(cfg).to(dtype=target.model.dtype)  # the target's dtype BEFORE the copy: no rounding via fp32
    check_state_dict(head, state, weights, LUMINA_DRAFTER_SOURCE)
    head.load_state_dict(state, strict=True)
    head.embed_tokens.weight.requires_grad_(False)
    return head.to(device=target.device, dtype=target.model.dtype).eval().requires_grad_(False)


def save_lumina_drafter(head: LuminaEagleHead, out, metrics: dict, target_variant: str = "upstream"):
    """``config.json`` (LANTERN's fields + ``target_variant``) and ``model.safetensors``: a folder
    ``load_lumina_eagle_head`` reads back."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**head.config.to_lantern_json(), "target_variant": target_variant},
                                                indent=1))
    (out / "train_metrics.json").write_text(json.dumps({**metrics, "target_variant": target_variant}, indent=1))
    return out


__all__ = ["LUMINA_DRAFTER_SOURCE", "LUMINA_MGPT_DRAFTER", "LuminaEagleConfig", "LuminaEagleDrafter", "LuminaEagleHead",
           "warn_variant_mismatch", "load_lumina_eagle_head", "save_lumina_drafter"]
