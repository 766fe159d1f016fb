"""LlamaGen text-to-image GPT (FoundationVision/LlamaGen, ``autoregressive/models/gpt.py``) as an
``ARModel`` target.

``LlamaGenGPT`` has the upstream parameter layout (state-dict keys load 1:1, ``strict=True``)
and the upstream numerics of the inference path:

* RMSNorm and RoPE run in at least fp32 (fp64 stays fp64), logits are at least fp32;
* 2D RoPE: head_dim splits into two halves of complex pairs; the first half rotates with the
  grid row of the image-token index, the second with the grid column (base ``rope_base``);
* the ``cls_token_num`` text-condition slots get an ALL-ZERO (cos, sin), so their queries and
  keys are zero vectors (upstream behaviour the checkpoints are trained with; not identity);
* text slot i attends valid text slots j <= i; a padded slot that has none (left padding: every
  padded slot) attends, by ``LlamaGenConfig.variant`` (``text_slot_mask``):
  ``upstream`` itself only (LlamaGen forces the diagonal on, ``generate.py``), ``lantern`` every
  slot j <= i (LANTERN's additive mask, see ``text_slot_mask``); image tokens attend every valid
  text slot and their image prefix; both CFG halves use the same text mask. Valid rows never see
  a padded key, so the variant changes only the padded slots' own hidden states (the features
  LANTERN's drafters prefill), never a logit; a real caption's padded slots are zeroed (zero
  features under either mask), so in practice only the uncond half's padded slots differ.

Sequence layout: text slots 0..T-1, then image token j at sequence index T + j; the output at
image token j predicts token j + 1, the output at text slot T-1 predicts image token 0.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from coolsd.engine.compiled import compile_step, compiling
from coolsd.engine.model_protocol import StepOut
from coolsd.models.blocks import RMSNorm, compute_dtype as _compute_dtype
from coolsd.models.guided import GuidedCacheModel
from coolsd.models.kv_cache import CacheStep, KVCache
from coolsd.util.loading import BadInputFile, MissingInputFile, check_state_dict, read_json, read_torch_checkpoint

# ---------------------------------------------------------------------------------------- config
VARIANTS = ("upstream", "lantern")  # LlamaGenConfig.variant / target.variant


def check_2d_rope(width: int, n_heads: int, block_size: int) -> None:
    """Shapes 2D RoPE needs: whole heads, head_dim divisible by 4, a square token grid."""
    if width % n_heads:
        raise ValueError(f"width {width} is not a multiple of the {n_heads} heads")
    if (width // n_heads) % 4:
        raise ValueError(f"2D RoPE needs head_dim divisible by 4, got {width // n_heads}")
    if round(block_size**0.5) ** 2 != block_size:
        raise ValueError(f"block_size {block_size} is not a square grid")


@dataclass(frozen=True)
class LlamaGenConfig:
    dim: int
    n_layer: int
    n_head: int
    vocab_size: int = 16384
    cls_token_num: int = 120
    caption_dim: int = 2048
    block_size: int = 256  # image tokens; a square grid (256 at 256 px, 1024 at 512 px)
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    variant: str = "upstream"  # padded-text-slot attention: "upstream" (LlamaGen) or "lantern" (LANTERN)

    def __post_init__(self):
        check_2d_rope(self.dim, self.n_head, self.block_size)
        if self.variant not in VARIANTS:
            raise ValueError(f"LlamaGen variant must be one of {', '.join(map(repr, VARIANTS))}, got {self.variant!r} "
                             f"(target.variant: upstream = LlamaGen's own mask, lantern = LANTERN's)")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def grid_size(self) -> int:
        return round(self.block_size**0.5)

    @property
    def ffn_hidden(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return -(-hidden // self.multiple_of) * self.multiple_of


# LlamaGen-XL t2i (775M). Stage-1 checkpoint: 256 px, 16x16 grid; stage 2: 512 px, 32x32 grid.
GPT_XL = LlamaGenConfig(dim=1280, n_layer=36, n_head=20)
GPT_XL_512 = replace(GPT_XL, block_size=1024)


def tiny(**overrides) -> LlamaGenConfig:
    """A small config for CPU tests."""
    base = dict(
        dim=64, n_layer=2, n_head=4, vocab_size=64, cls_token_num=8, caption_dim=16,
        block_size=16, multiple_of=16,
    )
    base.update(overrides)
    return LlamaGenConfig(**base)


# ---------------------------------------------------------------------------------------- mask
def text_slot_mask(key_ok: torch.Tensor, variant: str) -> torch.Tensor:
    """(B, L, L) bool attention mask of a sequence that starts with the text slots: query i sees
    key j iff j <= i and key j is valid (``key_ok`` (B, L): the text slots' ``emb_mask``, True for
    image tokens). Padded rows differ by ``variant``:

    * ``upstream``: every row also sees itself -- LlamaGen's ``generate.py`` forces the diagonal on
      (``causal_mask * (1 - eye) + eye``); it changes only padded rows, and with left padding a
      padded slot then sees itself only.
    * ``lantern``: a row left with no key (a padded slot with no valid slot before it: with left
      padding, every padded slot) sees every key j <= i, itself included. LANTERN's
      ``modeling_llamagen_kv.py`` adds ``_expand_mask`` (finfo(bf16).min on padded keys) to
      ``_make_causal_mask`` (finfo(fp32).min on future keys), ~lines 257-268 and
      ``_prepare_decoder_attention_mask``; on such a row the
      past padded keys (-3.39e38) dominate the future ones (-3.40e38, or -inf where both add up),
      every score is lost against those magnitudes, so the softmax is uniform over j <= i. Our
      boolean mask gives the same uniform average because text-slot queries and keys are zero
      vectors (zero RoPE). The first slot sees itself only in both variants.

    LANTERN ran (``--precision bf16``, the default of ``generate_images.py`` and of
    ``generate_train_data.py``, which made the released drafters' training features) in bf16;
    fp16 behaves the same. In fp32 its two minima coincide and a padded row would also average
    every valid key of the sequence, future ones included (image tokens in a full-sequence
    forward): a non-causal artefact this option does not reproduce.
    """
    B, L = key_ok.shape
    causal = torch.ones(L, L, dtype=torch.bool, device=key_ok.device).tril()
    allowed = causal & key_ok.bool().unsqueeze(1)  # (B, L, L)
    if variant == "upstream":
        return allowed | torch.eye(L, dtype=torch.bool, device=key_ok.device)
    if variant == "lantern":
        empty = ~allowed.any(-1, keepdim=True)  # rows with no valid key j <= i
        return allowed | (empty & causal)
    raise ValueError(f"LlamaGen variant must be one of {', '.join(map(repr, VARIANTS))}, got {variant!r}")


# ---------------------------------------------------------------------------------------- RoPE
@functools.lru_cache(maxsize=32)
def _rope_freqs(half: int, base: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    exponents = torch.arange(0, half, 2, device=device)[: half // 2].to(dtype) / half
    return 1.0 / (base**exponents)


def rope_2d(
    positions: torch.Tensor, cfg: LlamaGenConfig, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (B, m, head_dim // 2), for image-token indices ``positions`` (B, m).

    Equal to upstream's ``precompute_freqs_cis_2d`` row T + j for index j < block_size (the same
    fp32 operations); indices past the grid continue the row-major formula.
    """
    return _rope_angles(positions, cfg, dtype)


@functools.lru_cache(maxsize=16)
def rope_table(cfg, dtype: torch.dtype, device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_2d`` of indices 0..n-1, computed once: (cos, sin), each (n, head_dim // 2). Decoding
    indexes it instead of recomputing the angles every forward (positions past n are clamped,
    which only ever affects tree nodes past the image's end, never verified)."""
    return _rope_angles(torch.arange(n, device=device), cfg, dtype)


def _rope_angles(positions: torch.Tensor, cfg, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = _rope_freqs(cfg.head_dim // 2, cfg.rope_base, dtype, positions.device)
    g = cfg.grid_size
    row = (positions // g).to(dtype).unsqueeze(-1) * freqs
    col = (positions % g).to(dtype).unsqueeze(-1) * freqs
    angles = torch.cat([row, col], dim=-1)
    return torch.cos(angles), torch.sin(angles)


def rotation(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(cos, sin) (B, m, D/2) -> the complex rotation (B, m, 1, D/2) that ``apply_rope`` takes;
    built once per forward and shared by every layer. Under ``torch.compile``: the pair
    (cos, sin), each (B, m, 1, D/2), for ``apply_rope``'s real arithmetic."""
    if compiling():
        return cos.unsqueeze(2), sin.unsqueeze(2)
    return torch.complex(cos, sin).unsqueeze(2)


def apply_rope(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """x (B, m, H, D) rotated pairwise (x[2i], x[2i+1]) by ``rot`` = cos + i sin (B, m, 1, D/2):
    one complex product per pair, upstream's rotation, in the compute dtype of ``rot``. Under
    ``torch.compile`` the same product in real arithmetic (inductor generates no complex code)."""
    if isinstance(rot, tuple):  # compiled: (a + ib)(c + id) = (ac - bd) + i(ad + bc)
        c, d = rot
        pairs = x.to(c.dtype).reshape(*x.shape[:-1], -1, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        return torch.stack([a * c - b * d, a * d + b * c], dim=-1).flatten(3).to(x.dtype)
    real = torch.float64 if rot.dtype == torch.complex128 else torch.float32
    xs = torch.view_as_complex(x.to(real).reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(xs * rot).flatten(3).to(x.dtype)


# ---------------------------------------------------------------------------------------- modules
class CaptionMLP(nn.Module):
    def __init__(self, in_features: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden, bias=False)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CaptionEmbedder(nn.Module):
    """Projects T5 caption features; ``uncond_embedding`` is the learned null caption (a
    persistent buffer, so it is in the state dict)."""

    def __init__(self, cfg: LlamaGenConfig):
        super().__init__()
        self.cap_proj = CaptionMLP(cfg.caption_dim, cfg.dim)
        null = torch.randn(cfg.cls_token_num, cfg.caption_dim) / cfg.caption_dim**0.5
        self.register_buffer("uncond_embedding", null)

    def forward(self, caption: torch.Tensor) -> torch.Tensor:
        return self.cap_proj(caption)


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaGenConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Attention(nn.Module):
    def __init__(self, cfg: LlamaGenConfig):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)  # fused [q; k; v], plain MHA
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x, rot, cache: KVCache, layer: int, step: CacheStep) -> torch.Tensor:
        B, m, dim = x.shape
        H = self.n_head
        qkv = self.wqkv(x).view(B, m, 3 * H, self.head_dim)  # [q heads; k heads; v heads]
        qk = apply_rope(qkv[:, :, : 2 * H], rot)  # q and k rotated together: one pass, the same per-pair product
        q, k, v = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2), qkv[:, :, 2 * H :].transpose(1, 2)
        if cache is None:  # training: full sequence, ``step`` is the (B, 1, m, m) bool mask
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=step)
        else:
            out = cache.attend(layer, q, k, v, step)
        return self.wo(out.transpose(1, 2).reshape(B, m, dim))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaGenConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, rot, cache: KVCache, layer: int, step: CacheStep) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rot, cache, layer, step)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaGenGPT(nn.Module):
    """The t2i ``Transformer`` of upstream LlamaGen, inference only (no dropout modules; they
    hold no parameters). The RoPE table is computed on the fly and is not in the state dict."""

    def __init__(self, cfg: LlamaGenConfig, init_std: float = 0.02):
        super().__init__()
        self.config = cfg
        self.cls_embedding = CaptionEmbedder(cfg)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        for mod in self.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, std=init_std)

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    def run(self, h, cos, sin, cache: KVCache, attend: torch.Tensor,
            positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Input embeddings h (B, m, dim) -> hidden after the final norm; the m entries become
        pending in ``cache``, each attending committed entries and the pending ones ``attend``
        allows ((m, P+m) or (B, m, P+m)); with ``positions`` (B, m), only the committed entries at
        earlier positions (``KVCache``: visibility by position)."""
        step = cache.prepare(attend, h.shape[1], positions=positions)
        rot = rotation(cos, sin)
        for i, layer in enumerate(self.layers):
            h = layer(h, rot, cache, i, step)
        cache.advance(h.shape[1])
        return self.norm(h)

    def forward(self, caption: torch.Tensor, emb_mask: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced training forward without a cache: hidden (B, T + N - 1, dim) after the
        final norm for the sequence [text slots, x_0 .. x_{N-2}]; hidden[:, T-1+j] predicts x_j.
        ``caption`` is the condition exactly as the model sees it, as upstream's and LANTERN's
        forwards take it: a real caption with its padded slots zeroed (``LlamaGenTarget.begin``
        zeroes them, as upstream's ``generate.py`` and LANTERN's training data do), or the null
        ``uncond_embedding`` whole (``begin``'s uncond half; CFG dropout). With the same mask as
        ``begin`` (``text_slot_mask``), every slot's features equal the prefill's, padded ones
        included. (Padded slots never reach a valid slot or an image token: logits do not depend
        on what they hold.)"""
        cfg = self.config
        B, T = emb_mask.shape
        N1 = tokens.shape[1] - 1
        x = caption.to(self.device, self.dtype)
        h = torch.cat([self.cls_embedding(x), self.tok_embeddings(tokens[:, :N1])], dim=1)
        cdt = _compute_dtype(self.dtype)
        pos = torch.arange(N1, device=self.device).expand(B, N1)
        cos_i, sin_i = rope_2d(pos, cfg, cdt)
        zeros = torch.zeros(B, T, cfg.head_dim // 2, dtype=cdt, device=self.device)
        rot = rotation(torch.cat([zeros, cos_i], 1), torch.cat([zeros, sin_i], 1))
        image_ok = torch.ones(B, N1, dtype=torch.bool, device=self.device)
        key_ok = torch.cat([emb_mask.bool().to(self.device), image_ok], 1)
        mask = text_slot_mask(key_ok, cfg.variant).unsqueeze(1)  # the prefill's mask (begin), for both variants
        for i, layer in enumerate(self.layers):
            h = layer(h, rot, None, i, mask)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.output(hidden)
        return out.to(_compute_dtype(out.dtype))

    def load_upstream(self, checkpoint: Mapping[str, Any]) -> None:
        """Strictly load an upstream checkpoint (``{"model"|"module"|"state_dict": sd}`` or a bare
        state dict); upstream's own loader uses strict=False, which hides key mismatches."""
        for key in ("model", "module", "state_dict"):
            if key in checkpoint and isinstance(checkpoint[key], Mapping):
                checkpoint = checkpoint[key]
                break
        self.load_state_dict(checkpoint, strict=True)


# ---------------------------------------------------------------------------------------- target
class LlamaGenTarget(GuidedCacheModel):
    """``ImageTarget`` over a ``LlamaGenGPT``, with classifier-free guidance by batch doubling.

    Internally the batch is [cond half; uncond half] (upstream order) when ``cfg_scale > 1``;
    both halves always hold the same tokens, positions and committed lengths. Returned logits
    are CFG-combined; returned hidden states (after the final norm) are (B, m, H), or
    (B, m, 2, H) = [cond, uncond] halves when guided.
    ``cond`` for ``begin``: ``{"caption_embs": (B, T, caption_dim), "emb_mask": (B, T) bool}``,
    left padded (valid slots at the end), T = ``cls_token_num``.
    """

    row_parallel = True  # forward(..., by_position=True): row-parallel decoders run on it (coolsd.engine.rows)

    def __init__(
        self,
        model: LlamaGenGPT,
        cfg_scale: float = 7.5,
        decoder: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        cache_headroom: int = 64,
        prefill_features: str = "last",
        compile: bool = False,
    ):
        self.model = model.eval()
        self.cfg_scale = float(cfg_scale)
        self.decoder = decoder
        self.cache_headroom = cache_headroom  # pending slots preallocated past the full sequence
        if prefill_features not in ("last", "all"):
            raise ValueError(f"prefill_features must be 'last' or 'all', got {prefill_features!r}")
        # "all": begin() returns the features of every condition slot (logits of the last only),
        # which LANTERN's drafters prefill (EagleDrafter(text_prefix=True))
        self.prefill_features = prefill_features
        cfg = model.config
        self.vocab_size = cfg.vocab_size
        self.n_image_tokens = cfg.block_size
        # compile: the decode / tree forwards under torch.compile over a static cache (coolsd.engine.compiled)
        self.compiled = bool(compile)
        self._step_fn = compile_step(self._step, model.device) if compile else self._step
        # RoPE rows for every position the cache can hold, made once (traced, they would be recomputed per call)
        self._rope = rope_table(cfg, _compute_dtype(model.dtype), model.device, cfg.block_size + cache_headroom)

    @property
    def guided(self) -> bool:
        """Guidance runs only for ``cfg_scale > 1``, as upstream's ``generate.py`` (``if cfg_scale >
        1.0``): a scale <= 1 gives the cond-only logits, unguided."""
        return self.cfg_scale > 1.0

    def _new_cache(self, n: int) -> KVCache:
        cfg, m = self.model.config, self.model
        committed = cfg.cls_token_num + cfg.block_size  # the condition and every image token
        return self._cache_for((cfg.n_layer, n, cfg.n_head, cfg.head_dim, m.dtype, m.device),
                               committed + self.cache_headroom, 8, committed)

    def _out(self, hidden: torch.Tensor) -> StepOut:
        return self._guided_out(self.model.logits(hidden), hidden)

    @torch.no_grad()
    def begin(self, cond: Any, batch_size: int, context: Optional[StepOut] = None) -> StepOut:
        cfg, model = self.model.config, self.model
        caption, mask = cond["caption_embs"], cond["emb_mask"]
        T = cfg.cls_token_num
        if caption.shape != (batch_size, T, cfg.caption_dim) or mask.shape != (batch_size, T):
            raise ValueError(
                f"expected caption_embs {(batch_size, T, cfg.caption_dim)} and emb_mask {(batch_size, T)}, "
                f"got {tuple(caption.shape)} and {tuple(mask.shape)}"
            )
        self.batch_size = batch_size
        mask = mask.to(model.device, torch.bool)
        x = caption.to(model.device, model.dtype) * mask.unsqueeze(-1)  # padded slots zeroed, as upstream
        if self.guided:
            x = torch.cat([x, model.cls_embedding.uncond_embedding.to(x.dtype).expand(batch_size, -1, -1)])
        mask = self._double(mask)
        n = mask.shape[0]
        self.cache = self._new_cache(n)
        attend = text_slot_mask(mask, cfg.variant)  # (n, T, T): valid earlier slots; padded ones by the variant
        zeros = torch.zeros(n, T, cfg.head_dim // 2, dtype=_compute_dtype(model.dtype), device=model.device)
        hidden = model.run(model.cls_embedding(x), zeros, zeros, self.cache, attend)
        keep = torch.arange(T, device=model.device).expand(n, T)
        self.cache.commit(keep, torch.full((n,), T, device=model.device), hide=~mask)
        out = self._out(hidden[:, -1:])
        if self.prefill_features == "all":
            out.hidden = self._halves(hidden)
        return out

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        attend: torch.Tensor,
        features: Optional[torch.Tensor] = None,
        by_position: bool = False,
    ) -> StepOut:
        """tokens, positions: (B, m); positions are image-token indices (token j predicts j+1).
        ``by_position``: each new token sees only the committed entries at earlier positions (row-
        parallel decoding, ``coolsd.engine.rows``; eager only)."""
        if self.cache is None:
            raise RuntimeError("call begin() first")
        dev = self.model.device
        if by_position:  # eager: the compiled step has no such cache
            logits, hidden = self._step(tokens.to(dev), positions.to(dev).expand(tokens.shape), attend.to(dev),
                                        *self._rope, by_position=True)
            return StepOut(logits=logits, hidden=hidden)
        if self.compiled:  # the static cache holds the condition, every image token and cache_headroom pending
            self.cache.check_headroom(tokens.shape[1], self.cache_headroom)
        logits, hidden = self._step_fn(tokens.to(dev), positions.to(dev), attend.to(dev), *self._rope)
        return StepOut(logits=logits, hidden=hidden)

    def _step(self, tokens, positions, attend, cos, sin, by_position: bool = False):
        """One cached forward (compiled when ``compile``): (logits, hidden) as ``_out`` gives
        them; ``cos``, ``sin``: ``rope_table`` rows, indexed by position (clamped to the table);
        ``by_position``: the cache's visibility by position (``forward``)."""
        model = self.model
        tokens, positions = self._double(tokens), self._double(positions)
        attend = self._double(attend) if attend.dim() == 3 else attend  # per-sample masks: both CFG halves
        at = positions.clamp(0, cos.shape[0] - 1)
        hidden = model.run(model.tok_embeddings(tokens), cos[at], sin[at], self.cache, attend,
                           positions if by_position else None)
        out = self._out(hidden)
        return out.logits, out.hidden

    @torch.no_grad()
    def commit(self, keep: torch.Tensor, n_keep: torch.Tensor) -> None:
        self.cache.commit(None if keep is None else self._double(keep), self._double(n_keep))

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.decoder is None:
            raise RuntimeError("LlamaGenTarget was built without a VQ decoder")
        return self.decoder(tokens)


# ---------------------------------------------------------------------------------------- loading
GPT_SOURCE = "https://huggingface.co/peizesun/llamagen_t2i (t2i_XL_stage1_256.pt; t2i_XL_stage2_512.pt for 512 px)"
HF_SOURCE = ("https://huggingface.co/jadohu/LlamaGen-T2I (LANTERN's HF conversion of t2i_XL_stage1_256.pt; "
             "jadohu/LlamaGen-T2I-2 for 512 px)")
GPT_CONFIGS = {"GPT_XL": GPT_XL, "GPT_XL_512": GPT_XL_512}


def gpt_config(spec, variant: Optional[str] = None) -> LlamaGenConfig:
    """A named config (``GPT_XL``, ``GPT_XL_512``) or a mapping of ``LlamaGenConfig`` fields;
    ``variant`` (``target.variant``) sets its padded-slot attention (a mapping that names another
    variant is an error)."""
    if isinstance(spec, str):
        if spec not in GPT_CONFIGS:
            raise ValueError(f"unknown gpt_config {spec!r}; valid: {sorted(GPT_CONFIGS)} or a mapping of fields")
        cfg = GPT_CONFIGS[spec]
    else:
        fields = dict(spec)
        if variant is not None and fields.get("variant", variant) != variant:
            raise ValueError(f"target.gpt_config.variant={fields['variant']!r} contradicts target.variant={variant!r}; "
                             f"set the variant once, with target.variant")
        cfg = LlamaGenConfig(**fields)
    return cfg if variant is None else replace(cfg, variant=variant)


# LANTERN's HF conversion (jadohu/LlamaGen-T2I): the names of its ``models/kv_variants/
# modeling_llamagen_kv.py`` (``LlamaForCausalLM`` > ``LlamaModel``: ``embed_tokens``,
# ``cls_embedding.cap_proj.fc1/fc2`` and the ``uncond_embedding`` buffer, ``layers.N.self_attn.
# q/k/v/o_proj``, ``mlp.gate/up/down_proj``, ``input_layernorm``, ``post_attention_layernorm``,
# ``norm``; ``lm_head``), the names its ``ea_model_llamagen.py`` also reads. Its T5 embedder is not
# a module and RoPE is a plain tensor attribute: neither is in the weights.
_HF_TOP = {
    "cls_embedding.uncond_embedding": "model.cls_embedding.uncond_embedding",
    "cls_embedding.cap_proj.fc1.weight": "model.cls_embedding.cap_proj.fc1.weight",
    "cls_embedding.cap_proj.fc2.weight": "model.cls_embedding.cap_proj.fc2.weight",
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_HF_LAYER = {  # ours -> theirs under layers.N; wqkv is their q, k, v stacked (rows), plain MHA
    "attention.wqkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attention.wo.weight": ("self_attn.o_proj.weight",),
    "feed_forward.w1.weight": ("mlp.gate_proj.weight",),
    "feed_forward.w3.weight": ("mlp.up_proj.weight",),
    "feed_forward.w2.weight": ("mlp.down_proj.weight",),
    "attention_norm.weight": ("input_layernorm.weight",),
    "ffn_norm.weight": ("post_attention_layernorm.weight",),
}
# config.json key -> our value; LANTERN's LlamaModel reads every one of them (so a converted
# folder has them all); intermediate_size is the FFN width our multiple_of rounding gives
_HF_CONFIG = {
    "hidden_size": lambda c: c.dim, "num_hidden_layers": lambda c: c.n_layer,
    "num_attention_heads": lambda c: c.n_head, "vocab_size": lambda c: c.vocab_size,
    "intermediate_size": lambda c: c.ffn_hidden, "cls_token_num": lambda c: c.cls_token_num,
    "caption_dim": lambda c: c.caption_dim, "block_size": lambda c: c.block_size,
    "rms_norm_eps": lambda c: c.norm_eps, "rope_base": lambda c: c.rope_base,
}
HF_WEIGHTS = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json", "pytorch_model.bin")


def hf_key_map(n_layer: int) -> dict[str, tuple[str, ...]]:
    """Our state-dict key -> the HF key(s) it is made of (several: stacked along dim 0)."""
    out = {k: (v,) for k, v in _HF_TOP.items()}
    for i in range(n_layer):
        out.update({f"layers.{i}.{k}": tuple(f"model.layers.{i}.{n}" for n in v) for k, v in _HF_LAYER.items()})
    return out


def check_hf_config(folder, cfg: LlamaGenConfig) -> None:
    """``folder/config.json`` against ``cfg`` (``target.gpt_config``): every size must agree, the
    model must be the t2i GPT with plain multi-head attention, untied output and no biases."""
    import math
    import os


    path = os.path.join(os.fspath(folder), "config.json")
    conf = read_json(path, "LlamaGen HF config (config.json)", HF_SOURCE)
    absent = [k for k in _HF_CONFIG if k not in conf]
    if absent:
        raise BadInputFile(f"{path} lacks {', '.join(absent)}: not a LlamaGen t2i config; expected the folder from "
                           f"{HF_SOURCE}")
    differ = [f"{k}={conf[k]!r} (target.gpt_config has {want(cfg)!r})" for k, want in _HF_CONFIG.items()
              if not (isinstance(conf[k], (int, float)) and math.isclose(conf[k], want(cfg), rel_tol=1e-9))]
    kv = conf.get("num_key_value_heads")
    if kv is not None and kv != conf["num_attention_heads"]:
        differ.append(f"num_key_value_heads={kv!r} (LlamaGen is plain multi-head: {conf['num_attention_heads']})")
    for key, want in (("input_type", "t2i"), ("tie_word_embeddings", False), ("attention_bias", False)):
        if key in conf and conf[key] != want:
            differ.append(f"{key}={conf[key]!r} (expected {want!r})")
    if differ:
        raise BadInputFile(f"{path} does not fit target.gpt_config ({'; '.join(differ)}); set target.gpt_config to "
                           f"the checkpoint's sizes or point target.files.gpt at the matching checkpoint from "
                           f"{HF_SOURCE}")


def read_hf_weights(folder) -> tuple[dict, str]:
    """The tensors of a HF model folder (``HF_WEIGHTS``, the first present: a sharded index or one
    file; safetensors or ``torch.load(weights_only=True)``) and the name the errors give them."""
    from pathlib import Path


    folder = Path(folder)
    what = "LlamaGen HF weights"
    name = next((n for n in HF_WEIGHTS if (folder / n).is_file()), None)
    if name is None:
        raise MissingInputFile(f"LlamaGen HF folder {folder} holds none of {', '.join(HF_WEIGHTS)}; get the folder "
                               f"from {HF_SOURCE}")
    if not name.endswith(".index.json"):
        return read_torch_checkpoint(folder / name, what, HF_SOURCE), str(folder / name)
    index = read_json(folder / name, f"{what} index", HF_SOURCE)
    shards = sorted(set((index.get("weight_map") or {}).values()))
    if not shards:
        raise BadInputFile(f"{folder / name} lists no shard files (its weight_map is empty); get the folder "
                               f"from {HF_SOURCE}")
    state: dict = {}
    for shard in shards:
        part = read_torch_checkpoint(folder / shard, what, HF_SOURCE)
        if twice := state.keys() & part.keys():
            raise BadInputFile(f"{folder / shard} repeats keys of another shard ({', '.join(sorted(twice)[:4])}); "
                                   f"get the folder from {HF_SOURCE}")
        state.update(part)
    return state, f"{folder / name} ({len(shards)} shards)" if len(shards) > 1 else str(folder / shards[0])


def _few(keys, limit: int = 6) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:limit]) + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def state_from_hf(hf: dict, cfg: LlamaGenConfig, where: str) -> dict:
    """LANTERN's HF tensors -> our state dict, strictly: every HF key used exactly once, none
    missing, every shape ours (else one ``BadInputFile`` naming ``where`` and the keys)."""

    with torch.device("meta"):
        own = LlamaGenGPT(cfg).state_dict()
    keys = hf_key_map(cfg.n_layer)
    wanted = {n for names in keys.values() for n in names}
    missing, unexpected = wanted - hf.keys(), hf.keys() - wanted
    shapes = []
    for ours, names in keys.items():
        rows = own[ours].shape[0] // len(names)
        for n in names:
            if n in hf and tuple(hf[n].shape) != (rows, *own[ours].shape[1:]):
                shapes.append(f"{n} {tuple(hf[n].shape)} (expected {(rows, *own[ours].shape[1:])})")
    if missing or unexpected or shapes:
        parts = ([f"missing keys: {_few(missing)}"] if missing else []) + \
                ([f"unexpected keys: {_few(unexpected)}"] if unexpected else []) + \
                ([f"wrong shapes: {', '.join(sorted(shapes)[:6])}"] if shapes else [])
        raise BadInputFile(f"{where} does not fit LANTERN's LlamaGen HF layout for target.gpt_config "
                           f"({'; '.join(parts)}); expected the folder from {HF_SOURCE}")
    return {ours: torch.cat([hf[n] for n in names]) if len(names) > 1 else hf[names[0]]
            for ours, names in keys.items()}


def load_gpt(path, cfg: LlamaGenConfig, dtype=torch.bfloat16, device="cpu") -> LlamaGenGPT:
    """Strictly load a t2i GPT: an official checkpoint file (``{"model": sd}``, ``GPT_SOURCE``) or
    a folder in LANTERN's HF layout (config.json + weights, ``HF_SOURCE``; its config checked
    against ``cfg``). A checkpoint of another size or grid is an error naming the keys/shapes
    that differ. ``cfg.variant`` is not a property of the weights: either file runs either variant."""
    import os
    from pathlib import Path


    if Path(os.fspath(path)).is_dir():
        check_hf_config(path, cfg)
        hf, where = read_hf_weights(path)
        state, source = state_from_hf(hf, cfg, where), HF_SOURCE
    else:
        state = read_torch_checkpoint(path, "LlamaGen t2i GPT checkpoint", GPT_SOURCE)
        where, source = os.fspath(path), GPT_SOURCE
    with torch.device("meta"):
        model = LlamaGenGPT(cfg)
    check_state_dict(model, state, where, source)
    model = model.to_empty(device="cpu")
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
