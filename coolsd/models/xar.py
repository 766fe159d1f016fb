"""xAR (Ren et al. 2025, "next-X prediction"; github.com/OliverRensu/xAR at 121e9c9, ``models/xar.py``,
``models/rope.py``, ``models/sampler.py``) in one file: a class-conditional flow-matching model that
generates the 16x16 KL-16 latent grid of an ImageNet-256 image one CELL (8x8 tokens) at a time.
There is no separate head: the whole encoder-decoder transformer is the velocity field
``v(x_t, t | class, clean earlier cells)``, and each cell is sampled by an Euler-Maruyama SDE whose
every step is a full transformer pass over the cell, with the earlier cells as a key/value cache.
Parameter names are upstream's, so the released ``xAR-{B,L,H}.pth`` (flat state dicts,
``eval.py:172-173``) load strictly (``load_xar``).

Geometry (``to_cells`` / ``from_cells``; upstream ``clusterify`` / ``unclusterify``, xar.py:320-335):
cells are taken row-major over the 2x2 grid of 8x8 quadrants (0 = top-left, 1 = top-right,
2 = bottom-left, 3 = bottom-right), tokens raster order inside a cell. Every per-position table (the
learned position embeddings, the RoPE angles) is indexed in this CELL ORDER. Upstream hard-codes
16x16 / 8x8 / 4 cells / 64 tokens (xar.py:137, 194, 332-334; rope.py:139-140); ``XARConfig`` makes
them parameters (``grid``, ``cell``) so that tests can build 4x4 grids of 2x2 cells, with the
released geometry as the default.

Network (``XAR``; upstream ``xAR``, xar.py:201-286, ``Block`` 147-198, ``Attention`` 85-145):
* input ``z_proj`` (Linear token_dim -> D), ``+ encoder_pos_embed_learned`` BEFORE ``z_proj_ln``
  (RMSNorm with weight; xar.py:244-247, 356-357);
* blocks: RMSNorm WITHOUT weight (eps 1e-6, in fp32, cast back; xar.py:63-80, 165, 178), adaLN from
  ``ada_lin = SiLU, Linear(D, 6D)`` of the cell's condition, unbound in the order gamma1, gamma2,
  scale1, scale2, shift1, shift2 (xar.py:186, 193-197); attention with a fused ``qkv`` (bias), scale
  head_dim^-1/2, no q/k norm, EVA-02 2D RoPE on q and k; timm's ``SwiGLU`` built with
  ``act_layer=nn.GELU`` (xar.py:159, 179-184): ``fc2(gelu(fc1_g x) * fc1_x x)`` (exact erf GELU),
  hidden ``int(D * mlp_ratio * 2 / 3)``;
* ``encoder_norm``, ``decoder_embed`` + ``decoder_pos_embed_learned``, decoder blocks (same width:
  the decoder's ``ada_lin`` takes the same D-wide condition, xar.py:429-430), ``decoder_norm``,
  ``pred`` (Linear D -> 16, xar.py:264);
* condition of a cell = ``class_emb[label] + time_embed(floor(1000 t))`` (xar.py:424-443): the
  INTEGER timestep of the fp32 time (``(t * 1000).long()``), 256 sinusoid frequencies, COS first
  (xar.py:24-61). ``class_emb`` has n_classes + 1 rows; the last (1000) is the null class of
  classifier-free guidance (xar.py:235, 402-404; sampler.py:132). ``NULL_LABEL`` (-1) maps to it.
* attention is BLOCK-CAUSAL over cells: a token sees every token of its own and earlier cells
  (``mask``, xar.py:273-286).
* RoPE (rope.py:96-146, ``VisionRotaryEmbeddingFast(dim=head_dim / 2, pt_seq_len=16)``):
  head_dim / 4 frequencies 1 / theta^(2i / (head_dim / 2)), each used for an interleaved pair
  (``rotate_half`` on pairs (2i, 2i+1), rope.py:38-42); the first half of head_dim rotates with the
  token's row, the second with its column (``broadcat``, rope.py:127), positions 0..grid-1; the
  table is permuted to cell order (rope.py:129-136).

Inference (``context`` / ``velocity``): finished cells are embedded CLEAN at t = 0 and their
post-RoPE keys and values are kept per block (``XARCache``); the velocity of the current cell at
time t attends to that cache and to itself. Upstream does the same thing as a side effect: the
first flow step of cell s feeds [cell s-1's final tokens at t = 0 | noise at t] with the mask and
appends cell s-1's keys to a cache held in the Attention modules (xar.py:129-141, sampler.py:126-147);
later steps attend to the cache without writing. Ours is an explicit value, and a multi-cell
``context`` pass (block-causal mask, cache-free inside) gives the same keys as upstream's
one-cell-at-a-time updates; ``forward`` is the cache-free block-causal network of training
(xar.py:429-430) and equals ``context`` + ``velocity`` (tests/models/test_xar.py).

Sampler (``time_grid``, ``cfg_schedule``, ``guide``, ``transition``, ``sample``; sampler.py:98-218,
xar.py:453-480): per cell, t runs over ``linspace(1, 0.04, N)`` then 0; steps 0..N-2 are
Euler-Maruyama with drift ``x + (2 - t) v`` and std ``sqrt(2 t |dt|)``; the last step (0.04 -> 0)
is the deterministic Euler step with the same drift. CFG mixes the velocities of the two label
halves with the per-cell weight ``1 + (cfg - 1) s / (n_cells - 1)`` (cell 0 unguided) when it is > 1.

Where ours differs from upstream, and why:
* the cache is a returned value, not module state, and ``velocity`` never writes to it (pure calls
  for speculative decoding); same numbers;
* upstream's persistent buffers (``mask``, per block ``attn.rope.freqs / freqs_cos / freqs_sin``) are
  recomputed from the config, not held: ``load_xar`` requires them in the file and checks them against
  the recomputation (see there), then drops them;
* geometry is parametric (above); upstream's ``.cuda()`` calls, its squeeze that breaks a batch of 1
  in training, and its RNG streams (CPU fp32 latents, CUDA fp64 noise) are not reproduced: the noise
  is injected or drawn from a given generator;
* CFG is applied to the velocity, upstream applies it to the drift (sampler.py:157-162); both halves
  share x, so ``d_u + w (d_c - d_u) = x + (2 - t)(v_u + w (v_c - v_u))`` (fp64 rounding apart);
* ``num_steps >= 2``: upstream's N = 1 raises NameError and its N = 2 re-feeds the context with
  ``update_cache=True`` in the last step (sampler.py:170-191), corrupting its cache; ours does what
  the code intends, so upstream parity holds for N >= 3 only;
* RoPE and the norms run in fp32 (fp64 for an fp64 model) and cast back: the same numbers as
  upstream in fp32; under upstream's autocast its RoPE output is fp32 too (fp16 * fp32 tables);
* the training loss (label drop, logit-normal per-cell times, xar.py:400-434) is not implemented;
  ``forward`` is its network function given x_t and t.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from coolsd.engine.batch_invariant import masked_attention
from coolsd.engine.continuous.flow import T_LAST, cfg_schedule, guide, time_grid, transition  # noqa: F401
from coolsd.models.blocks import compute_dtype
from coolsd.models.mar import NULL_LABEL  # -1: the unconditional branch (coolsd.engine.model_protocol)
from coolsd.util.loading import BadInputFile, check_state_dict, read_torch_checkpoint


@dataclass(frozen=True)
class XARConfig:
    grid: int = 16  # latent tokens per side: img_size / vae_stride / patch_size (xar.py:225)
    cell: int = 8  # tokens per cell side: grid / sqrt(clusters) (xar.py:227, 322)
    token_dim: int = 16  # KL-16 latent channels (vae_embed_dim; ``pred`` is Linear(D, 16), xar.py:264)
    dim: int = 1024  # encoder_embed_dim = decoder_embed_dim (upstream needs them equal, xar.py:429-430)
    encoder_depth: int = 16
    decoder_depth: int = 16
    heads: int = 16  # encoder_num_heads = decoder_num_heads in every released model
    mlp_ratio: float = 4.0
    n_classes: int = 1000  # class_emb has n_classes + 1 rows; row n_classes is the null class (xar.py:235)
    rope_theta: float = 10000.0  # rope.py:104

    def __post_init__(self):
        if self.grid % self.cell:
            raise ValueError(f"XARConfig: grid {self.grid} is not a multiple of cell {self.cell}")
        if self.dim % self.heads or (self.dim // self.heads) % 4:
            raise ValueError(f"XARConfig: head_dim = dim / heads = {self.dim}/{self.heads} must be a multiple of 4 "
                             f"(2D RoPE: two halves of rotated pairs)")

    @property
    def seq_len(self) -> int:
        return self.grid * self.grid

    @property
    def cells_per_side(self) -> int:
        return self.grid // self.cell

    @property
    def n_cells(self) -> int:  # upstream ``clusters``
        return self.cells_per_side ** 2

    @property
    def cell_len(self) -> int:  # upstream's hard-coded 64
        return self.cell * self.cell

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def mlp_hidden(self) -> int:  # xar.py:181
        return int(self.dim * self.mlp_ratio * 2 / 3.)

    @property
    def null_class(self) -> int:
        return self.n_classes


# The released models (xar.py:483-504): encoder = decoder, 4 cells of 8x8 on the 16x16 KL-16 grid.
XAR_CONFIGS = {
    "xar_base": XARConfig(dim=768, encoder_depth=8, decoder_depth=8, heads=12),
    "xar_large": XARConfig(dim=1024, encoder_depth=16, decoder_depth=16, heads=16),
    "xar_huge": XARConfig(dim=1280, encoder_depth=20, decoder_depth=20, heads=16),
}
# Their evaluation settings (README.md:64, 76, 88): SDE steps per cell and the cfg of the last cell.
# (``--num_iter 256`` there is ignored by the code: the AR step count is n_cells, xar.py:459.)
XAR_SAMPLING = {
    "xar_base": dict(num_steps=40, cfg=2.7),
    "xar_large": dict(num_steps=50, cfg=2.3),
    "xar_huge": dict(num_steps=50, cfg=2.2),
}
VAE_SCALE = 0.2325  # tokens are decoded as vae.decode(tokens / 0.2325) (engine_xar.py:136)


# ------------------------------------------------------------------------------------ geometry
def cell_order(cfg: XARConfig) -> torch.Tensor:
    """(seq_len,) long: the raster index (row * grid + column) of each position in cell order.
    Cell s covers rows 8 (s // 2) .. and columns 8 (s % 2) .. (for the released 2x2 cells)."""
    c, n = cfg.cell, cfg.cells_per_side
    s, j = torch.arange(cfg.n_cells)[:, None], torch.arange(cfg.cell_len)[None, :]
    row, col = (s // n) * c + j // c, (s % n) * c + j % c
    return (row * cfg.grid + col).reshape(-1)


def to_cells(tokens: torch.Tensor, cfg: XARConfig) -> torch.Tensor:
    """(B, C, H, W) latent grid -> (B, seq_len, C) in cell order (upstream ``clusterify``, concatenated)."""
    return tokens.flatten(2).transpose(1, 2)[:, cell_order(cfg).to(tokens.device)]


def from_cells(x: torch.Tensor, cfg: XARConfig) -> torch.Tensor:
    """(B, seq_len, C) in cell order -> (B, C, H, W) (upstream ``unclusterify``, xar.py:330-335)."""
    out = torch.empty_like(x)
    out[:, cell_order(cfg).to(x.device)] = x
    return out.transpose(1, 2).reshape(x.shape[0], x.shape[2], cfg.grid, cfg.grid)


def rope_frequencies(cfg: XARConfig) -> torch.Tensor:
    """(head_dim / 4,) fp32: upstream's ``rope.freqs`` buffer (rope.py:111-112, 121) with dim = head_dim / 2."""
    half = cfg.head_dim // 2
    return 1. / (cfg.rope_theta ** (torch.arange(0, half, 2)[: half // 2].float() / half))


def rope_tables(cfg: XARConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (seq_len, head_dim) fp32 in CELL order: upstream's ``rope.freqs_cos`` /
    ``freqs_sin`` (rope.py:122-138). Angle of dim d at grid position (r, c): frequency d // 2 of the
    first half times r for d < head_dim / 2, of the second half times c otherwise."""
    g = cfg.grid
    pos = torch.arange(g) / g * g  # rope.py:123 (pt_seq_len = ft_seq_len = grid): 0., 1., ..
    ang = (pos[:, None] * rope_frequencies(cfg)[None, :]).repeat_interleave(2, dim=-1)  # (g, head_dim / 2), pairs
    full = torch.cat([ang[:, None, :].expand(g, g, -1), ang[None, :, :].expand(g, g, -1)], dim=-1)  # row | column
    full = full.reshape(g * g, cfg.head_dim)[cell_order(cfg)]
    return full.cos(), full.sin()


def block_causal_visible(cfg: XARConfig) -> torch.Tensor:
    """(seq_len, seq_len) bool in cell order: query i sees key j iff cell(j) <= cell(i)
    (upstream's additive ``mask`` is 0 there and -inf elsewhere, xar.py:273-286)."""
    cell = torch.arange(cfg.seq_len) // cfg.cell_len
    return cell[None, :] <= cell[:, None]


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ..) -> (-x1, x0, -x3, x2, ..): EVA's ``rotate_half`` (rope.py:38-42)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, head_dim) with (T, head_dim) tables, in fp32 (or fp64), cast back."""
    xf = x.to(compute_dtype(x.dtype))
    return (xf * cos.to(xf.dtype) + rotate_pairs(xf) * sin.to(xf.dtype)).to(x.dtype)


# ------------------------------------------------------------------------------------ network
class RMSNorm(nn.Module):
    """xar.py:63-80: ``x * rsqrt(mean(x^2) + eps)`` in fp32, cast back, then times ``weight`` if it has one."""

    def __init__(self, dim: int, weight: bool = False, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(compute_dtype(x.dtype))
        out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return out if self.weight is None else out * self.weight


class TimestepEmbedder(nn.Module):
    """xar.py:24-61: 256 sinusoids of the integer timestep (cos first, fp32 frequencies), then an MLP."""

    def __init__(self, width: int, n_freq: int = 256):
        super().__init__()
        self.n_freq = n_freq
        self.mlp = nn.Sequential(nn.Linear(n_freq, width), nn.SiLU(), nn.Linear(width, width))

    def forward(self, steps: torch.Tensor) -> torch.Tensor:
        """steps: integer timesteps of any shape -> (*shape, width)."""
        half = self.n_freq // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(0, half, dtype=torch.float32) / half).to(steps.device)
        ang = steps.float()[..., None] * freqs
        emb = torch.cat([torch.cos(ang), torch.sin(ang)], dim=-1)
        return self.mlp(emb.to(self.mlp[0].weight.dtype))


def timestep(t) -> torch.Tensor:
    """Flow time (float or tensor in [0, 1]) -> upstream's integer timestep ``(t * 1000).long()`` of
    the fp32 time (xar.py:424, 440; the sampler casts its fp64 times to fp32, sampler.py:145-151)."""
    return (torch.as_tensor(t).to(torch.float32) * 1000).long()


class SwiGLU(nn.Module):
    """timm ``layers.SwiGLU`` (timm/layers/mlp.py) as xAR builds it: ``act_layer=nn.GELU``, so a
    GELU-gated MLP ``fc2(gelu(fc1_g x) * fc1_x x)``; norm = Identity, dropout 0."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1_g = nn.Linear(dim, hidden)
        self.fc1_x = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1_g(x)) * self.fc1_x(x))


class Attention(nn.Module):
    """xar.py:85-145 without its module-held cache: returns the new post-RoPE (k, v) beside the output."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)  # qkv_bias=True (xar.py:250, 260)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, cos, sin, past=None, visible=None):
        B, T, D = x.shape
        q, k, v = self.qkv(x).reshape(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        new = (k, v)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        out = masked_attention(q, k, v, visible)  # batch-invariant under batch_invariant()
        return self.proj(out.transpose(1, 2).reshape(B, T, D)), new


class Block(nn.Module):
    """xar.py:147-198: adaLN-modulated pre-norm attention and MLP; ``cond`` is one vector per cell."""

    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.norm1 = RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = RMSNorm(dim)
        self.mlp = SwiGLU(dim, hidden)
        self.ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x, cond, cos, sin, past=None, visible=None):
        """x (B, T, D) of k cells, cond (B, k, D) -> (x, (k, v) of these T tokens)."""
        B, T, D = x.shape
        k = cond.shape[1]
        mod = self.ada_lin(cond).view(B, k, 1, 6, D).expand(B, k, T // k, 6, D).reshape(B, T, 6, D)
        gamma1, gamma2, scale1, scale2, shift1, shift2 = mod.unbind(2)  # xar.py:195
        a, kv = self.attn(self.norm1(x) * (scale1 + 1) + shift1, cos, sin, past, visible)
        x = x + a * gamma1
        return x + self.mlp(self.norm2(x) * (scale2 + 1) + shift2) * gamma2, kv


@dataclass
class XARCache:
    """The finished cells' post-RoPE keys and values, per block (encoder blocks, then decoder blocks),
    each (B, heads, n_cells * cell_len, head_dim). Rows are the batch as the caller built it (for CFG:
    the labelled rows, then the null-label rows: the label changes the context's adaLN, so the halves'
    keys differ)."""
    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)
    n_cells: int = 0

    def extended(self, new: list, cells: int) -> XARCache:
        if not self.n_cells:
            return XARCache([k for k, _ in new], [v for _, v in new], cells)
        return XARCache([torch.cat([a, k], 2) for a, (k, _) in zip(self.keys, new)],
                        [torch.cat([a, v], 2) for a, (_, v) in zip(self.values, new)], self.n_cells + cells)


class XAR(nn.Module):
    def __init__(self, cfg: XARConfig):
        super().__init__()
        self.config = cfg
        D, L, H = cfg.dim, cfg.seq_len, cfg.mlp_hidden
        self.class_emb = nn.Embedding(cfg.n_classes + 1, D)
        self.time_embed = TimestepEmbedder(D)
        self.z_proj = nn.Linear(cfg.token_dim, D)
        self.z_proj_ln = RMSNorm(D, weight=True)
        self.encoder_pos_embed_learned = nn.Parameter(torch.zeros(1, L, D))
        self.encoder_blocks = nn.ModuleList(Block(D, cfg.heads, H) for _ in range(cfg.encoder_depth))
        self.encoder_norm = RMSNorm(D, weight=True)
        self.decoder_embed = nn.Linear(D, D)
        self.decoder_pos_embed_learned = nn.Parameter(torch.zeros(1, L, D))
        self.decoder_blocks = nn.ModuleList(Block(D, cfg.heads, H) for _ in range(cfg.decoder_depth))
        self.decoder_norm = RMSNorm(D, weight=True)
        self.pred = nn.Linear(D, cfg.token_dim)
        self._tables: dict = {}  # device -> (cos, sin, visible): recomputed constants, not state
        for m in self.modules():  # upstream's initialisation (xar.py:289-308); only training from scratch sees it
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        for p in (self.class_emb.weight, self.encoder_pos_embed_learned, self.decoder_pos_embed_learned):
            nn.init.normal_(p, std=.02)

    # ---------------------------------------------------------------- pieces
    def tables(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cos, sin) RoPE tables and the block-causal visibility, fp32 / bool, on ``device``."""
        key = torch.device(device)
        if key not in self._tables:
            cos, sin = rope_tables(self.config)
            self._tables[key] = (cos.to(key), sin.to(key), block_causal_visible(self.config).to(key))
        return self._tables[key]

    def class_index(self, labels: torch.Tensor) -> torch.Tensor:
        """Class labels -> rows of ``class_emb``: ``NULL_LABEL`` (any negative) -> the null row n_classes
        (upstream passes 1000 itself, which is kept)."""
        return torch.where(labels < 0, torch.full_like(labels, self.config.null_class), labels).long()

    def condition(self, labels: torch.Tensor, t) -> torch.Tensor:
        """labels (B,), t (B, k) flow times (or a float, or (B,) for k = 1) -> (B, k, D): the adaLN
        input of each cell, ``class_emb[label] + time_embed(floor(1000 t))`` (xar.py:439-443)."""
        B = labels.shape[0]
        steps = timestep(t).to(labels.device)
        steps = steps.reshape(B, -1) if steps.dim() else steps.expand(B, 1)
        return self.class_emb(self.class_index(labels))[:, None] + self.time_embed(steps)

    def _run(self, x, cond, first_cell: int, cache: XARCache | None, head: bool = True):
        """x (B, T, C) tokens of cells first_cell .. first_cell + k - 1 (cell order), cond (B, k, D),
        attending to ``cache`` (cells < first_cell) and block-causally to themselves. Returns
        (pred (B, T, C) or None, [(k, v) of these tokens per block])."""
        cfg = self.config
        T, k = x.shape[1], cond.shape[1]
        if T != k * cfg.cell_len:
            raise ValueError(f"xAR: {T} tokens for {k} cells of {cfg.cell_len}")
        n_past = cache.n_cells if cache is not None else 0
        if n_past != first_cell or first_cell + k > cfg.n_cells:
            raise ValueError(f"xAR: cells {first_cell}..{first_cell + k - 1} after a cache of {n_past} cells "
                             f"(of {cfg.n_cells})")
        lo, hi = first_cell * cfg.cell_len, first_cell * cfg.cell_len + T
        B = x.shape[0]
        visible = None if k == 1 else self.tables(x.device)[2][lo:hi, :hi].expand(B, -1, -1)  # one cell: every key
        past = list(zip(cache.keys, cache.values)) if n_past else None
        return self.attend(x, torch.arange(lo, hi, device=x.device).expand(B, -1), cond, past, visible, head)

    # ---------------------------------------------------------------- any positions, any mask (speculation)
    def cell_positions(self) -> torch.Tensor:
        """(seq_len,) long: the raster index of each cell-order position (``cell_order``)."""
        return cell_order(self.config)

    def attend(self, x, pos, cond, past=None, visible=None, head: bool = True):
        """The network on tokens at arbitrary positions: x (E, T, C) at cell-order positions ``pos``
        (E, T) long, ``cond`` (E, k, D) one adaLN vector per chunk of T / k tokens (``Block``), attending to ``past`` (per block
        (k, v), each (E, heads, P, head_dim); None: no cache) and to themselves, query i seeing key j
        iff ``visible[e, i, j]`` ((E, T, P + T) bool, keys = past then these tokens; None: every key).
        Every per-position table is gathered at ``pos``; ``_run`` (contiguous cells, block-causal) is this
        call. Returns (pred (E, T, C) or None, [(k, v)])."""
        cos, sin, _ = self.tables(x.device)
        cos, sin = cos[pos][:, None], sin[pos][:, None]  # (E, 1, T, head_dim): broadcast over heads
        mask = None if visible is None else visible[:, None]
        new = []
        h = self.z_proj_ln(self.z_proj(x) + self.encoder_pos_embed_learned[0][pos])
        for i, blk in enumerate(self.encoder_blocks):
            h, kv = blk(h, cond, cos, sin, None if past is None else past[i], mask)
            new.append(kv)
        h = self.decoder_embed(self.encoder_norm(h)) + self.decoder_pos_embed_learned[0][pos]
        n_enc = len(self.encoder_blocks)
        for i, blk in enumerate(self.decoder_blocks):
            h, kv = blk(h, cond, cos, sin, None if past is None else past[n_enc + i], mask)
            new.append(kv)
        return (self.pred(self.decoder_norm(h)) if head else None), new

    def context_all(self, tokens: torch.Tensor, labels: torch.Tensor, unit: int) -> list:
        """Keys and values (per block, each (E, heads, seq_len, head_dim)) of ALL positions of clean
        tokens (E, seq_len, C) in cell order, embedded at t = 0, UNIT-causal: position p sees the
        positions of its own and earlier units of ``unit`` tokens. A key of unit k depends on units
        <= k only, so one context serves every known prefix of units (the caller hides keys past it);
        at unit = cell_len these are the keys ``context`` returns for the same cells."""
        E, L = tokens.shape[:2]
        idx = torch.arange(L, device=tokens.device)
        u_of = idx // unit
        visible = (u_of[None, :] <= u_of[:, None]).expand(E, L, L)
        return self.attend(tokens, idx.expand(E, L), self.condition(labels, 0.), None, visible, head=False)[1]

    def velocity_at(self, past: list, x: torch.Tensor, pos: torch.Tensor, t, labels: torch.Tensor,
                    visible: torch.Tensor) -> torch.Tensor:
        """Raw velocity (E, T, C) of states x (E, T, C) at cell-order positions ``pos`` (E, T) and flow
        time t (float), for the rows' labels, given the keys ``past`` of ``context_all`` and the
        visibility ``visible`` (E, T, seq_len + T) (cache keys, then the queries themselves)."""
        return self.attend(x, pos, self.condition(labels, t), past, visible)[0]

    # ---------------------------------------------------------------- the three calls
    def forward(self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Cache-free: x (B, seq_len, C) every cell at its own time t (B, n_cells), labels (B,) ->
        v (B, seq_len, C), block-causal over cells. Upstream's training network
        (``forward_mae_encoder`` + ``forward_mae_decoder`` with ``self.mask``, xar.py:428-430)."""
        return self._run(x, self.condition(labels, t), 0, None)[0]

    def context(self, cells: torch.Tensor, labels: torch.Tensor, cache: XARCache | None = None) -> XARCache:
        """Append k finished cells, CLEAN tokens (B, k * cell_len, C) in cell order, embedded at
        t = 0 (sampler.py:146), to ``cache`` (cells before them; None = none). Returns a new cache;
        the old one is not changed."""
        cache = cache or XARCache()
        k = cells.shape[1] // self.config.cell_len
        cond = self.condition(labels, torch.zeros(labels.shape[0], k))
        return cache.extended(self._run(cells, cond, cache.n_cells, cache, head=False)[1], k)

    def velocity(self, cache: XARCache | None, x: torch.Tensor, t, labels: torch.Tensor) -> torch.Tensor:
        """v (B, cell_len, C) of the next cell (number ``cache.n_cells``) at state x (B, cell_len, C)
        and flow time t (float or (B,)), given the finished cells in ``cache``. Raw (unguided) velocity
        for the rows' labels; the cache's rows must be the same batch."""
        first = cache.n_cells if cache is not None else 0
        return self._run(x, self.condition(labels, t), first, cache)[0]


# ------------------------------------------------------------------------------------ sampler
# time_grid, cfg_schedule, guide, transition: coolsd.engine.continuous.flow (the loop shares them)


@torch.no_grad()
def sample(model: XAR, labels: torch.Tensor, num_steps: int, cfg: float = 1.0, latents=None, eps=None,
           generator: torch.Generator | None = None, trace: list | None = None) -> torch.Tensor:
    """Upstream's ``sample_tokens`` (xar.py:453-480 with sampler.py:98-218): labels (B,) -> tokens
    (B, token_dim, grid, grid) fp32. Noise: ``latents`` (n_cells, B, cell_len, C) initial states and
    ``eps`` (n_cells, num_steps - 1, B, cell_len, C) step noises, else drawn from ``generator``.
    The state is fp64, the model sees it in its own dtype, each finished cell is rounded to fp32
    (as upstream, xar.py:472). With cfg > 1 every call runs both label halves (the null half's
    context is needed by later cells). ``trace`` (a list) receives one dict per step: cell, step, t,
    x (state before), v (raw velocities of the rows run), mean, std."""
    c = model.config
    p = next(model.parameters())
    B, grid = labels.shape[0], time_grid(num_steps)
    halves = cfg > 1
    rows = torch.cat([labels, torch.full_like(labels, NULL_LABEL)]) if halves else labels
    dup = (lambda z: torch.cat([z, z])) if halves else (lambda z: z)
    cache, cells = None, []
    for s in range(c.n_cells):
        w = cfg_schedule(cfg, s, c.n_cells)
        if s:
            cache = model.context(dup(cells[-1]).to(p.device, p.dtype), rows, cache)
        x = latents[s] if latents is not None else torch.randn(B, c.cell_len, c.token_dim, generator=generator)
        x = x.to(p.device, torch.float64)
        for i in range(num_steps):
            t, dt = float(grid[i]), float(grid[i + 1] - grid[i])
            v = model.velocity(cache, dup(x.to(p.dtype)), t, rows).double()
            mean, std = transition(x, guide(v[:B], v[B:], w) if halves else v, t, dt, last=i == num_steps - 1)
            if std:
                noise = eps[s, i] if eps is not None else torch.randn(x.shape, generator=generator, dtype=torch.float64)
                x_next = mean + std * noise.to(mean)
            else:
                x_next = mean
            if trace is not None:
                trace.append(dict(cell=s, step=i, t=t, x=x, v=v, mean=mean, std=std))
            x = x_next
        cells.append(x.float())
    return from_cells(torch.cat(cells, 1), c)


# ------------------------------------------------------------------------------------ checkpoints
XAR_SOURCE = ("the xAR-B / xAR-L / xAR-H .pth files (github.com/OliverRensu/xAR README.md:56: Hugging Face "
              "OliverRen/xAR; eval.py --resume ../ckpt/xAR-B.pth)")
ROPE_ATOL = 1e-5  # the recomputed RoPE tables vs the file's: fp32 cos / sin of the same angles (ulps apart at most)


def upstream_buffers(cfg: XARConfig) -> dict:
    """Upstream's persistent buffers for ``cfg``, by state-dict key: ``mask`` (1, 1, L, L) fp32 0 / -inf
    (xar.py:286) and per block ``<blocks>.<i>.attn.rope.freqs`` (head_dim / 4,), ``freqs_cos`` and
    ``freqs_sin`` (L, head_dim) (rope.py:121, 137-138). Ours recomputes them; these are what an
    official file holds."""
    cos, sin = rope_tables(cfg)
    mask = torch.where(block_causal_visible(cfg), 0., float("-inf"))[None, None]
    out = {"mask": mask}
    for part, depth in (("encoder_blocks", cfg.encoder_depth), ("decoder_blocks", cfg.decoder_depth)):
        for i in range(depth):
            out.update({f"{part}.{i}.attn.rope.freqs": rope_frequencies(cfg), f"{part}.{i}.attn.rope.freqs_cos":
                        cos.clone(), f"{part}.{i}.attn.rope.freqs_sin": sin.clone()})  # own storage, as in a file
    return out


def upstream_state_dict(model: XAR) -> dict:
    """Our model's weights in the layout of an official file: its state dict plus ``upstream_buffers``."""
    return {**model.state_dict(), **upstream_buffers(model.config)}


def _check_buffers(state: dict, cfg: XARConfig, path) -> None:
    """Every upstream buffer is in ``state`` with upstream's shape and the value we recompute (the
    mask exactly, the RoPE tables within ``ROPE_ATOL``): a file made with another geometry or RoPE
    would otherwise load and silently run with our tables. Removes them from ``state``."""
    expected = upstream_buffers(cfg)
    missing = sorted(k for k in expected if k not in state)
    shapes = sorted(k for k in expected if k in state and tuple(state[k].shape) != tuple(expected[k].shape))
    values = []
    for k in sorted(set(expected) - set(missing) - set(shapes)):
        got, want = state[k].float(), expected[k]
        ok = torch.equal(got, want) if k == "mask" else bool((got - want).abs().max() <= ROPE_ATOL)
        if not ok:
            values.append(k)
    if missing or shapes or values:
        parts = ([f"missing keys: {', '.join(missing[:6])}" + (f", ... ({len(missing)} in all)" if len(missing) > 6
                                                               else "")] if missing else []) + \
                (["wrong shapes: " + ", ".join(f"{k} {tuple(state[k].shape)} (expected {tuple(expected[k].shape)})"
                                                 for k in shapes[:6])] if shapes else []) + \
                ([f"values differ from the recomputed constant (another geometry or RoPE): {', '.join(values[:6])}"]
                 if values else [])
        raise BadInputFile(f"{os.fspath(path)} does not fit XAR ({'; '.join(parts)}); expected the file from "
                           f"{XAR_SOURCE}")
    for k in expected:
        del state[k]


def load_xar(path, cfg: XARConfig, dtype=torch.float32, device="cpu") -> XAR:
    """Strict, safe loading of an xAR checkpoint for the architecture ``cfg``: the released flat state
    dict (``eval.py:172-173`` loads it with ``load_state_dict``, strict), ``.safetensors``, or a
    ``main_mar.py`` training checkpoint ({"model", "model_ema", ..., "args"}, util/misc.py:306-329:
    "model_ema" is taken, then "model"; its argparse ``args`` is allowed, nothing else), all via
    ``torch.load(weights_only=True)``. Every parameter key and shape must match (one error naming the
    file and the keys otherwise). Upstream's persistent buffers (``mask``, ``*.attn.rope.freqs*``) must
    be there too and equal our recomputation (``_check_buffers``); they are then dropped: our model
    recomputes them from the config instead of holding 3 x (depth) copies of one table."""
    import argparse

    state = dict(read_torch_checkpoint(path, "xAR checkpoint", XAR_SOURCE, keys=("model_ema", "model"),
                                       allow=(argparse.Namespace,)))
    with torch.device("meta"):
        model = XAR(cfg)
    buffers = upstream_buffers(cfg).keys()
    check_state_dict(model, {k: v for k, v in state.items() if k not in buffers}, os.fspath(path), XAR_SOURCE)
    _check_buffers(state, cfg, path)
    model = model.to_empty(device="cpu")
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


__all__ = ["NULL_LABEL", "VAE_SCALE", "XAR", "XAR_CONFIGS", "XAR_SAMPLING", "XARCache", "XARConfig", "cell_order",
           "cfg_schedule", "from_cells", "guide", "load_xar", "rope_tables", "sample", "time_grid", "timestep",
           "to_cells", "transition", "upstream_buffers", "upstream_state_dict"]
