"""LlamaGen text-to-image GPT (FoundationVision/LlamaGen, ``autoregressive/models/gpt.py``) as an
``ARModel`` target.

``LlamaGenGPT`` has the upstream parameter layout (state-dict keys load 1:1, ``strict=True``)
and the upstream numerics of the inference path:

* RMSNorm and RoPE run in at least fp32 (fp64 stays fp64), logits are at least fp32;
* 2D RoPE: head_dim splits into two halves of complex pairs; the first half rotates with the
  grid row of the image-token index, the second with the grid column (base ``rope_base``);
* the ``cls_token_num`` text-condition slots get an ALL-ZERO (cos, sin), so their queries and
  keys are zero vectors (upstream behaviour the checkpoints are trained with; not identity);
* text slot i attends valid text slots j <= i plus itself (the diagonal is forced on so padded
  rows are never empty); image tokens attend every valid text slot and their image prefix;
  both CFG halves use the same text mask.

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

from coolsd.compiled import compile_step, compiling
from coolsd.decoding.sampling import cfg_combine
from coolsd.models.blocks import RMSNorm, compute_dtype as _compute_dtype
from coolsd.models.kv_cache import CacheStep, KVCache
from coolsd.protocols import StepOut


# ---------------------------------------------------------------------------------------- config
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

    def __post_init__(self):
        check_2d_rope(self.dim, self.n_head, self.block_size)

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
        q, k, v = (t.view(B, m, self.n_head, self.head_dim) for t in self.wqkv(x).split(dim, dim=-1))
        q, k = apply_rope(q, rot), apply_rope(k, rot)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
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

    def run(self, h, cos, sin, cache: KVCache, attend: torch.Tensor) -> torch.Tensor:
        """Input embeddings h (B, m, dim) -> hidden after the final norm; the m entries become
        pending in ``cache``, each attending committed entries and the pending ones ``attend``
        allows ((m, P+m) or (B, m, P+m))."""
        step = cache.prepare(attend, h.shape[1])
        rot = rotation(cos, sin)
        for i, layer in enumerate(self.layers):
            h = layer(h, rot, cache, i, step)
        cache.advance(h.shape[1])
        return self.norm(h)

    def forward(self, caption: torch.Tensor, emb_mask: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced training forward without a cache: hidden (B, T + N - 1, dim) after the
        final norm for the sequence [text slots, x_0 .. x_{N-2}]; hidden[:, T-1+j] predicts x_j.
        ``caption`` is the (already dropped-out, if training CFG) caption feature sequence."""
        cfg = self.config
        B, T = emb_mask.shape
        N1 = tokens.shape[1] - 1
        x = caption.to(self.dtype) * emb_mask.unsqueeze(-1).to(self.dtype)
        h = torch.cat([self.cls_embedding(x), self.tok_embeddings(tokens[:, :N1])], dim=1)
        cdt = _compute_dtype(self.dtype)
        pos = torch.arange(N1, device=self.device).expand(B, N1)
        cos_i, sin_i = rope_2d(pos, cfg, cdt)
        zeros = torch.zeros(B, T, cfg.head_dim // 2, dtype=cdt, device=self.device)
        rot = rotation(torch.cat([zeros, cos_i], 1), torch.cat([zeros, sin_i], 1))
        L = T + N1
        key_ok = torch.cat([emb_mask.bool(), torch.ones(B, N1, dtype=torch.bool, device=self.device)], 1)
        causal = torch.ones(L, L, dtype=torch.bool, device=self.device).tril()
        mask = (causal & key_ok.unsqueeze(1)) | torch.eye(L, dtype=torch.bool, device=self.device)
        mask = mask.unsqueeze(1)
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
class LlamaGenTarget:
    """``ImageTarget`` over a ``LlamaGenGPT``, with classifier-free guidance by batch doubling.

    Internally the batch is [cond half; uncond half] (upstream order) when ``cfg_scale != 1``;
    both halves always hold the same tokens, positions and committed lengths. Returned logits
    are CFG-combined; returned hidden states (after the final norm) are (B, m, H), or
    (B, m, 2, H) = [cond, uncond] halves when guided.
    ``cond`` for ``begin``: ``{"caption_embs": (B, T, caption_dim), "emb_mask": (B, T) bool}``,
    left padded (valid slots at the end), T = ``cls_token_num``.
    """

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
        self.cache: Optional[KVCache] = None
        self.batch_size = 0
        # compile: the decode / tree forwards under torch.compile over a static cache (coolsd.compiled)
        self.compiled = bool(compile)
        self._step_fn = compile_step(self._step, model.device) if compile else self._step
        # RoPE rows for every position the cache can hold, made once (traced, they would be recomputed per call)
        self._rope = rope_table(cfg, _compute_dtype(model.dtype), model.device, cfg.block_size + cache_headroom)

    @property
    def guided(self) -> bool:
        return self.cfg_scale != 1.0

    @property
    def device(self) -> torch.device:
        return self.model.device

    def _double(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x]) if self.guided else x

    def _new_cache(self, n: int) -> KVCache:
        cfg, m = self.model.config, self.model
        shape = (cfg.n_layer, n, cfg.n_head, cfg.head_dim, m.dtype, m.device)
        if self.cache is not None and self.cache.matches(*shape):
            self.cache.reset()
            return self.cache
        max_len = -(-(cfg.cls_token_num + cfg.block_size + self.cache_headroom) // 8) * 8
        return KVCache(cfg.n_layer, n, cfg.n_head, cfg.head_dim, max_len, m.dtype, m.device, static=self.compiled)

    def _halves(self, hidden: torch.Tensor) -> torch.Tensor:
        """(2B, m, H) -> (B, m, 2, H) = [cond, uncond] when guided: EAGLE drafters run their own CFG."""
        B = self.batch_size
        return torch.stack([hidden[:B], hidden[B:]], dim=2) if self.guided else hidden

    def _out(self, hidden: torch.Tensor) -> StepOut:
        logits = self.model.logits(hidden)
        B = self.batch_size
        if self.guided:
            logits = cfg_combine(logits[:B], logits[B:], self.cfg_scale)
        return StepOut(logits=logits, hidden=self._halves(hidden))

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
        causal = torch.ones(T, T, dtype=torch.bool, device=model.device).tril()
        eye = torch.eye(T, dtype=torch.bool, device=model.device)
        attend = (causal & mask.unsqueeze(1)) | eye  # (n, T, T): valid earlier slots and itself
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
    ) -> StepOut:
        """tokens, positions: (B, m); positions are image-token indices (token j predicts j+1)."""
        if self.cache is None:
            raise RuntimeError("call begin() first")
        if self.compiled:  # the static cache holds the condition, every image token and cache_headroom pending
            self.cache.check_headroom(tokens.shape[1], self.cache_headroom)
        dev = self.model.device
        logits, hidden = self._step_fn(tokens.to(dev), positions.to(dev), attend.to(dev), *self._rope)
        return StepOut(logits=logits, hidden=hidden)

    def _step(self, tokens, positions, attend, cos, sin):
        """One cached forward (compiled when ``compile``): (logits, hidden) as ``_out`` gives
        them; ``cos``, ``sin``: ``rope_table`` rows, indexed by position (clamped to the table)."""
        model = self.model
        tokens, positions = self._double(tokens), self._double(positions)
        at = positions.clamp(0, cos.shape[0] - 1)
        hidden = model.run(model.tok_embeddings(tokens), cos[at], sin[at], self.cache, attend)
        out = self._out(hidden)
        return out.logits, out.hidden

    @torch.no_grad()
    def commit(self, keep: torch.Tensor, n_keep: torch.Tensor) -> None:
        self.cache.commit(self._double(keep), self._double(n_keep))

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.decoder is None:
            raise RuntimeError("LlamaGenTarget was built without a VQ decoder")
        return self.decoder(tokens)


# ---------------------------------------------------------------------------------------- loading
GPT_SOURCE = "https://huggingface.co/peizesun/llamagen_t2i (t2i_XL_stage1_256.pt; t2i_XL_stage2_512.pt for 512 px)"
GPT_CONFIGS = {"GPT_XL": GPT_XL, "GPT_XL_512": GPT_XL_512}


def gpt_config(spec) -> LlamaGenConfig:
    """A named config (``GPT_XL``, ``GPT_XL_512``) or a mapping of ``LlamaGenConfig`` fields."""
    if isinstance(spec, str):
        if spec not in GPT_CONFIGS:
            raise ValueError(f"unknown gpt_config {spec!r}; valid: {sorted(GPT_CONFIGS)} or a mapping of fields")
        return GPT_CONFIGS[spec]
    return LlamaGenConfig(**dict(spec))


def load_gpt(path, cfg: LlamaGenConfig, dtype=torch.bfloat16, device="cpu") -> LlamaGenGPT:
    """Strictly load an official t2i GPT checkpoint (``{"model": sd}``); a checkpoint of another
    size or grid is an error naming the keys/shapes that differ."""
    import os

    from coolsd.loading import check_state_dict, read_torch_checkpoint

    state = read_torch_checkpoint(path, "LlamaGen t2i GPT checkpoint", GPT_SOURCE)
    with torch.device("meta"):
        model = LlamaGenGPT(cfg)
    check_state_dict(model, state, os.fspath(path), GPT_SOURCE)
    model = model.to_empty(device="cpu")
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
