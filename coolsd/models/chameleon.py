"""The Chameleon decoder-only transformer as Lumina-mGPT ships it (Alpha-VLLM/Lumina-mGPT,
``lumina_mgpt/model/chameleon/modeling_chameleon.py``: ``ChameleonForConditionalGeneration``),
inference only, with the checkpoint's parameter names and the KV-cache path of the project
(``coolsd.models.kv_cache.KVCache``), like ``coolsd.models.llamagen.LlamaGenGPT``.

Architecture (models_sjd.md 2.1; upstream ``ChameleonDecoderLayer``, ``swin_norm=False``):

* pre-norm blocks: ``h = x + o_proj(attn(input_layernorm(x)))``,
  ``out = h + down_proj(silu(gate_proj(n)) * up_proj(n))`` with ``n = post_attention_layernorm(h)``;
* MHA without biases; after the q/k projections, a per-head LayerNorm over head_dim (statistics
  over the last dim only, eps 1e-5 fixed upstream in ``ChameleonLayerNorm.forward``) with a
  per-head affine weight and bias, THEN 1D RoPE (HF ``rotate_half`` layout: the converter
  ``convert_chameleon_weights_to_hf.py`` permutes q/k rows and the q/k-norm vectors for it);
* RoPE from LOGICAL positions (``inv_freq = theta^(-2i/d)``, angles ``pos * inv_freq``, the
  (cos, sin) table duplicated over the two halves), independent of the KV-cache slot;
* final RMSNorm, untied ``lm_head``.

Numerics (upstream runs bf16 weights inside a bf16 autocast, ``inference_solver.py``):
RMSNorm normalises in fp32 and casts back before the weight (``ChameleonRMSNorm``); the q/k
LayerNorm and RoPE run in fp32 (under autocast ``layer_norm`` returns fp32 upstream); attention
runs in the model dtype; logits are fp32 (``logits.float()``). An fp64 model stays fp64 for
tests. One deliberate difference: upstream casts the RoPE (cos, sin) table to bf16 before the
rotation; here it stays fp32.

Checkpoint layout (safetensors shards + ``model.safetensors.index.json``, HF layout of
``ChameleonForConditionalGeneration``): ``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
``model.layers.{i}.self_attn.{q,k}_norm.{weight,bias}``,
``model.layers.{i}.mlp.{gate,up,down}_proj.weight``,
``model.layers.{i}.{input,post_attention}_layernorm.weight``, ``model.norm.weight``,
``lm_head.weight``. The q/k-norm tensors are ``[model_parallel_size=1, head_dim]`` in Lumina's
checkpoints (vendored ``ChameleonLayerNorm`` repeat-interleaves them over heads at run time) and
``[num_heads, head_dim]`` in transformers' layout; both load (the [1, d] form is broadcast to
every head: numerically identical). Upstream's ``ChameleonModel`` also owns ``vqmodel`` (the VQ
ENCODER side, copied from ``vqgan.ckpt`` without the decoder by the converter), so HF Chameleon
checkpoints may carry ``model.vqmodel.*`` tensors. Lumina's training deletes it before saving
(``finetune_solver.py``: ``del model.model.vqmodel``; ``save_pretrained(max_shard_size="10GB")``),
and the released shard sizes (9.98 + 4.05 GB) equal the 7,013,158,912 backbone parameters in bf16
with no room for the ~29M encoder parameters, so they are expected to be absent; if present they
are not used for generation (pixels come from ``coolsd.models.chameleon_vq`` and ``vqgan.ckpt``)
and are the one documented ignored prefix. Every other key must match exactly.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from coolsd.engine.compiled import compiling
from coolsd.models.blocks import GatedMLP, RMSNorm, compute_dtype as _compute_dtype
from coolsd.models.kv_cache import KVCache
from coolsd.util.loading import MissingInputFile, read_json, reading

HF_SOURCE = "huggingface.co/Alpha-VLLM/Lumina-mGPT-7B-768"
SHARD = "a safetensors weight file of Lumina-mGPT-7B-768"
IGNORED_PREFIXES = ("model.vqmodel.",)  # VQ encoder weights of HF Chameleon checkpoints (docstring)
QK_NORM_EPS = 1e-5  # hard-coded in upstream ChameleonLayerNorm.forward


# ---------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class ChameleonConfig:
    hidden_size: int = 4096
    num_layers: int = 32
    num_heads: int = 32
    intermediate_size: int = 11008
    vocab_size: int = 65536
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of {self.num_heads} heads")
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> "ChameleonConfig":
        """From a checkpoint's ``config.json`` (dict). Refuses settings this implementation does
        not have (GQA, swin norm, RoPE scaling, biases) instead of silently ignoring them."""
        checks = {
            "num_key_value_heads": cfg.get("num_key_value_heads", cfg.get("num_attention_heads")),
            "swin_norm": cfg.get("swin_norm", False),
            "rope_scaling": cfg.get("rope_scaling"),
            "attention_bias": cfg.get("attention_bias", False),
            "mlp_bias": cfg.get("mlp_bias", False),
            "hidden_act": cfg.get("hidden_act", "silu"),
            "tie_word_embeddings": cfg.get("tie_word_embeddings", False),
        }
        wanted = {
            "num_key_value_heads": cfg.get("num_attention_heads"),
            "swin_norm": False, "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
            "hidden_act": "silu", "tie_word_embeddings": False,
        }
        bad = {k: v for k, v in checks.items() if v != wanted[k]}
        if bad:
            raise ValueError(f"unsupported Chameleon config settings {bad}; supported: {wanted}")
        try:
            return cls(
                hidden_size=int(cfg["hidden_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=int(cfg["num_attention_heads"]),
                intermediate_size=int(cfg["intermediate_size"]),
                vocab_size=int(cfg["vocab_size"]),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                rope_theta=float(cfg.get("rope_theta", 10000.0)),
            )
        except KeyError as e:
            raise ValueError(f"Chameleon config.json lacks {e.args[0]!r}") from None


# Chameleon-7B / Lumina-mGPT-7B (models_sjd.md 2.1).
CHAMELEON_7B = ChameleonConfig()


def tiny(**overrides) -> ChameleonConfig:
    """A small config for CPU tests (vocab 64: room for a tiny image vocabulary and the
    structural tokens of ``coolsd.models.lumina.LuminaTokens.tiny``)."""
    base = dict(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, vocab_size=64)
    base.update(overrides)
    return ChameleonConfig(**base)


# ---------------------------------------------------------------------------------------- RoPE
@functools.lru_cache(maxsize=16)
def _inv_freq(head_dim: int, theta: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # upstream ChameleonRotaryEmbedding: 1 / theta^(arange(0, d, 2) / d)
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).to(dtype) / head_dim))


def rope_1d(positions: torch.Tensor, cfg: ChameleonConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (B, m, head_dim // 2), for logical positions (B, m); the upstream table
    is these values duplicated over both halves (``emb = cat(freqs, freqs)``)."""
    # traced (torch.compile), the table is computed in the graph: Dynamo would skip the cache wrapper anyway
    inv_freq = (_inv_freq.__wrapped__ if compiling() else _inv_freq)(cfg.head_dim, cfg.rope_theta, dtype, positions.device)
    freqs = positions.to(dtype).unsqueeze(-1) * inv_freq
    return torch.cos(freqs), torch.sin(freqs)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF ``rotate_half`` RoPE: x (B, m, H, D); cos, sin (B, m, D/2) in the compute dtype.
    ``x*cos + rotate_half(x)*sin`` with ``rotate_half(x) = [-x2, x1]`` (x1, x2 the halves)."""
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    xc = x.to(cos.dtype)
    x1, x2 = xc.chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


# ---------------------------------------------------------------------------------------- modules
class HeadLayerNorm(nn.Module):
    """Per-head LayerNorm over head_dim with a per-head affine (upstream ``ChameleonLayerNorm``:
    statistics over the last dim only, weight/bias applied per head). Parameters are stored as
    (num_heads, head_dim), transformers' layout; ``load_checkpoint`` also takes Lumina's
    (1, head_dim) form and broadcasts it. Output in the compute dtype (fp32 / fp64)."""

    def __init__(self, num_heads: int, head_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_heads, head_dim))
        self.bias = nn.Parameter(torch.zeros(num_heads, head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, m, H, D)
        cdt = _compute_dtype(x.dtype)
        normed = F.layer_norm(x.to(cdt), x.shape[-1:], eps=QK_NORM_EPS)
        return normed * self.weight.to(cdt) + self.bias.to(cdt)


class ChameleonAttention(nn.Module):
    def __init__(self, cfg: ChameleonConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.q_norm = HeadLayerNorm(cfg.num_heads, cfg.head_dim)
        self.k_norm = HeadLayerNorm(cfg.num_heads, cfg.head_dim)

    def forward(self, x, cos, sin, cache: Optional[KVCache], layer: int, step) -> torch.Tensor:
        B, m, d = x.shape
        shape = (B, m, self.num_heads, self.head_dim)
        # order as upstream ChameleonAttention.forward: project, per-head norm, then RoPE
        q = apply_rope(self.q_norm(self.q_proj(x).view(shape)), cos, sin).to(x.dtype)
        k = apply_rope(self.k_norm(self.k_proj(x).view(shape)), cos, sin).to(x.dtype)
        v = self.v_proj(x).view(shape)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is None:  # full-sequence forward: ``step`` is the (B, 1, m, m) bool mask
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=step)
        else:
            out = cache.attend(layer, q, k, v, step)
        return self.o_proj(out.transpose(1, 2).reshape(B, m, d))


class ChameleonDecoderLayer(nn.Module):
    def __init__(self, cfg: ChameleonConfig):
        super().__init__()
        self.self_attn = ChameleonAttention(cfg)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache, layer, step) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, step)
        return h + self.mlp(self.post_attention_layernorm(h))


class ChameleonBackbone(nn.Module):
    """``model.*`` of the checkpoint (upstream ``ChameleonModel`` without its ``vqmodel``)."""

    def __init__(self, cfg: ChameleonConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(ChameleonDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class ChameleonLM(nn.Module):
    """The Chameleon / Lumina-mGPT language model: ``model`` (backbone) + ``lm_head``."""

    def __init__(self, cfg: ChameleonConfig, init_std: float = 0.02):
        super().__init__()
        self.config = cfg
        self.model = ChameleonBackbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        for mod in self.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, std=init_std)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def run(self, h: torch.Tensor, positions: torch.Tensor, cache: KVCache, attend: torch.Tensor,
            valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Input embeddings h (B, m, d) at logical positions (B, m) -> hidden after the final
        norm; the m entries become pending in ``cache``, each attending the committed entries
        and the pending ones ``attend`` allows ((m, P+m) or (B, m, P+m)), as
        ``LlamaGenGPT.run``. ``valid`` (B,): real rows per sample of right-padded input."""
        step = cache.prepare(attend, h.shape[1], valid)
        cos, sin = rope_1d(positions, self.config, _compute_dtype(self.dtype))
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, cache, i, step)
        cache.advance(h.shape[1])
        return self.model.norm(h)

    def forward(
        self, ids: torch.Tensor, positions: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Plain full forward without a cache: token ids (B, L) -> hidden (B, L, d) after the
        final norm. Default positions 0..L-1 and a causal mask; ``mask`` (B, L, L) or (L, L)
        bool (True = attend) replaces it."""
        B, L = ids.shape
        if positions is None:
            positions = torch.arange(L, device=ids.device).expand(B, L)
        if mask is None:
            mask = torch.ones(L, L, dtype=torch.bool, device=ids.device).tril()
        mask = mask.expand(B, L, L).unsqueeze(1)
        cos, sin = rope_1d(positions, self.config, _compute_dtype(self.dtype))
        h = self.embed(ids)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, None, i, mask)
        return self.model.norm(h)

    def logits(self, hidden: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """fp32 (or fp64) logits; ``rows`` selects lm_head rows (e.g. the image vocabulary)."""
        w = self.lm_head.weight if rows is None else self.lm_head.weight[rows]
        out = F.linear(hidden, w)
        return out.to(_compute_dtype(out.dtype))

    # ------------------------------------------------------------------ checkpoint loading
    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.state_dict().items()}

    def check_keys(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Raise a ValueError naming every missing, unexpected or mis-shaped key of a checkpoint
        described by ``{key: shape}``. Accepted beyond exact matches: q/k-norm tensors of shape
        (1, head_dim) (Lumina) for our (num_heads, head_dim), and keys under ``IGNORED_PREFIXES``."""
        expected = self.expected_shapes()
        got = {k: tuple(s) for k, s in shapes.items() if not k.startswith(IGNORED_PREFIXES)}
        missing = sorted(set(expected) - set(got))
        unexpected = sorted(set(got) - set(expected))
        bad = []
        for k in sorted(set(expected) & set(got)):
            if got[k] != expected[k] and not (_is_qk_norm(k) and got[k] == (1, expected[k][1])):
                bad.append(f"{k}: checkpoint {got[k]}, model {expected[k]}")
        if missing or unexpected or bad:
            raise ValueError(
                "checkpoint does not match ChameleonLM "
                f"(hidden {self.config.hidden_size}, {self.config.num_layers} layers, "
                f"{self.config.num_heads} heads, vocab {self.config.vocab_size}):"
                + _listing("missing keys", missing)
                + _listing("unexpected keys", unexpected)
                + _listing("wrong shapes", bad)
            )

    @torch.no_grad()
    def load_checkpoint(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Strictly load a state dict in the checkpoint layout (see the module docstring);
        nothing is written unless every key checks out."""
        self.check_keys({k: tuple(v.shape) for k, v in state_dict.items()})
        params = self.state_dict(keep_vars=True)
        for k, p in params.items():
            p.copy_(state_dict[k].expand_as(p))  # (1, d) q/k norms broadcast to every head

    @torch.no_grad()
    def load_pretrained(self, folder: str | Path) -> None:
        """Strictly load a local Hugging Face folder of safetensors shards
        (``model-0000x-of-0000y.safetensors`` + ``model.safetensors.index.json``, or a single
        ``model.safetensors``), one tensor at a time; every key is checked before any is loaded."""
        from safetensors import safe_open


        files = checkpoint_files(folder)
        shapes: dict[str, tuple[int, ...]] = {}
        where: dict[str, Path] = {}
        for f in files:
            with reading(f, SHARD, HF_SOURCE), safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    if k in where:
                        raise ValueError(f"key {k!r} appears in both {where[k].name} and {f.name}")
                    shapes[k] = tuple(sf.get_slice(k).get_shape())
                    where[k] = f
        index = Path(folder) / "model.safetensors.index.json"
        if index.is_file():
            listed = weight_map(index)
            wrong = sorted(k for k in set(listed) | set(where)
                           if where.get(k) is None or listed.get(k) != where[k].name)
            if wrong:
                raise ValueError(f"{index} disagrees with the shard contents on keys: {_head(wrong)}")
        with reading(folder, "a Lumina-mGPT-7B-768 checkpoint folder", HF_SOURCE):
            self.check_keys(shapes)
        params = self.state_dict(keep_vars=True)
        for f in files:
            with reading(f, SHARD, HF_SOURCE), safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    if k in params:
                        p = params[k]
                        p.copy_(sf.get_tensor(k).to(p.device).expand_as(p))


def _is_qk_norm(key: str) -> bool:
    return key.endswith(tuple(f"self_attn.{n}_norm.{p}" for n in "qk" for p in ("weight", "bias")))


def _head(items: list[str], n: int = 12) -> str:
    return ", ".join(items[:n]) + (f", ... ({len(items) - n} more)" if len(items) > n else "")


def _listing(title: str, items: list[str]) -> str:
    return f"\n  {title} ({len(items)}): {_head(items)}" if items else ""


def checkpoint_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a local checkpoint folder: the shards named by
    ``model.safetensors.index.json`` (all must exist), else ``model.safetensors``."""

    folder = Path(folder)
    hint = f"download the checkpoint folder from {HF_SOURCE} (config.json, model.safetensors.index.json and its shards)"
    if not folder.is_dir():
        raise MissingInputFile(f"Lumina-mGPT checkpoint folder {folder} does not exist; {hint}")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(weight_map(index).values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise MissingInputFile(f"{folder} lacks shard(s) {missing} listed in {index.name}; {hint}")
        return [folder / s for s in shards]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise MissingInputFile(f"{folder} has neither model.safetensors.index.json nor model.safetensors; {hint}")


def weight_map(index: Path) -> dict:
    """``weight_map`` (key -> shard file name) of a ``model.safetensors.index.json``."""

    what = "a safetensors index (model.safetensors.index.json)"
    data = read_json(index, what, HF_SOURCE)
    with reading(index, what, HF_SOURCE):
        return dict(data["weight_map"])


def read_hf_config(folder: str | Path) -> dict:
    """``config.json`` of a local checkpoint folder (holds ``vocabulary_map``)."""

    return read_json(Path(folder) / "config.json", "Lumina-mGPT's config.json", HF_SOURCE)


def load_chameleon(
    folder: str | Path, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"
) -> tuple[ChameleonLM, dict]:
    """Build a ``ChameleonLM`` from a local checkpoint folder: config from ``config.json``,
    weights strictly from the safetensors shards. Returns (model in eval mode, config dict)."""

    hf = read_hf_config(folder)
    with reading(Path(folder) / "config.json", "Lumina-mGPT's config.json", HF_SOURCE):
        cfg = ChameleonConfig.from_hf(hf)
    with torch.device("meta"):  # no 7B fp32 allocation: parameters are created empty in ``dtype``
        model = ChameleonLM(cfg).to(dtype)
    model = model.to_empty(device=device)
    model.load_pretrained(folder)
    return model.eval().requires_grad_(False), hf


__all__ = [
    "CHAMELEON_7B", "ChameleonConfig", "ChameleonLM", "HF_SOURCE", "IGNORED_PREFIXES", "apply_rope",
    "checkpoint_files", "load_chameleon", "read_hf_config", "rope_1d", "tiny",
]
