"""EAGLE-1 feature drafter for LlamaGen-style targets (LANTERN's ``cnets_llamagen.Model``).

``EagleHead`` is one Llama decoder layer over ``fc(concat(embed(x_{t+1}), f_t))``:

* ``embed_tokens`` is frozen and copied from the target's token embedding;
* ``fc``: Linear(2H -> H), bias from the config (LANTERN default: on);
* decoder layer 0 has NO input RMSNorm (EAGLE-1); it keeps ``post_attention_layernorm`` and a
  SwiGLU MLP (layers beyond the first, if configured, have ``input_layernorm`` as upstream);
* no final norm: the output is a predicted post-final-norm target feature, which the FROZEN
  target head (``lm_head``, LlamaGen's ``output``) turns into logits.

Positions are logical image-token indices with LlamaGen's 2D RoPE (``rope_2d``); a negative
position marks a text-condition slot, which gets the all-zero (cos, sin) of upstream's
``precompute_freqs_cis_2d`` (its query and key become zero vectors).

State-dict keys follow LANTERN's llamagen drafter, so its released checkpoints load with
``strict=True``: ``embed_tokens.weight``, ``fc.weight``, ``fc.bias``,
``layers.0.self_attn.{q,k,v,o}_proj.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight``,
``layers.0.post_attention_layernorm.weight``.

``EagleDrafter`` wraps a head as an ``ARModel`` for ``coolsd.engine.drafting.ModelDrafter``. With
features of layout (B, m, 2, H) = [cond, uncond] it runs both halves (batch doubling, token ids
shared) and returns CFG-combined logits, as LANTERN's drafter does.

Alignment (shared with ``coolsd.cli.train_drafter``): the drafter entry at logical position j is
(token x_j, feature at the sequence position of x_{j-1}); for j = 0 the feature is the target's
output at the last condition slot. The output at entry j predicts the feature at x_j, whose
logits predict x_{j+1}.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from coolsd.engine.compiled import compile_step
from coolsd.engine.decoding.sampling import cfg_combine
from coolsd.engine.model_protocol import StepOut
from coolsd.models.blocks import GatedMLP
from coolsd.models.kv_cache import KVCache
from coolsd.models.llamagen import LlamaGenConfig, RMSNorm, apply_rope, check_2d_rope, rope_table, rotation
from coolsd.util.loading import (
    BadInputFile,
    MissingInputFile,
    check_state_dict,
    read_json,
    read_torch_checkpoint,
    reading,
    require_file,
)

# spare slots of a static (compiled) drafter cache beyond the text prefix and the image: pending tree entries
STATIC_HEADROOM = 64

# LANTERN's ``input_type`` sets the RoPE grid of the drafter (``cnets_llamagen.Model.__init__``).
LANTERN_INPUT_TYPES = {"c2i": 576, "t2i": 256, "t2i2": 1024}


# ---------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    bias: bool = True  # fc bias
    num_hidden_layers: int = 1
    block_size: int = 256  # image tokens of the target's square grid (2D RoPE)
    rope_base: float = 10000.0

    def __post_init__(self):
        check_2d_rope(self.hidden_size, self.num_attention_heads, self.block_size)
        if self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers must be >= 1, got {self.num_hidden_layers}")

    # the attributes rope_2d reads
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def grid_size(self) -> int:
        return round(self.block_size**0.5)

    @classmethod
    def for_target(cls, target: LlamaGenConfig, **overrides) -> "EagleConfig":
        """A drafter matching a LlamaGen target: hidden size, heads, vocab, grid and RoPE base of
        the target; the intermediate size of the target's FFN (3584 for GPT-XL, LANTERN's value)."""
        base = dict(
            hidden_size=target.dim, num_attention_heads=target.n_head, intermediate_size=target.ffn_hidden,
            vocab_size=target.vocab_size, block_size=target.block_size, rope_base=target.rope_base,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def from_lantern(cls, config: Mapping[str, Any] | str) -> "EagleConfig":
        """From a LANTERN drafter ``config.json`` (a dict or a path). LANTERN sets the RoPE grid
        by ``input_type``; a ``block_size`` entry (written by ``to_lantern_json`` for drafters
        trained here on other grids) takes precedence."""
        if isinstance(config, str):
            config = read_json(config, "a LANTERN drafter config.json", DRAFTER_SOURCE)
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"only silu drafters are supported, got {config['hidden_act']!r}")
        kv = config.get("num_key_value_heads", config["num_attention_heads"])
        if kv != config["num_attention_heads"]:
            raise ValueError("grouped-query attention drafters are not supported")
        input_type = config.get("input_type", "t2i")
        if input_type not in LANTERN_INPUT_TYPES:
            raise ValueError(f"unknown input_type {input_type!r}; valid: {sorted(LANTERN_INPUT_TYPES)}")
        return cls(
            hidden_size=config["hidden_size"], num_attention_heads=config["num_attention_heads"],
            intermediate_size=config["intermediate_size"], vocab_size=config["vocab_size"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6), bias=config.get("bias", True),
            num_hidden_layers=config.get("num_hidden_layers", 1),
            block_size=config.get("block_size", LANTERN_INPUT_TYPES[input_type]),
            rope_base=config.get("rope_theta", 10000.0),
        )

    def to_lantern_json(self) -> dict:
        """A LANTERN-style ``config.json`` that ``from_lantern`` reads back to this config."""
        types = {v: k for k, v in LANTERN_INPUT_TYPES.items()}
        return {"architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_attention_heads, "num_hidden_layers": self.num_hidden_layers,
                "rms_norm_eps": self.rms_norm_eps, "vocab_size": self.vocab_size, "bias": self.bias,
                "rope_theta": self.rope_base, "input_type": types.get(self.block_size, "t2i"),
                "block_size": self.block_size}

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# LANTERN's llamagen_t2i_config.json (llamagen_t2i2 differs only in block_size 1024)
LLAMAGEN_T2I_DRAFTER = EagleConfig(hidden_size=1280, num_attention_heads=20, intermediate_size=3584, vocab_size=16384)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


# ---------------------------------------------------------------------------------------- modules
AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # q, k, v (B, H, m, D)


class EagleAttention(nn.Module):
    def __init__(self, cfg: EagleConfig):
        super().__init__()
        H = cfg.hidden_size
        self.n_head, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.q_proj = nn.Linear(H, H, bias=False)
        self.k_proj = nn.Linear(H, H, bias=False)
        self.v_proj = nn.Linear(H, H, bias=False)
        self.o_proj = nn.Linear(H, H, bias=False)

    def forward(self, x: torch.Tensor, rot, attn: AttnFn) -> torch.Tensor:
        B, m, H = x.shape
        shape = (B, m, self.n_head, self.head_dim)
        # q and k rotated together: one pass, the same per-pair product
        q, k = apply_rope(torch.cat([self.q_proj(x).view(shape), self.k_proj(x).view(shape)], 2), rot).chunk(2, 2)
        v = self.v_proj(x).view(shape)
        out = attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.o_proj(out.transpose(1, 2).reshape(B, m, H))


class EagleDecoderLayer(nn.Module):
    def __init__(self, cfg: EagleConfig, index: int):
        super().__init__()
        self.index = index
        self.self_attn = EagleAttention(cfg)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        if index != 0:  # EAGLE-1: the first layer takes fc's output un-normalized
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rot, attn: AttnFn) -> torch.Tensor:
        h = x if self.index == 0 else self.input_layernorm(x)
        x = x + self.self_attn(h, rot, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(nn.Module):
    """The trainable drafter network: (tokens, features, positions) -> predicted features."""

    def __init__(self, cfg: EagleConfig, embed_weight: Optional[torch.Tensor] = None):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if embed_weight is not None:
            if tuple(embed_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
                raise ValueError(
                    f"embedding must be {(cfg.vocab_size, cfg.hidden_size)}, got {tuple(embed_weight.shape)}"
                )
            with torch.no_grad():
                self.embed_tokens.weight.copy_(embed_weight)
        self.embed_tokens.weight.requires_grad_(False)  # frozen, as upstream
        self.layers = nn.ModuleList(EagleDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=cfg.bias)

    @classmethod
    def from_target(cls, model: nn.Module, seed: Optional[int] = None, **overrides) -> "EagleHead":
        """A fresh head for a ``LlamaGenGPT``: its config, its token embedding (copied), its
        dtype and device. ``seed`` fixes the initialisation (PyTorch's default Linear init)."""
        cfg = EagleConfig.for_target(model.config, **overrides)
        if seed is None:
            head = cls(cfg, model.tok_embeddings.weight.detach())
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                head = cls(cfg, model.tok_embeddings.weight.detach())
        return head.to(device=model.tok_embeddings.weight.device, dtype=model.tok_embeddings.weight.dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def rope_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``rope_table`` for this head's grid with a row of zeros first, the text slots' (made once;
        pass it to ``forward`` under torch.compile): row i + 1 holds position i."""
        cos, sin = rope_table(self.config, _compute_dtype(self.dtype), self.device, self.config.block_size + 64)
        return F.pad(cos, (0, 0, 1, 0)), F.pad(sin, (0, 0, 1, 0))

    def rope(self, positions: torch.Tensor, table=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) (B, m, head_dim/2) for logical positions; negative = text slot (zeros, the
        table's first row). From ``rope_table`` (positions past the cache's end, never verified,
        are clamped)."""
        cos, sin = table if table is not None else self.rope_table()
        at = (positions + 1).clamp_(0, cos.shape[0] - 1)
        return cos[at], sin[at]

    def forward(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        attend: Optional[torch.Tensor] = None,
        cache: Optional[KVCache] = None,
        rope_table=None,
    ) -> torch.Tensor:
        """tokens, positions (B, m); features (B, m, H) -> predicted features (B, m, H).

        Without ``cache``: self-attention over these m entries only, ``attend`` (m, m) or
        (B, m, m) bool (default causal). With ``cache``: the m entries become pending entries and
        ``attend`` is (m, P+m) or (B, m, P+m) over pending entries, as in ``KVCache.prepare``.
        """
        B, m = tokens.shape
        dev = self.device
        tokens, positions = tokens.to(dev), positions.to(dev)
        emb = self.embed_tokens(tokens).to(self.dtype)
        x = self.fc(torch.cat([emb, features.to(dev, self.dtype)], dim=-1))
        rot = rotation(*self.rope(positions, rope_table))
        if cache is None:
            if attend is None:
                attend = torch.ones(m, m, dtype=torch.bool, device=dev).tril()
            mask = attend.to(dev, torch.bool).expand(B, m, m).unsqueeze(1)

            def make_attn(i: int) -> AttnFn:
                return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            if attend is None:
                raise ValueError("a cached forward needs attend (m, P+m)")
            step = cache.prepare(attend, m)

            def make_attn(i: int) -> AttnFn:
                return lambda q, k, v: cache.attend(i, q, k, v, step)

        for i, layer in enumerate(self.layers):
            x = layer(x, rot, make_attn(i))
        if cache is not None:
            cache.advance(m)
        return x

    def new_cache(self, batch_size: int, max_len: Optional[int] = None, static: bool = False) -> KVCache:
        cfg = self.config
        max_len = max_len or -(-(cfg.block_size + 64) // 64) * 64
        return KVCache(cfg.num_hidden_layers, batch_size, cfg.num_attention_heads, cfg.head_dim, max_len,
                       self.dtype, self.device, static=static)

    def load_lantern(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Strictly load a LANTERN drafter state dict (``pytorch_model.bin`` of
        jadohu/llamagen_drafter or an ``accelerator.save_state`` model file). Non-persistent
        rotary buffers some transformers versions saved are dropped; a ``module.`` prefix is
        stripped."""
        self.load_state_dict(self.lantern_state(state_dict), strict=True)
        self.embed_tokens.weight.requires_grad_(False)

    @staticmethod
    def lantern_state(state_dict: Mapping[str, torch.Tensor]) -> dict:
        """A LANTERN drafter state dict in this module's key layout (``module.`` stripped, saved
        rotary buffers dropped), as ``load_lantern`` loads it."""
        return {k[len("module."):] if k.startswith("module.") else k: v for k, v in state_dict.items()
                if not k.endswith("rotary_emb.inv_freq")}


def head_logits(hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
    """The frozen target head on (predicted) features; at least fp32, like the target."""
    out = F.linear(hidden, lm_head_weight.to(hidden.device, hidden.dtype))
    return out.to(_compute_dtype(out.dtype))


# ---------------------------------------------------------------------------------------- drafter
class EagleDrafter:
    """``ARModel`` over an ``EagleHead`` for ``ModelDrafter`` (EAGLE-1 feature hand-over).

    ``features`` (B, m, H), or (B, m, 2, H) = [cond, uncond] halves from a guided target: then
    both halves run (batch [cond; uncond], shared token ids) and the logits are
    ``cfg_combine(cond, uncond, cfg_scale)``; returned hidden has the input's layout. The halves
    layout is fixed by the first forward after ``begin``.

    ``text_prefix``: if ``begin``'s context carries target features for T > 1 condition slots,
    prefill entries (token 0, feature at slot i) for slots 0..T-2 with zero rotation, as
    LANTERN's drafters see the text condition (``input_ids[:, 1:]`` with 119 zero ids); the
    first ``forward`` then supplies the entry (x_0, feature at slot T-1) at position 0.
    """

    def __init__(
        self,
        head: EagleHead,
        lm_head_weight: torch.Tensor | nn.Module,
        cfg_scale: float = 1.0,
        *,
        text_prefix: bool = False,
        cache_len: Optional[int] = None,
        compile: bool = False,
    ):
        if isinstance(lm_head_weight, nn.Module):
            lm_head_weight = lm_head_weight.weight
        V, H = head.config.vocab_size, head.config.hidden_size
        if tuple(lm_head_weight.shape) != (V, H):
            raise ValueError(f"lm_head weight must be {(V, H)}, got {tuple(lm_head_weight.shape)}")
        self.head = head.eval()
        self.lm_head_weight = lm_head_weight.detach()
        self.cfg_scale = float(cfg_scale)
        self.text_prefix = text_prefix
        self.cache_len = cache_len
        self.vocab_size = V
        self.cache: Optional[KVCache] = None
        self.halves: Optional[int] = None
        self.batch_size = 0
        # compile: the drafter step under torch.compile over a static cache (coolsd.engine.compiled)
        self.compiled = bool(compile)
        self._step_fn = compile_step(self._step, head.device) if compile else self._step
        self._rope = head.rope_table()  # made once (traced, it would be recomputed per call)

    @property
    def device(self) -> torch.device:
        return self.head.device

    @classmethod
    def for_target(cls, head: EagleHead, target: Any, **kw) -> "EagleDrafter":
        """Head weight and CFG scale taken from a ``LlamaGenTarget``."""
        return cls(head, target.model.output.weight, target.cfg_scale, **kw)

    # -------------------------------------------------------------- cache
    def _ensure_cache(self, halves: int, prefix: int = 0) -> None:
        """The cache for ``halves`` x batch rows, sized to the sequence's known maximum: a ``prefix``
        of text slots, every image token and ``STATIC_HEADROOM`` pending entries (rounded up to 8
        for a static, compiled cache, to 64 otherwise), or ``cache_len`` slots when given; an eager
        decode then never grows it. A reused cache keeps its buffers (``KVCache.reset``)."""
        if self.halves == halves:
            return
        if self.halves is not None:
            raise ValueError(
                f"feature layout changed within a sequence ({self.halves} -> {halves} halves)"
            )
        n = self.batch_size * halves
        cfg = self.head.config
        shape = (cfg.num_hidden_layers, n, cfg.num_attention_heads, cfg.head_dim, self.head.dtype, self.head.device)
        need = prefix + cfg.block_size + STATIC_HEADROOM
        if self.compiled:
            max_len = -(-need // 8) * 8
        else:
            max_len = self.cache_len or -(-need // 64) * 64
        if self.cache is not None and self.cache.matches(*shape) and self.cache.fits(max_len):
            self.cache.reset()
        else:
            self.cache = None  # the old cache's last reference: freed before the new one is allocated (peak: one cache)
            self.cache = self.head.new_cache(n, max_len, static=self.compiled)
        self.halves = halves

    @staticmethod
    def _halves_of(features: torch.Tensor) -> int:
        """1 for (B, m, H) features, 2 for guided (B, m, 2, H) = [cond, uncond]; else an error."""
        if features.dim() == 4 and features.shape[2] == 2:
            return 2
        if features.dim() == 3:
            return 1
        raise ValueError(f"features must be (B, m, H) or guided (B, m, 2, H), got {tuple(features.shape)}")

    def _split(self, features: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(B, m, H) -> itself, 1; (B, m, 2, H) -> (2B, m, H) = [cond; uncond], 2."""
        if self._halves_of(features) == 2:
            return torch.cat([features[:, :, 0], features[:, :, 1]]), 2
        return features, 1

    def _rep(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x] * self.halves) if self.halves > 1 else x

    # -------------------------------------------------------------- ARModel
    @torch.no_grad()
    def begin(self, cond: Any, batch_size: int, context: Optional[StepOut] = None) -> None:
        self.batch_size = int(batch_size)
        self.halves = None
        hidden = None if context is None else context.hidden
        if self.text_prefix and hidden is not None and hidden.shape[1] > 1:
            feats, halves = self._split(hidden[:, :-1])
            self._ensure_cache(halves, prefix=feats.shape[1])
            P, dev = feats.shape[1], feats.device
            tokens = torch.zeros(feats.shape[0], P, dtype=torch.long, device=dev)
            positions = torch.full((feats.shape[0], P), -1, dtype=torch.long, device=dev)
            causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
            self.head(tokens, feats, positions, causal, self.cache)
            n = feats.shape[0]
            self.cache.commit(None, torch.full((n,), P, dtype=torch.long, device=dev))
        elif hidden is not None:  # the cache is ready before the first forward (compiled forwards never build one)
            self._ensure_cache(self._halves_of(hidden))
        return None

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        attend: torch.Tensor,
        features: Optional[torch.Tensor] = None,
    ) -> StepOut:
        if features is None:
            raise ValueError("an EAGLE drafter needs the target's features")
        B, m = tokens.shape
        if B != self.batch_size:
            raise ValueError(f"begin() was called for batch {self.batch_size}, got {B}")
        self._ensure_cache(self._halves_of(features))
        if self.compiled:
            self.cache.check_headroom(m, STATIC_HEADROOM)
        dev = self.head.device
        logits, hidden = self._step_fn(tokens.to(dev), positions.to(dev), attend.to(dev), features, *self._rope)
        return StepOut(logits=logits, hidden=hidden)

    def _step(self, tokens, positions, attend, features, cos, sin):
        """One cached drafter forward (compiled when ``compile``): CFG-combined logits, hidden."""
        B = tokens.shape[0]
        feats, halves = self._split(features)
        hidden = self.head(self._rep(tokens), feats, self._rep(positions), attend, self.cache, (cos, sin))
        logits = head_logits(hidden, self.lm_head_weight)
        if halves == 2:
            logits = cfg_combine(logits[:B], logits[B:], self.cfg_scale)
            hidden = torch.stack([hidden[:B], hidden[B:]], dim=2)
        return logits, hidden

    @torch.no_grad()
    def commit(self, keep: torch.Tensor, n_keep: torch.Tensor) -> None:
        if self.cache is None or self.halves is None:
            if bool((n_keep > 0).any()):
                raise RuntimeError("commit before any forward")
            return
        self.cache.commit(None if keep is None else self._rep(keep), self._rep(n_keep))


# ---------------------------------------------------------------------------------------- loading
DRAFTER_SOURCE = ("https://huggingface.co/jadohu/llamagen_drafter (config.json + pytorch_model.bin; "
                  "jadohu/llamagen2_drafter for 512 px), or train one: python -m coolsd.cli.train_drafter")


def warn_variant_mismatch(meta: Mapping[str, Any], running: Optional[str], where) -> None:
    """Warn when a drafter folder records the target variant its training features came from
    (``target_variant``, written by ``python -m coolsd.cli.train_drafter``) and it differs from the
    running target's; a folder without the record (a released one) is not a warning."""
    recorded = meta.get("target_variant")
    if recorded is not None and running is not None and str(recorded) != str(running):
        warnings.warn(f"drafter {where} was trained on features of target variant {recorded!r}, the running target "
                      f"is variant {running!r}: its acceptance will differ from what it was trained for",
                      stacklevel=3)


def read_drafter_folder(folder, kind: str, what: str, source: str, parse):
    """(folder, weights file, raw config.json, ``parse(raw)``) of a LANTERN-layout drafter folder
    (``config.json`` + ``model.safetensors`` or ``pytorch_model.bin``); a missing folder or file, or
    a config ``parse`` refuses, is one ``coolsd.util.errors.InputFileError`` naming the file."""

    d = require_file(folder, kind, source, folder=True)
    weights = next((d / n for n in ("model.safetensors", "pytorch_model.bin") if (d / n).is_file()), None)
    if not (d / "config.json").is_file() or weights is None:
        raise MissingInputFile(f"drafter folder {d} needs config.json and pytorch_model.bin (or model.safetensors); "
                               f"get {source}")
    raw = read_json(d / "config.json", what, source)
    with reading(d / "config.json", what, source):
        return d, weights, raw, parse(raw)


def load_eagle_head(folder, target, variant: Optional[str] = None) -> EagleHead:
    """LANTERN's drafter folder (``config.json`` + ``pytorch_model.bin`` or ``model.safetensors``),
    strictly loaded, for the ``LlamaGenGPT`` ``target``; its embedding must equal the target's
    shape (a drafter of another target is an error). Every failure (no folder, an empty or
    invalid config.json, keys LANTERN's config lacks, weights of another model) is one
    ``coolsd.util.errors.InputFileError`` naming the file. ``variant`` (default: the target config's
    ``variant``, ``upstream`` | ``lantern``): a folder whose ``target_variant`` record differs is
    a warning naming both (``warn_variant_mismatch``); a released folder has no record."""

    what = "a LANTERN drafter config.json (hidden_size, num_attention_heads, intermediate_size, vocab_size, ...)"
    d, weights, raw, cfg = read_drafter_folder(folder, "EAGLE drafter folder", what, DRAFTER_SOURCE,
                                               EagleConfig.from_lantern)
    t = target.config
    if (cfg.hidden_size, cfg.vocab_size, cfg.block_size) != (t.dim, t.vocab_size, t.block_size):
        raise BadInputFile(f"drafter {d} is for hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, {cfg.block_size} "
                           f"tokens; the target has {t.dim}, {t.vocab_size}, {t.block_size} (a drafter of another "
                           f"target; download {DRAFTER_SOURCE})")
    warn_variant_mismatch(raw, variant if variant is not None else getattr(t, "variant", None), d)
    state = EagleHead.lantern_state(read_torch_checkpoint(weights, "EAGLE drafter weights", DRAFTER_SOURCE))
    head = EagleHead(cfg)
    check_state_dict(head, state, weights, DRAFTER_SOURCE)
    head.load_lantern(state)
    # LANTERN's drafters were trained with the text-slot prefix; ours (python -m coolsd.cli.train_drafter) without
    head.text_prefix = bool(raw.get("text_prefix", True))
    return head.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
