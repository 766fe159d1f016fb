"""Harmon (Wu et al. 2025, github.com/wusize/Harmon at 4eb6087, ``src/models/harmon.py``,
``src/models/mar/mar.py``) in one file: a text-to-image MAR whose text conditioning goes through a
causal Qwen2.5 LLM sitting between the MAR encoder and the MAR decoder. It generates the KL-16 latent
grid (16 channels per token) of a 256 px (16x16) or 512 px (32x32, upstream's default) image.
Research note: docs/design/harmon_upstream.md (cited as "note 1.2" etc.).

Network (``conditions``; upstream ``Harmon.forward_mae_encoder`` + ``MAR.forward_mae_decoder``, note 1.2):
1. MAR encoder (coolsd.models.mar's blocks and parameters, LTH14 key names): ``z_proj`` of the known
   tokens, the ``buffer_size`` leading slots all ``fake_latent`` for BOTH CFG branches (harmon.py:130),
   position embedding (bilinearly resized at a grid other than the base 16x16, below), ``z_proj_ln``,
   encoder blocks, ``encoder_norm`` -> x_enc.
2. LLM (transformers' ``Qwen2Model``, sdpa): ``proj_in(x_enc)`` with the buffers MOVED TO THE END, after
   the prompt embeddings: [prompt | image tokens | buffers] (harmon.py:133-151); causal; the last
   hidden states of the image part, buffers moved back to the front, are added through ``proj_out``
   (residual, harmon.py:151-159).
3. MAR decoder: ``decoder_embed``, ``mask_token`` at unknown positions, decoder position embedding,
   decoder blocks (bidirectional, every position), ``decoder_norm``, buffers dropped,
   ``diffusion_pos_embed_learned`` -> z (B, L, decoder_dim).
The DiffLoss head (``head``) is MAR's ``SimpleMLPAdaLN`` unchanged (note 0).

Known tokens by key masking, not by dropping (note 3.3). Upstream drops the unknown tokens (MAE,
mar.py:251) so that the LLM sees the compacted sequence [prompt (p valid) | known tokens in raster
order | buffers] with RoPE positions 0 .. p-1, p .. p+n-1, p+n .. and a causal mask. Here every row
keeps all L positions and the LLM gets, per row,
* ``position_ids``: cumsum(valid) - 1 over [prompt | L image slots | buffers], where valid = the
  prompt's non-pad ids, the known positions and the buffers: a known token j sits at
  p + (number of known tokens before j in raster order), the buffers at p + n + i: exactly the
  compacted positions;
* a 4-D boolean mask: query q sees key k iff k is valid and k <= q (causal over the concatenation,
  i.e. over the compacted order), plus itself (so that an unknown or pad query, whose output is
  never read, attends to something).
Valid queries then compute what the compacted sequence computes; outputs at unknown positions are
replaced by the mask token in the decoder. So rows with different known sets (and prompts of different
lengths) batch together; ``tests/models/test_harmon.py`` checks this equals upstream's dropped form.

Prompts (``encode_prompts``; note 1.3): ``"Generate an image: {prompt}"`` in the Qwen chat template
``HARMON_TEMPLATE``, ids right-padded with ``NULL_LABEL`` (-1). A row that is all -1 is the
unconditional branch of CFG, which in Harmon is NOT an empty prompt but the templated
``"Generate an image."`` (scripts/text2image.py:14): ``conditions`` substitutes ``model.null_prompt``,
which whoever builds the model sets from the tokenizer (``set_null_prompt``).

Resolution (note 1.2 item 4): the checkpoints hold 16x16 (+ buffer) position embeddings; at another
grid the IMAGE part of the encoder, decoder and diffusion position embeddings is resized with
``F.interpolate(mode="bilinear", align_corners=False)``; the buffer part is not (mar.py:111-144).
``HarmonConfig.grid`` is the run's grid, ``seq_len`` its number of tokens.

Where ours differs from upstream, and why:
* key masking instead of dropping (above): same numbers, ragged known sets in one batch;
* the prompt is recomputed through the LLM with the image part in every ``conditions`` call (one
  forward over [prompt | image | buffers]) instead of upstream's prefill into a ``DynamicCache`` that
  is cropped back after each step (harmon.py:219-237): the same attention, simpler; a per-sample
  prompt KV cache is an optimisation for later;
* inside ``batch_invariant()`` the LLM runs row by row, each row without the other prompts' pads
  (``_llm``), so that a sample's numbers do not depend on its batch;
* upstream runs in bf16 with flash attention; here any dtype with sdpa (tests: fp32 / fp64; Qwen's
  RMSNorm and RoPE compute in fp32 inside transformers);
* the sampling loop is not here: the continuous loop (``coolsd.engine.continuous.generate``) runs
  upstream's MaskGIT-cosine steps (``HeadConfig.num_iter``, 64 in conf/target/harmon_1_5b.yaml) or one
  token a step; the tests replay upstream's ``Harmon.sample`` with its recorded draws.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from coolsd.engine import batch_invariant
from coolsd.engine.model_protocol import NULL_LABEL
from coolsd.models.mar import MAR, MAR_CONFIGS, MARConfig, SimpleMLPAdaLN
from coolsd.util.loading import BadInputFile, check_state_dict, read_torch_checkpoint

# Qwen chat template without a system prompt (configs/models/qwen2_5_*_kl16_mar_*.py:12-18), the
# conditional prompt (scripts/text2image.py:29) and the CFG null prompt (text2image.py:14).
HARMON_TEMPLATE = "<|im_start|>user\n{input}<|im_end|>\n<|im_start|>assistant\n"
PROMPT_FORMAT = "Generate an image: {prompt}"
NULL_PROMPT = "Generate an image."
VAE_SCALE = 0.2325  # tokens = KL-16 latents * 0.2325 (configs: vae_scale; harmon.py:76-91)
VAE_STRIDE = 16  # pixels per token side (KL-16, patch 1)


@dataclass(frozen=True)
class QwenConfig:
    """The Qwen2.5 decoder's architecture (the values of Qwen/Qwen2.5-*-Instruct's config.json)."""

    hidden_size: int = 896
    intermediate_size: int = 4864
    num_layers: int = 24
    num_heads: int = 14
    num_kv_heads: int = 2
    vocab_size: int = 151936
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768

    def to_hf(self):
        """transformers' ``Qwen2Config`` (q/k/v bias and no o_proj bias are Qwen2's fixed layout)."""
        from transformers import Qwen2Config

        return Qwen2Config(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
                           num_key_value_heads=self.num_kv_heads, vocab_size=self.vocab_size,
                           rope_theta=self.rope_theta, rms_norm_eps=self.rms_norm_eps,
                           max_position_embeddings=self.max_position_embeddings, tie_word_embeddings=True,
                           use_sliding_window=False, use_cache=False, attn_implementation="sdpa")


@dataclass(frozen=True)
class HarmonConfig:
    llm: QwenConfig = field(default_factory=QwenConfig)
    mar: MARConfig = MAR_CONFIGS["mar_base"]  # mar.seq_len: the BASE grid of the position embeddings (16x16)
    grid: int = 32  # tokens per side of the RUN: 32 = 512 px (upstream's default), 16 = 256 px

    def __post_init__(self):
        if self.grid < 1:
            raise ValueError(f"HarmonConfig: grid {self.grid} must be positive")
        if self.mar.side ** 2 != self.mar.seq_len:
            raise ValueError(f"HarmonConfig: mar.seq_len {self.mar.seq_len} is not a square grid")

    @property
    def seq_len(self) -> int:  # the run's L (the continuous loop's token count)
        return self.grid * self.grid

    @property
    def token_dim(self) -> int:
        return self.mar.token_dim

    @property
    def base_grid(self) -> int:
        return self.mar.side

    @property
    def image_size(self) -> int:
        return self.grid * VAE_STRIDE


QWEN_0_5B = QwenConfig(hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2)
QWEN_1_5B = QwenConfig(hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2)
# The released models (note 1.1): Qwen2.5-0.5B-Instruct + mar_base, Qwen2.5-1.5B-Instruct + mar_huge
# (buffer 64, 1000 classes, base grid 16x16); dataclasses.replace(cfg, grid=16) runs at 256 px.
HARMON_CONFIGS = {
    "harmon_0_5b": HarmonConfig(QWEN_0_5B, MAR_CONFIGS["mar_base"], grid=32),
    "harmon_1_5b": HarmonConfig(QWEN_1_5B, MAR_CONFIGS["mar_huge"], grid=32),
}


def grid_pos_embed(table: torch.Tensor, n_buffer: int, base: int, grid: int) -> torch.Tensor:
    """(1, n_buffer + base^2, D) learned table -> (1, n_buffer + grid^2, D): the image part resized
    bilinearly (align_corners=False), the buffer part kept (upstream ``get_*_pos_embed``, mar.py:111-144)."""
    if grid == base:
        return table
    buf, img = table.split([n_buffer, base * base], dim=1)
    img = img.reshape(1, base, base, -1).permute(0, 3, 1, 2)  # b (h w) c -> b c h w
    img = F.interpolate(img, size=(grid, grid), mode="bilinear")
    return torch.cat([buf, img.permute(0, 2, 3, 1).reshape(1, grid * grid, -1)], dim=1)


def build_mlp(d_in: int, hidden: int, d_out: int) -> nn.Sequential:
    """upstream ``build_mlp`` (harmon.py:12-16): Linear(d_in, hidden), SiLU, Linear(hidden, d_out)."""
    return nn.Sequential(nn.Linear(d_in, hidden), nn.SiLU(), nn.Linear(hidden, d_out))


class Harmon(nn.Module):
    """State-dict keys are upstream's (note 1.5): ``llm.model.*`` (a Qwen2Model), ``mar.*`` (LTH14 MAR),
    ``proj_in.{0,2}.*``, ``proj_out.{0,2}.*``. ``null_prompt`` is a non-persistent buffer."""

    def __init__(self, cfg: HarmonConfig):
        super().__init__()
        from transformers import Qwen2Model

        self.config = cfg
        H, E = cfg.llm.hidden_size, cfg.mar.encoder_dim
        self.llm = nn.ModuleDict({"model": Qwen2Model(cfg.llm.to_hf())})  # keys llm.model.* (lm_head unused)
        self.mar = MAR(cfg.mar)
        self.proj_in = build_mlp(E, H, H)  # harmon.py:48-50
        self.proj_out = build_mlp(H, H, E)  # harmon.py:51-53
        self.register_buffer("null_prompt", torch.zeros(0, dtype=torch.long), persistent=False)

    @property
    def qwen(self):
        return self.llm["model"]

    @property
    def head(self) -> SimpleMLPAdaLN:
        """MAR's DiffLoss network: ``head(x (N, C), t, z (N, D)) -> (eps, v)``, t the original timestep."""
        return self.mar.head

    def set_grid(self, grid: int) -> Harmon:
        """Run at ``grid`` x ``grid`` tokens from now on (the same weights: the position embeddings are
        resized on the fly, note 1.2 item 4)."""
        import dataclasses

        self.config = dataclasses.replace(self.config, grid=grid)
        return self

    def set_null_prompt(self, ids) -> None:
        """The templated ids of ``NULL_PROMPT`` (``null_prompt_ids(tokenizer)``), used for all -1 rows."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        if ids.numel() == 0 or bool((ids < 0).any()):
            raise ValueError("Harmon.set_null_prompt: needs a non-empty list of token ids >= 0")
        self.null_prompt = ids.to(self.null_prompt.device)

    # ------------------------------------------------------------------ conditions
    def prompt_ids(self, prompts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) ids padded with -1 -> (ids (B, T'), valid (B, T') bool), all -1 rows replaced by
        ``null_prompt`` (T' = max(T, its length)); pad ids are 0 and invalid. No host sync unless
        ``null_prompt`` is unset."""
        n0 = self.null_prompt.numel()
        null = (prompts < 0).all(dim=1)
        if n0 == 0 and bool(null.any()):
            raise ValueError("Harmon: a prompt row is all -1 (the unconditional branch) but model.null_prompt is not "
                             "set; call set_null_prompt(model, tokenizer) with the Qwen tokenizer")
        T = max(prompts.shape[1], n0)
        p = F.pad(prompts.long(), (0, T - prompts.shape[1]), value=NULL_LABEL)
        if n0:
            p = torch.where(null[:, None], F.pad(self.null_prompt, (0, T - n0), value=NULL_LABEL)[None], p)
        valid = p >= 0
        return p.clamp(min=0), valid

    def conditions(self, tokens: torch.Tensor, known: torch.Tensor, prompts: torch.Tensor) -> torch.Tensor:
        """tokens (B, L, C), known (B, L) bool, prompts (B, T) long ids right-padded with -1 (an all -1
        row: the CFG null prompt) -> z (B, L, decoder_dim). z[b] depends on the known tokens of row b
        and its prompt only. Recomputes the prompt through the LLM on every call (no KV cache)."""
        cfg, mar = self.config, self.mar
        B, L, _ = tokens.shape
        if L != cfg.seq_len:
            raise ValueError(f"Harmon.conditions: {L} tokens per row, the config's grid {cfg.grid} has {cfg.seq_len}")
        nb, base, g = cfg.mar.buffer_size, cfg.base_grid, cfg.grid
        known = known.bool()
        ids, valid = self.prompt_ids(prompts.to(tokens.device))
        T = ids.shape[1]

        # 1. MAR encoder (mar.py:222-264), unknown tokens excluded as keys instead of dropped
        x = mar.z_proj(torch.where(known.unsqueeze(-1), tokens, torch.zeros_like(tokens)))
        x = torch.cat([mar.fake_latent.to(x.dtype).expand(B, nb, -1), x], 1)  # buffers: fake_latent (harmon.py:130)
        x = mar.z_proj_ln(x + grid_pos_embed(mar.encoder_pos_embed_learned, nb, base, g))
        key_ok = torch.cat([known.new_ones(B, nb), known], 1)
        for blk in mar.encoder_blocks:
            x = blk(x, key_ok)
        x_enc = mar.encoder_norm(x)  # (B, nb + L, E)

        # 2. LLM over [prompt | image slots in raster order | buffers] (harmon.py:133-159, note 3.3)
        h = self.proj_in(x_enc)
        embeds = torch.cat([self.qwen.embed_tokens(ids).to(h.dtype), h[:, nb:], h[:, :nb]], 1)
        ok = torch.cat([valid, known, known.new_ones(B, nb)], 1)  # (B, S): the keys upstream keeps
        out = self._llm(embeds, ok, T)
        z_llm = torch.cat([out[:, T + L:], out[:, T:T + L]], 1)  # buffers back to the front
        x_enc = x_enc + self.proj_out(z_llm)  # residual (harmon.py:159)

        # 3. MAR decoder (mar.py:266-309): every position, mask token where unknown
        x = mar.decoder_embed(x_enc)
        x = torch.where(key_ok.unsqueeze(-1), x, mar.mask_token.to(x.dtype))
        x = x + grid_pos_embed(mar.decoder_pos_embed_learned, nb, base, g)
        for blk in mar.decoder_blocks:
            x = blk(x)
        return mar.decoder_norm(x)[:, nb:] + grid_pos_embed(mar.diffusion_pos_embed_learned, 0, base, g)

    def _llm(self, embeds: torch.Tensor, ok: torch.Tensor, T: int) -> torch.Tensor:
        """Last hidden states (B, S, H) of the LLM over ``embeds`` (B, S, H) = [prompt (T) | image | buffers]
        whose valid keys are ``ok`` (B, S). Inside ``batch_invariant()`` each row runs alone over its own
        prompt ids and the image part, without the pads that the batch's longest prompt adds (a softmax
        over more keys rounds differently even where the extra weights are 0): a row's numbers do not
        depend on the other prompts of its batch. Outputs at dropped pads are 0 (never read)."""
        if not batch_invariant.active():
            return self._llm_pass(embeds, ok)
        out = embeds.new_zeros(embeds.shape[:2] + (self.qwen.config.hidden_size,))
        tail = torch.arange(T, embeds.shape[1], device=embeds.device)
        for b in range(embeds.shape[0]):
            keep = torch.cat([ok[b, :T].nonzero().squeeze(1), tail])
            out[b, keep] = self._llm_pass(embeds[b:b + 1, keep], ok[b:b + 1, keep])[0]
        return out

    def _llm_pass(self, embeds: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        """One LLM forward: compacted RoPE positions and the causal mask over the valid keys (module docstring)."""
        position_ids = (ok.long().cumsum(1) - 1).clamp(min=0)  # compacted RoPE positions
        S = ok.shape[1]
        ar = torch.arange(S, device=ok.device)
        causal = ar[None, :] <= ar[:, None]  # (S, S): key <= query
        mask = (ok[:, None, :] & causal) | (ar[None, :] == ar[:, None])  # + itself: every query sees something
        return self.qwen(inputs_embeds=embeds, attention_mask=mask[:, None], position_ids=position_ids,
                         use_cache=False).last_hidden_state


# ---------------------------------------------------------------------------------- prompts
def _encode(tokenizer, text: str) -> list[int]:
    """ids of ``text`` by an HF tokenizer (``encode`` -> list, add_special_tokens=True as harmon.py:175;
    Qwen adds no BOS) or a ``tokenizers.Tokenizer`` (``encode`` -> Encoding)."""
    out = tokenizer.encode(text)
    return list(out.ids) if hasattr(out, "ids") else [int(i) for i in out]


def encode_prompts(tokenizer, prompts: list[str], template: str = HARMON_TEMPLATE,
                   prompt_format: str = PROMPT_FORMAT) -> torch.Tensor:
    """(B, T) long: the ids of ``template.format(input=prompt_format.format(prompt=p))`` per prompt,
    right-padded with ``NULL_LABEL`` (-1) (upstream pads with eos under a boolean mask, harmon.py:177-185)."""
    ids = [_encode(tokenizer, template.format(input=prompt_format.format(prompt=p))) for p in prompts]
    out = torch.full((len(ids), max((len(i) for i in ids), default=0)), NULL_LABEL, dtype=torch.long)
    for b, row in enumerate(ids):
        out[b, :len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def null_prompt_ids(tokenizer, template: str = HARMON_TEMPLATE, null_prompt: str = NULL_PROMPT) -> torch.Tensor:
    """(T0,) long: the templated ids of the CFG null prompt "Generate an image." (text2image.py:14)."""
    return torch.tensor(_encode(tokenizer, template.format(input=null_prompt)), dtype=torch.long)


def set_null_prompt(model: Harmon, tokenizer, template: str = HARMON_TEMPLATE) -> Harmon:
    model.set_null_prompt(null_prompt_ids(tokenizer, template))
    return model


# ---------------------------------------------------------------------------------- loading
HARMON_SOURCE = ("Harmon's harmon_0.5b.pth / harmon_1.5b.pth (Hugging Face wusize/harmon) or the model.safetensors "
                 "of wusize/Harmon-0_5B / wusize/Harmon-1_5B (github.com/wusize/Harmon README, Checkpoints)")
# In the files but unused by generation: the tied LM head and MAR's class embedding (note 1.5); the
# VAE's weights (``vae.*``, the HF safetensors) are KL-16's, loaded separately (coolsd.models.kl16_vae).
OPTIONAL_KEYS = ("llm.lm_head.weight", "mar.class_emb.weight")
IGNORED_PREFIXES = ("vae.",)


def load_harmon(path, name="harmon_0_5b", dtype=torch.float32, device="cpu", grid: int | None = None,
                tokenizer=None) -> Harmon:
    """Strict, safe loading of a Harmon checkpoint: ``.safetensors``, or a flat ``.pth`` state dict
    via ``torch.load(weights_only=True)`` (upstream loads it flat, scripts/text2image.py:27-28).
    ``name``: a key of ``HARMON_CONFIGS`` or a ``HarmonConfig``; ``grid`` overrides the run's grid.
    Every ``llm.model.*``, ``mar.*``, ``proj_in.*``, ``proj_out.*`` key and shape must match (one error
    naming the file and the keys otherwise); ``llm.lm_head.weight`` (tied) and ``mar.class_emb.weight``
    may be there (shape-checked, unused: the lm head is dropped, class_emb kept as zeros if absent);
    ``vae.*`` is ignored. ``tokenizer`` sets ``null_prompt`` (``set_null_prompt``)."""
    import dataclasses

    cfg = HARMON_CONFIGS[name] if isinstance(name, str) else name
    if grid is not None:
        cfg = dataclasses.replace(cfg, grid=grid)
    state = dict(read_torch_checkpoint(path, "Harmon checkpoint", HARMON_SOURCE, keys=("state_dict", "model")))
    state = {k: v for k, v in state.items() if not k.startswith(IGNORED_PREFIXES)}
    with torch.device("meta"):
        model = Harmon(cfg)
    own = model.state_dict()
    lm_head = state.pop("llm.lm_head.weight", None)
    check = dict(state)
    if "mar.class_emb.weight" not in check:  # optional: stands in with its expected shape for the check
        check["mar.class_emb.weight"] = torch.empty(own["mar.class_emb.weight"].shape, device="meta")
    check_state_dict(model, check, os.fspath(path), HARMON_SOURCE)
    want = tuple(own["llm.model.embed_tokens.weight"].shape)  # the tied head: the embedding's shape
    if lm_head is not None and tuple(lm_head.shape) != want:
        raise BadInputFile(f"{os.fspath(path)} does not fit Harmon (wrong shapes: llm.lm_head.weight "
                           f"{tuple(lm_head.shape)} (expected {want})); expected the file from {HARMON_SOURCE}")
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        model.mar.class_emb.weight.zero_()
    res = model.load_state_dict(state, strict=False)  # complete by the check above, but class_emb may be absent
    assert not res.unexpected_keys and set(res.missing_keys) <= {"mar.class_emb.weight"}, res
    _reset_rotary(model)
    if tokenizer is not None:
        set_null_prompt(model, tokenizer)
    else:
        model.null_prompt = torch.zeros(0, dtype=torch.long)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def _reset_rotary(model: Harmon) -> None:
    """RoPE's ``inv_freq`` is a non-persistent buffer (not in any file): rebuilt after a meta-device
    construction, whose ``to_empty`` leaves it uninitialised."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    model.qwen.rotary_emb = Qwen2RotaryEmbedding(config=model.qwen.config)


__all__ = ["HARMON_CONFIGS", "HARMON_TEMPLATE", "NULL_LABEL", "NULL_PROMPT", "PROMPT_FORMAT", "QWEN_0_5B", "QWEN_1_5B",
           "VAE_SCALE", "Harmon", "HarmonConfig", "QwenConfig", "build_mlp", "encode_prompts", "grid_pos_embed",
           "load_harmon", "null_prompt_ids", "set_null_prompt"]
