"""Janus-Pro text-to-image (DeepSeek, github.com/deepseek-ai/Janus; 1B and 7B, 384 px, 24 x 24 = 576
image tokens) as an ``ImageTarget`` in IMAGE-CODE space, over transformers' own
``JanusForConditionalGeneration`` (``transformers/models/janus/modeling_janus.py``; no model code here).

What the generation loop sees: tokens 0..V-1 are VQ code indices (V = ``vq_config.num_embeddings``,
16,384), logits (B, m, V) from Janus's image-generation head (``model.generation_head``: proj_out,
GELU, vision_head), ``n_image_tokens = h_latent * w_latent`` (``vq_config.num_patches`` squared),
positions = image-token indices j (token j's output predicts token j + 1). An image token enters the
LLM as ``prepare_embeddings_for_image_generation`` (``generation_embeddings`` then
``generation_aligner``), as in transformers' image ``generate`` and upstream's ``prepare_gen_img_embeds``.

* Sequence (upstream ``generation_inference.py``; transformers' ``JanusProcessor`` with
  ``generation_mode="image"``): the prompt ids end with ``<begin_of_image>`` (``prompt_ids``:
  BOS + ``"<|User|>: {caption}\\n\\n<|Assistant|>:<begin_of_image>"``), then the image tokens with no
  structural token between them. Logical position of image token j: prompt length + j (1D RoPE).
* CFG (transformers ``JanusForConditionalGeneration.generate`` with ``generation_mode="image"``,
  steps 4 and 7; upstream interleaves the halves and sets ``tokens[i, 1:-1] = pad_id`` in the odd
  rows): the batch is doubled, [cond; uncond]; the unconditional prompt is the prompt with every id
  that is neither BOS nor ``<begin_of_image>`` replaced by the pad id (same length, every slot
  attended, same positions), and both halves see the same image tokens. Logits are combined raw,
  ``uncond + s * (cond - uncond)`` (``cfg_combine``; transformers'
  ``ClassifierFreeGuidanceLogitsProcessor``, upstream's ``cfg_weight``); ``cfg_scale == 1`` runs no
  unconditional half (transformers adds no CFG processor then either).
* Batches of prompts of different lengths: every prompt keeps its own positions from 0 (what one
  prompt alone gets upstream and in transformers). transformers' batched image ``generate`` left-pads
  and counts the pads in the positions (it derives no position ids from the attention mask), so its
  batched output differs from its per-prompt output; here a batch equals its prompts run alone.

Cache (``coolsd.engine.model_protocol``): the committed / pending layout and the tree masks are
``coolsd.models.kv_cache.KVCache``'s, with per-sample committed lengths (prompts of different
lengths, different accepted lengths per round), and ``commit`` moves kept pending entries with
gathers and scatters, reading nothing on the host (docs/gpu.md, "Sync budget"). transformers runs
every layer unchanged: the language model (``model.model.language_model``, a ``LlamaModel`` with
``attn_implementation="sdpa"``) is called through its public forward with ``inputs_embeds``,
explicit ``position_ids`` (logical positions), a 4-D ``attention_mask`` (passed through as is by
``create_causal_mask``; boolean for SDPA, additive for eager attention; flash attention cannot take
a tree mask and is refused) and, as ``cache``, a ``TreeCache``: the one override. A
``DynamicCache`` holds one length for the whole batch and only appends or crops at its end, so it
can keep neither per-sample committed lengths nor a kept path from between rejected siblings;
``TreeCache`` is a ``transformers.Cache`` subclass, built per forward, whose ``update`` writes the
new keys / values into the ``KVCache``'s pending slots and returns its buffers up to the step's
span, so the 4-D mask (``KVCache.prepare``) decides what each query sees. ``run_tree_masked`` is
that call, for any transformers decoder: ``coolsd.models.emu3`` runs Emu3's text model through it.

Numerics: the model runs in its dtype (bf16 upstream); the head's logits are cast to at least fp32
before CFG (transformers and upstream combine them in the model dtype: the one deliberate
difference, as in ``coolsd.models.lumina``). Pixels: ``decode_raw`` is the VQ decoder's output
(``vqmodel.decode``, about [-1, 1]); ``decode`` maps it to [0, 1] with upstream's ``(x + 1) / 2`` and
a clamp; ``pixels_uint8`` is upstream's ``np.clip((x + 1) / 2 * 255, 0, 255)`` cast to uint8
(truncation, as transformers' ``JanusImageProcessor.postprocess``).

CFG scale and sampling (Janus-Pro's protocol: cfg 5, temperature 1, no top-k / top-p) are
configuration, not defaults of this class. Not here: the compiled path (``compile=true``: the
``KVCache``'s static mode), and loading without the SigLIP understanding tower, which
``JanusForConditionalGeneration`` always builds and generation never uses.
"""
from __future__ import annotations

import functools
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from coolsd.engine import batch_invariant
from coolsd.engine.batch_invariant import commit_each, forward_each
from coolsd.engine.host_reads import host_checks
from coolsd.engine.model_protocol import StepOut, id_list
from coolsd.models.guided import GuidedCacheModel, right_padded
from coolsd.models.kv_cache import CacheStep, KVCache
from coolsd.util.loading import BadInputFile, MissingInputFile, reading

JANUS_SOURCE = ("the transformers-format Janus-Pro folder (huggingface.co/deepseek-community/Janus-Pro-1B or "
                "-7B: config.json, model*.safetensors, tokenizer.json)")
PROMPT_TEMPLATE = "<|User|>: {caption}\n\n<|Assistant|>:"


# ---------------------------------------------------------------------------------------- prompts
@dataclass(frozen=True)
class JanusTokens:
    """The ids CFG and the prompt need, resolved by name from the tokenizer as upstream's
    ``VLChatProcessor`` does (``pad_tag``, ``image_start_tag``; BOS is the tokenizer's)."""

    bos: int
    pad: int
    boi: int

    NAMES = {"bos": "<｜begin▁of▁sentence｜>", "pad": "<｜▁pad▁｜>", "boi": "<begin_of_image>"}

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "JanusTokens":
        """From a ``tokenizers.Tokenizer`` (Janus's ``tokenizer.json``); a missing name is one error."""
        ids = {field: tokenizer.token_to_id(name) for field, name in cls.NAMES.items()}
        missing = [cls.NAMES[f] for f, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"the tokenizer lacks Janus's tokens {missing}")
        return cls(**ids)


def prompt_text(caption: str) -> str:
    """Janus's text-to-image prompt: the "deepseek" SFT template with an empty system prompt and the
    caption stripped (upstream ``apply_sft_template_for_multi_turn_prompts``; transformers' chat
    template with ``add_generation_prompt=True``), then ``<begin_of_image>`` (upstream
    ``image_start_tag``; ``JanusProcessor(generation_mode="image")``)."""
    return PROMPT_TEMPLATE.format(caption=caption.strip()) + JanusTokens.NAMES["boi"]


def prompt_ids(encode: Callable[[str], Sequence[int]], caption: str, bos_id: int) -> list[int]:
    """``[bos_id] + encode(prompt_text(caption))`` (the tokenizer adds BOS upstream; ``encode`` must
    tokenize without special tokens and map ``<begin_of_image>`` to its id)."""
    return [int(bos_id)] + [int(t) for t in encode(prompt_text(caption))]


def pixels_uint8(raw: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) VQ decoder output -> (B, H, W, 3) uint8 exactly as upstream:
    ``np.clip((x + 1) / 2 * 255, 0, 255)`` in float32, then truncated by the uint8 cast."""
    x = ((raw.float() + 1) / 2 * 255).clamp(0, 255)
    return x.floor().to(torch.uint8).permute(0, 2, 3, 1)


# ---------------------------------------------------------------------------------------- cache
@functools.lru_cache(maxsize=1)
def _tree_cache_class():
    """``TreeCache``, defined on first use: transformers is imported only when a model is (the worlds
    are imported by every command line, which must refuse a bad config in about a second)."""
    from transformers import Cache

    class TreeCache(Cache):
        """``transformers.Cache`` of ONE forward over a ``KVCache`` (module docstring): ``update(k, v,
        layer)`` writes the new entries where ``step`` (this forward's ``KVCache.prepare``) says and
        returns the layer's buffers over slots [0, ``span``), which the forward's 4-D mask covers.
        Anything that would size a mask or positions from the cache is refused: it is only ever used
        with a 4-D mask and explicit positions (``run_tree_masked``)."""

        def __init__(self, kv: KVCache, step: CacheStep, span: int):
            super().__init__(layers=[])
            self.kv, self.step, self.span = kv, step, span

        def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
            step = self.step
            k_buf, v_buf = self.kv.k[layer_idx], self.kv.v[layer_idx]
            if step.start is not None:  # every sample writes slots [start, start + m)
                m = key_states.shape[2]
                k_buf[:, :, step.start : step.start + m] = key_states
                v_buf[:, :, step.start : step.start + m] = value_states
            else:
                idx = step.slots[:, None, :, None].expand_as(key_states)
                k_buf.scatter_(2, idx, key_states)
                v_buf.scatter_(2, idx, value_states)
            return k_buf[:, :, : self.span], v_buf[:, :, : self.span]

        def get_seq_length(self, layer_idx: int = 0) -> int:
            raise RuntimeError("TreeCache has per-sample lengths: pass position_ids explicitly")

        def get_mask_sizes(self, *args, **kwargs):
            raise RuntimeError("TreeCache needs a 4-D attention mask (KVCache.prepare)")

    return TreeCache


def tree_cache(kv: KVCache, step: CacheStep, span: int):
    """The ``TreeCache`` (a ``transformers.Cache``) through which one forward (``step``) writes ``kv``
    and reads its slots [0, span)."""
    return _tree_cache_class()(kv, step, span)


def run_tree_masked(lm, kv: KVCache, attend: torch.Tensor, positions: torch.Tensor,
                    valid: Optional[torch.Tensor] = None, by_position: Optional[torch.Tensor] = None,
                    **inputs) -> torch.Tensor:
    """A transformers decoder (``lm``: ``LlamaModel``, ``Emu3TextModel``, any model that takes a 4-D
    ``attention_mask``, explicit ``position_ids`` and a ``Cache``) over ``inputs`` (``input_ids=`` or
    ``inputs_embeds=``, n x m) at logical ``positions`` (n, m), appended to ``kv`` as m pending entries
    that see the committed ones and the pending ones ``attend`` allows (``KVCache.prepare``; ``valid``:
    the real rows per sample of a padded prefill; ``by_position`` (n, m): the entries' positions for the
    cache's visibility by position, row-parallel decoding). Attention runs over slots [0, span): the step's span,
    or under ``coolsd.engine.batch_invariant`` the longest row's exact one. The mask is boolean for
    SDPA, additive (0 / the dtype's min) for eager attention, which adds it. Returns the last hidden
    state (n, m, H). The model's layers, RoPE, norms and MLPs run unchanged."""
    m = positions.shape[1]
    step = kv.prepare(attend, m, valid=valid, positions=by_position)
    span = max(step.spans) if step.spans is not None else step.span  # batch_invariant: the exact span
    mask = step.mask[..., :span]
    if lm.config._attn_implementation == "eager":  # eager attention adds the mask
        mask = torch.zeros(mask.shape, dtype=lm.dtype, device=mask.device).masked_fill(~mask, torch.finfo(lm.dtype).min)
    out = lm(attention_mask=mask, position_ids=positions, use_cache=True,
             **{_cache_keyword(type(lm)): tree_cache(kv, step, span)}, **inputs)
    kv.advance(m)
    return out.last_hidden_state


@functools.lru_cache(maxsize=None)
def _cache_keyword(cls) -> str:
    """The language model's keyword for a cache object: ``cache`` in transformers 5.x (where
    ``past_key_values`` is deprecated), ``past_key_values`` before (pyproject allows >= 4.57)."""
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


# ---------------------------------------------------------------------------------------- target
class JanusTarget(GuidedCacheModel):
    """``ImageTarget`` over a transformers ``JanusForConditionalGeneration`` (module docstring).

    ``cond`` for ``begin``: B prompt-id sequences (lists or 1-D tensors, any lengths, each ending
    with ``<begin_of_image>``), e.g. from ``prompt_ids``. Returned logits are CFG-combined over the
    image codes; hidden states (the language model's last hidden state) are (B, m, H), or (B, m, 2, H)
    = [cond, uncond] when guided. Under ``coolsd.engine.batch_invariant`` with B > 1 every sample runs
    in its own batch-1 target over the same model.
    """

    row_parallel = True  # forward(..., by_position=True): row-parallel decoders run on it (coolsd.engine.rows)

    def __init__(self, model, *, cfg_scale: float, tokens: JanusTokens, cache_headroom: int = 128):
        cfg = model.config
        side = int(cfg.vq_config.num_patches)
        n = side * side
        if int(cfg.vision_config.num_image_tokens) != n:
            raise ValueError(f"Janus config: vision_config.num_image_tokens {cfg.vision_config.num_image_tokens} "
                             f"is not vq_config.num_patches^2 = {n}")
        impl = cfg.text_config._attn_implementation
        if impl not in ("sdpa", "eager"):
            raise ValueError(f"JanusTarget passes 4-D tree masks: load the model with attn_implementation='sdpa' "
                             f"(got {impl!r})")
        V = int(cfg.text_config.vocab_size)
        if min(tokens.bos, tokens.pad, tokens.boi) < 0 or max(tokens.bos, tokens.pad, tokens.boi) >= V:
            raise ValueError(f"Janus token ids {tokens} exceed the text vocabulary ({V})")
        self.model = model.eval()
        self.lm = model.model.language_model
        self.tokens = tokens
        self.cfg_scale = float(cfg_scale)
        self.cache_headroom = int(cache_headroom)
        self.h_latent = self.w_latent = side
        self.n_image_tokens = n
        self.vocab_size = int(cfg.vq_config.num_embeddings)
        self.text_vocab = V
        t = cfg.text_config
        self._kv_shape = (int(t.num_hidden_layers), int(t.num_key_value_heads),
                          int(getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads))
        self._alone: Optional[list] = None  # under coolsd.engine.batch_invariant: one batch-1 target per sample

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def unconditional(self, ids: list[int]) -> list[int]:
        """transformers' unconditional prompt: every id that is neither BOS nor ``<begin_of_image>``
        replaced by the pad id (upstream: ``tokens[1:-1] = pad_id``, the same for BOS ... BOI)."""
        keep = (self.tokens.bos, self.tokens.boi)
        return [t if t in keep else self.tokens.pad for t in ids]

    def _new_cache(self, n: int, prefix_len: int) -> KVCache:
        # the sequence's known maximum: prompt, every image token and a round's pending entries
        layers, heads, head_dim = self._kv_shape
        committed = prefix_len + self.n_image_tokens
        return self._cache_for((layers, n, heads, head_dim, self.dtype, self.device), committed + self.cache_headroom,
                               64, committed)

    def _run(self, embeds: torch.Tensor, positions: torch.Tensor, attend: torch.Tensor,
             valid: Optional[torch.Tensor] = None, by_position: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The language model over ``embeds`` (n, m, H) at logical ``positions`` (n, m), appended as
        pending entries that see the committed ones and the pending ones ``attend`` allows."""
        return run_tree_masked(self.lm, self.cache, attend, positions, valid=valid, by_position=by_position,
                               inputs_embeds=embeds)

    def _out(self, hidden: torch.Tensor) -> StepOut:
        logits = self.model.model.generation_head(hidden)
        return self._guided_out(logits.to(torch.promote_types(logits.dtype, torch.float32)), hidden)

    # ------------------------------------------------------------------ protocol
    @torch.no_grad()
    def begin(self, cond: Any, batch_size: int, context: Optional[StepOut] = None) -> StepOut:
        dev = self.device
        if isinstance(cond, torch.Tensor) and cond.dim() == 2:
            cond = list(cond)
        if not isinstance(cond, Sequence) or len(cond) != batch_size:
            raise ValueError(f"cond must be {batch_size} prompt-id sequences, got {type(cond).__name__}")
        prompts = []
        for p in cond:
            ids = id_list(p)
            if not ids or min(ids) < 0 or max(ids) >= self.text_vocab:
                raise ValueError(f"prompt ids must be a non-empty sequence of ids in [0, {self.text_vocab})")
            if ids[-1] != self.tokens.boi:
                raise ValueError(f"a Janus prompt must end with <begin_of_image> (id {self.tokens.boi}): build it "
                                 f"with coolsd.models.janus.prompt_ids")
            prompts.append(ids)
        self.batch_size = batch_size
        self._alone = None
        if batch_invariant.active() and batch_size > 1:
            return self._begin_alone(prompts)
        rows = prompts + ([self.unconditional(p) for p in prompts] if self.guided else [])
        n = len(rows)
        ids, lens, L = right_padded(rows, dev)
        self._new_cache(n, L)
        causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
        embeds = self.model.get_input_embeddings()(ids)
        hidden = self._run(embeds, torch.arange(L, device=dev).expand(n, L), causal, valid=lens)
        self.cache.commit(torch.arange(L, device=dev).expand(n, L), lens)
        self._offset = lens  # logical position of image token 0, per internal row
        return self._out(hidden[torch.arange(n, device=dev), lens - 1].unsqueeze(1))

    def _begin_alone(self, prompts: list) -> StepOut:
        """``begin`` under ``coolsd.engine.batch_invariant`` for B > 1: every sample in its own batch-1
        target over the same model (a batch's prefill pads prompts and its attention spans are the
        longest sample's, so a sample's last bits would depend on the others)."""
        self.cache = None  # freed before the per-sample caches are allocated
        self._alone = [JanusTarget(self.model, cfg_scale=self.cfg_scale, tokens=self.tokens,
                                   cache_headroom=self.cache_headroom) for _ in prompts]
        outs = [t.begin([p], 1) for t, p in zip(self._alone, prompts)]
        self.cache = self._alone[0].cache  # begun (forward and commit go to the per-sample targets)
        return StepOut(logits=torch.cat([o.logits for o in outs]), hidden=torch.cat([o.hidden for o in outs]))

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        attend: torch.Tensor,
        features: Optional[torch.Tensor] = None,
        by_position: bool = False,
    ) -> StepOut:
        """tokens: (B, m) codes; positions: (B, m) or (1, m) image-token indices j; attend: (m, P+m)
        or (B, m, P+m) over the pending entries (existing first, then the new ones). ``by_position``:
        each new token sees only the committed image entries at earlier indices j (and the whole
        prompt; row-parallel decoding, ``coolsd.engine.rows``; ``KVCache``'s visibility by position)."""
        if self._alone is not None:
            return forward_each(self._alone, tokens, positions, attend, by_position=by_position)
        if self.cache is None:
            raise RuntimeError("call begin() first")
        dev, B = self.device, self.batch_size
        tokens = tokens.to(dev)
        j = positions.to(dev).expand(tokens.shape)
        m, P = tokens.shape[1], self.cache.n_pending
        attend = attend.to(dev, torch.bool)
        if attend.shape[-2:] != (m, P + m):
            raise ValueError(f"attend must be (.., {m}, {P + m}), got {tuple(attend.shape)}")
        if host_checks() and bool(((tokens < 0) | (tokens >= self.vocab_size)).any()):
            raise ValueError(f"tokens must be image codes in [0, {self.vocab_size})")
        if attend.dim() == 3:
            attend = self._double(attend.expand(B, m, P + m))
        embeds = self.model.prepare_embeddings_for_image_generation(self._double(tokens))
        pos = self._double(j) + self._offset.unsqueeze(1)
        return self._out(self._run(embeds, pos, attend, by_position=self._double(j) if by_position else None))

    @torch.no_grad()
    def commit(self, keep: Optional[torch.Tensor], n_keep: torch.Tensor) -> None:
        """keep: (B, K) pending indices or None (the first ``n_keep`` in order); n_keep: (B,). Both
        CFG halves keep the same entries. Reads nothing on the host (``KVCache.commit``)."""
        if self._alone is not None:
            return commit_each(self._alone, keep, n_keep)
        if self.cache is None:
            raise RuntimeError("call begin() first")
        dev = self.device
        n_keep = self._double(n_keep.to(dev, torch.long))
        self.cache.commit(None if keep is None else self._double(keep.to(dev, torch.long)), n_keep)

    # ------------------------------------------------------------------ pixels
    @torch.no_grad()
    def decode_raw(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, n_image_tokens) codes -> the VQ decoder's (B, 3, H, W) output (``vqmodel.decode``)."""
        return self.model.model.vqmodel.decode(tokens.to(self.device, torch.long))

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, n_image_tokens) -> images (B, 3, H, W) in [0, 1]: ``(x + 1) / 2``, clamped."""
        return ((self.decode_raw(tokens).float() + 1) / 2).clamp(0.0, 1.0)

    def codebook(self) -> torch.Tensor:
        """The (V, D) VQ codebook as looked up: L2-normalised rows (``get_codebook_entry``)."""
        w = self.model.model.vqmodel.quantize.embedding.weight
        return torch.nn.functional.normalize(w.detach().float(), p=2, dim=-1)


# ---------------------------------------------------------------------------------------- loading
def load_janus(folder: str | Path, *, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"):
    """``JanusForConditionalGeneration`` from a local transformers-format folder (config.json,
    ``model.safetensors`` or its shards + index), strictly: safetensors only, never the network, and
    any missing, unexpected or mis-shaped tensor is one error naming the folder."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise MissingInputFile(f"Janus-Pro folder {folder} has no config.json; get {JANUS_SOURCE}")
    from transformers import JanusForConditionalGeneration

    with reading(folder, "a transformers-format Janus-Pro checkpoint", JANUS_SOURCE):
        model, info = JanusForConditionalGeneration.from_pretrained(
            folder, dtype=dtype, local_files_only=True, use_safetensors=True, attn_implementation="sdpa",
            output_loading_info=True)
    bad = {k: sorted(v)[:6] for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys",
                                                                   "mismatched_keys", "error_msgs")}
    if bad:
        raise BadInputFile(f"{folder} does not fit JanusForConditionalGeneration ({bad}); expected {JANUS_SOURCE}")
    return model.to(device).eval()


def check_generation_config(folder: str | Path, tokens: JanusTokens) -> None:
    """Where the folder's ``generation_config.json`` names the pad / ``<begin_of_image>`` ids
    (transformers' converter writes them), they must be the tokenizer's: one error otherwise."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return
    with reading(path, "Janus's generation_config.json", JANUS_SOURCE):
        gen = json.loads(path.read_text())
    boi = gen.get("boi_token_id", (gen.get("generation_kwargs") or {}).get("boi_token_id"))
    for name, value, want in (("pad_token_id", gen.get("pad_token_id"), tokens.pad), ("boi_token_id", boi, tokens.boi)):
        if value is not None and int(value) != want:
            raise BadInputFile(f"{path}: {name} {value} is not the tokenizer's {want}; expected {JANUS_SOURCE}")


__all__ = ["JANUS_SOURCE", "JanusTarget", "JanusTokens", "PROMPT_TEMPLATE", "check_generation_config",
           "load_janus", "pixels_uint8", "prompt_ids", "prompt_text", "run_tree_masked", "tree_cache"]
