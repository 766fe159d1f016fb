"""Emu3-Gen text-to-image (BAAI's Emu3-Gen, 8B, 720 px; the transformers-format release
``BAAI/Emu3-Gen-hf``) as an ``ImageTarget`` in IMAGE-CODE space, over transformers' own
``Emu3ForConditionalGeneration``: no model code here, only the adapter.

What the generation loop sees: tokens 0..n_codes-1 are VQ code indices (32768 at full size),
logits (B, m, n_codes) over codes, ``n_image_tokens = h_latent * w_latent`` (90 x 90 at 720 px),
positions = image-token indices j (token j's output predicts token j + 1). Everything structural
is the adapter's business (docs/methods.md#3-lantern-and-lantern: structural tokens are never
drafted against):

* Sequence (transformers' ``Emu3Processor(..., return_for_image_generation=True)`` and
  ``modeling_emu3.Emu3ImageVocabularyMapping``; upstream ``emu3/mllm/processing_emu3.py`` mode
  "G"): the prompt ids ``tokenize(bos + caption + "<|image start|>" + f"{h}*{w}" +
  "<|image token|>")`` (``generation_prompt``; the world tokenizes), then h_latent rows of
  w_latent visual tokens, each row followed by the end-of-line ``<|extra_200|>``, then
  ``<|extra_201|>`` (end of frame), ``<|image end|>``, eos. The loop stops after the last image
  token, so neither the last row's end-of-line nor what follows is ever fed.
* The prefix-constrained logits processor of the model card (``prefix_allowed_tokens_fn``:
  visual tokens inside a row, the end-of-line where ``offset % (w + 1) == 0``) is exact here:
  the returned logits are the lm_head rows of the visual tokens in code order, and the
  end-of-lines are inserted, never sampled.
* Logical positions (1D RoPE, positions from 0 in each branch as ``Emu3TextModel`` numbers a
  batch-1 sequence): image token j sits at ``offset + j + j // w_latent``, its row's end-of-line
  (after a row end, ``(j + 1) % w_latent == 0``) at that + 1; ``offset`` = the prompt's length
  in the conditional half, the negative prompt's in the unconditional half.
* End-of-lines are inserted BY THE ADAPTER inside ``forward`` (``coolsd.models.row_ends``, which
  ``coolsd.models.lumina`` shares for Lumina-mGPT's newlines): for every new entry that is a row
  end (and not in the last row) an end-of-line entry is added in the same forward; it attends
  exactly what that token attends plus the token itself (and itself); later entries that see the
  token also see its end-of-line. The node's returned logits / hidden are the end-of-line entry's
  (they predict the next row's first token). ``commit`` keeps the end-of-line that follows each
  kept row-end token. Within one forward the set of end-of-line slots is shared by the batch
  (KV-cache pending counts are shared): a slot exists where ANY sample has a row end; in the
  other samples it is computed but never attended and never committed.
* CFG (transformers' ``UnbatchedClassifierFreeGuidanceLogitsProcessor``, which
  ``generate(negative_prompt_ids=..., guidance_scale=s)`` runs and upstream's example builds by
  hand): the unconditional branch is the NEGATIVE PROMPT (``Emu3Prompt.negative``, built by the
  world) followed by every generated token, end-of-lines included. Internally the batch is
  [cond; uncond] with different committed lengths and positions (per-sample ``KVCache``
  lengths). Upstream combines log-softmaxes over the whole vocabulary, ``s * (lsm_c - lsm_u) +
  lsm_u``; here the raw logits over codes, ``uncond + s * (cond - uncond)`` (``cfg_combine``):
  the two differ by a constant per position, so after the restriction to visual tokens (and any
  temperature / top-k / top-p) they are the same distribution and the same argmax.
  ``cfg_scale == 1`` runs no unconditional half (``generate`` adds no CFG processor then).
* Image vocabulary: code c is the id of ``<|visual token {c:06d}|>`` in ``config.vocabulary_map``
  (``Emu3ImageVocabularyMapping.img2bpe``; ``ImageCodes`` checks the codes are exactly
  0..codebook_size-1).

How transformers' model runs our tree-masked, committed / pending KV cache: ``Emu3TextModel``
takes a prepared 4D attention mask (``masking_utils`` returns a 4D mask as is), explicit
``position_ids`` and any ``transformers.cache_utils.Cache``. The smallest override is therefore
a ``Cache`` subclass whose ``update`` writes the new keys / values into a
``coolsd.models.kv_cache.KVCache`` (committed entries first, per-sample lengths, pending entries
in forward order) and hands back the buffers over the step's span, while the mask is the
``KVCache.prepare`` step's (committed slots visible, pending ones where ``attend`` says): Janus's
``TreeCache``, through ``coolsd.models.janus.run_tree_masked`` (one implementation for both
targets). Commit moves kept entries inside those buffers (``KVCache.commit``, no host read). The
model's own attention (SDPA, or eager with an additive mask; flash attention cannot take a tree
mask and is refused) and its RoPE, norms and MLPs run unchanged. Under
``coolsd.engine.batch_invariant`` with B > 1 every sample runs in its own batch-1 target (its
attention then never depends on the other samples' spans).

CFG scale and sampling (upstream's example: cfg 3.0, top-k 2048, temperature 1) are
configuration, not defaults of this class.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

from coolsd.engine import batch_invariant
from coolsd.engine.model_protocol import StepOut, id_list
from coolsd.models.guided import right_padded
from coolsd.models.janus import run_tree_masked
from coolsd.models.kv_cache import KVCache
from coolsd.models.row_ends import RowEndTarget
from coolsd.util.loading import BadInputFile, MissingInputFile, reading

EMU3_SOURCE = ("https://huggingface.co/BAAI/Emu3-Gen-hf (the transformers-format Emu3-Gen: config.json with "
               "vocabulary_map, model-*.safetensors, tokenizer and preprocessor files)")
EOL = "<|extra_200|>"  # Emu3ImageVocabularyMapping.eol_token_id: the end of an image row
VISUAL = re.compile(r"^<\|visual token (\d{6})\|>$")
SPATIAL_FACTOR = 8  # Emu3Processor.downsample_ratio: the header's h, w are image_area's side / 8


# ---------------------------------------------------------------------------------------- prompts
class Emu3Prompt(NamedTuple):
    """One sample's condition: the prompt ids (image header included) and the negative prompt's
    ids (the unconditional branch; unused when ``cfg_scale == 1``)."""

    ids: Sequence[int]
    negative: Sequence[int]


def generate_size(ratio: str, image_area: int) -> tuple[int, int]:
    """(h, w) in tokens of a generated image, as ``Emu3Processor.calculate_generate_size(ratio,
    image_area, 8)``: the ``w:h`` ratio scaled to ``image_area`` pixels, each side / 8, rounded."""
    try:
        rw, rh = (int(x) for x in str(ratio).split(":"))
    except ValueError:
        rw = rh = 0
    if rw <= 0 or rh <= 0:
        raise ValueError(f"ratio must be 'W:H' with positive integers (upstream's '1:1'), got {ratio!r}")
    scale = (image_area / (rw * rh)) ** 0.5
    return int(round(rh * scale / SPATIAL_FACTOR)), int(round(rw * scale / SPATIAL_FACTOR))


def generation_prompt(text: str, height: int, width: int, *, bos: str, boi: str, image_wrapper: str,
                      header: bool = True) -> str:
    """The string ``Emu3Processor`` tokenizes for image generation: ``bos + text + boi +
    f"{height}*{width}" + image_wrapper`` (``header=False``: ``bos + text``, what the processor
    makes of a negative prompt without ``return_for_image_generation``)."""
    return bos + text + (f"{boi}{height}*{width}{image_wrapper}" if header else "")


# ---------------------------------------------------------------------------------------- vocab
class ImageCodes:
    """Visual-token id <-> VQ code from a ``vocabulary_map`` (token name -> id): code c is
    ``<|visual token {c:06d}|>`` (``Emu3ImageVocabularyMapping.img2bpe``). Strict: the codes
    must be exactly 0..n_codes-1, on distinct ids."""

    def __init__(self, vocabulary_map: Mapping[str, int], n_codes: int):
        pairs = sorted((int(mt.group(1)), int(tid)) for name, tid in vocabulary_map.items()
                       if (mt := VISUAL.match(name)))
        codes = [c for c, _ in pairs]
        if codes != list(range(n_codes)):
            raise ValueError(f"vocabulary_map's visual tokens must cover codes 0..{n_codes - 1} (the VQ codebook) "
                             f"exactly once; got {len(codes)} tokens"
                             f"{'' if not codes else f', codes {codes[0]}..{codes[-1]}'}")
        ids = [t for _, t in pairs]
        if len(set(ids)) != len(ids):
            raise ValueError("vocabulary_map maps two visual codes to the same id")
        if EOL not in vocabulary_map:
            raise ValueError(f"vocabulary_map lacks the end-of-line token {EOL}")
        self.code_to_bpe = torch.tensor(ids, dtype=torch.long)
        self.eol = int(vocabulary_map[EOL])
        self.n_codes = n_codes

    def to_bpe(self, codes: torch.Tensor) -> torch.Tensor:
        return self.code_to_bpe.to(codes.device)[codes]

    def to_codes(self, bpe_ids: torch.Tensor) -> torch.Tensor:
        """Inverse mapping; a non-visual id is an error."""
        match = bpe_ids.unsqueeze(-1) == self.code_to_bpe.to(bpe_ids.device)
        if not bool(match.any(-1).all()):
            raise ValueError("ids outside the visual vocabulary")
        return match.long().argmax(-1)


# ---------------------------------------------------------------------------------------- model
class Emu3Backbone:
    """transformers' ``Emu3ForConditionalGeneration`` as the adapter runs it: ``run`` (the text
    model over a ``KVCache`` with a tree mask and logical positions, hidden after the final norm),
    ``logits`` (lm_head rows), the VQ decoder and the shapes a ``KVCache`` needs."""

    def __init__(self, hf):
        impl = hf.config.text_config._attn_implementation
        if impl not in ("sdpa", "eager"):
            raise ValueError(f"Emu3 runs with attn_implementation 'sdpa' or 'eager' (a tree mask is a 4D mask), "
                             f"got {impl!r}: load it with attn_implementation='sdpa'")
        self.hf = hf.eval()
        self.text = hf.model.text_model
        self.vq = hf.model.vqmodel
        tc = hf.config.text_config
        self.n_layers, self.n_kv_heads = tc.num_hidden_layers, tc.num_key_value_heads
        self.head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        self.vocab_size = tc.vocab_size
        self.eager = impl == "eager"

    @property
    def device(self) -> torch.device:
        return self.hf.device

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.dtype

    def run(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, attend: torch.Tensor,
            valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """ids, positions (n, m); ``attend`` over the cache's pending entries then the new ones
        (``KVCache.prepare``). Appends the m entries as pending; returns the hidden (n, m, H)."""
        return run_tree_masked(self.text, cache, attend, positions, valid=valid, input_ids=ids)

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.hf.lm_head.weight[rows])


# ---------------------------------------------------------------------------------------- target
class Emu3Target(RowEndTarget):
    """``ImageTarget`` over transformers' ``Emu3ForConditionalGeneration`` (see the module
    docstring for the token layout and the cache).

    ``cond`` for ``begin``: B ``Emu3Prompt`` (or (ids, negative) pairs) of any lengths. Returned
    logits are CFG-combined over codes; hidden states (after the final norm) are (B, m, H), or
    (B, m, 2, H) = [cond, uncond] when guided. ``decode`` maps codes through the model's VQ and
    the image processor's unnormalisation (``image_mean`` / ``image_std``) to [0, 1].
    """

    def __init__(
        self,
        backbone: Emu3Backbone,
        codes: ImageCodes,
        *,
        h_latent: int,
        w_latent: int,
        cfg_scale: float,
        image_mean: Sequence[float] = (0.5, 0.5, 0.5),
        image_std: Sequence[float] = (0.5, 0.5, 0.5),
        cache_headroom: int = 128,
    ):
        if h_latent < 1 or w_latent < 1:
            raise ValueError(f"the image grid must be at least 1x1 tokens, got {h_latent}x{w_latent}")
        V = backbone.vocab_size
        if int(codes.code_to_bpe.max()) >= V or not 0 <= codes.eol < V:
            raise ValueError(f"visual or end-of-line token ids exceed the model vocabulary ({V})")
        self.model = backbone
        self.codes = codes
        self.cfg_scale = float(cfg_scale)
        self.image_mean, self.image_std = tuple(image_mean), tuple(image_std)
        self.cache_headroom = cache_headroom
        self._init_grid(h_latent, w_latent, codes.code_to_bpe)  # visual codes = their token ids

    @property
    def row_end_id(self) -> int:
        """The end-of-line ``<|extra_200|>`` (``coolsd.models.row_ends``)."""
        return self.codes.eol

    def _new_cache(self, n: int, prefix_len: int) -> KVCache:
        m = self.model
        # the sequence's known maximum: prefix, every image token, an end-of-line per row and the pending
        # entries of a round (cache_headroom), so a decode never grows the cache
        committed = prefix_len + self.n_image_tokens + self.h_latent
        return self._cache_for((m.n_layers, n, m.n_kv_heads, m.head_dim, m.dtype, m.device),
                               committed + self.cache_headroom, 64, committed)

    def _out(self, hidden: torch.Tensor) -> StepOut:
        return self._guided_out(self.model.logits(hidden, self._rows), hidden)

    def _prompts(self, cond: Any, batch_size: int) -> list[tuple[list[int], list[int]]]:
        if not isinstance(cond, Sequence) or len(cond) != batch_size:
            raise ValueError(f"cond must be {batch_size} Emu3Prompt (prompt ids, negative prompt ids), "
                             f"got {type(cond).__name__}")
        V, out = self.model.vocab_size, []
        for c in cond:
            if not isinstance(c, Sequence) or len(c) != 2:
                raise ValueError("each cond entry must be an Emu3Prompt(ids, negative): the world's encode makes them")
            ids, neg = (id_list(x) for x in c)
            checked = (("prompt", ids), ("negative prompt", neg)) if self.guided else (("prompt", ids),)
            for name, x in checked:  # unguided: the negative prompt is never run
                if not x or min(x) < 0 or max(x) >= V:
                    raise ValueError(f"{name} ids must be a non-empty sequence of ids in [0, {V})")
            out.append((ids, neg))
        return out

    # ------------------------------------------------------------------ protocol
    @torch.no_grad()
    def begin(self, cond: Any, batch_size: int, context: Optional[StepOut] = None) -> StepOut:
        dev = self.device
        prompts = self._prompts(cond, batch_size)
        self.batch_size = batch_size
        self._alone = None
        if batch_invariant.active() and batch_size > 1:
            return self._begin_alone(prompts)
        rows = [p for p, _ in prompts] + ([n for _, n in prompts] if self.guided else [])
        n = len(rows)
        ids, lens, L = right_padded(rows, dev)
        self.cache = self._new_cache(n, L)
        causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
        hidden = self.model.run(ids, torch.arange(L, device=dev).expand(n, L), self.cache, causal, valid=lens)
        self.cache.commit(torch.arange(L, device=dev).expand(n, L), lens)
        self._offset = lens  # logical position of image token 0, per internal row
        self._reset_pending()
        return self._out(hidden[torch.arange(n, device=dev), lens - 1].unsqueeze(1))

    def _begin_alone(self, prompts: list) -> StepOut:
        """``begin`` under ``coolsd.engine.batch_invariant`` for B > 1: every sample runs in its own
        batch-1 target over the same model (the end-of-line slots of a shared forward exist wherever
        ANY sample has a row end, so a sample's attention spans, hence its last bits, would depend on
        the others)."""
        self.cache = None  # freed before the per-sample caches are allocated
        self._alone = [Emu3Target(self.model, self.codes, h_latent=self.h_latent, w_latent=self.w_latent,
                                  cfg_scale=self.cfg_scale, image_mean=self.image_mean, image_std=self.image_std,
                                  cache_headroom=self.cache_headroom) for _ in prompts]
        outs = [t.begin([p], 1) for t, p in zip(self._alone, prompts)]
        self.cache = self._alone[0].cache  # begun (forward and commit go to the per-sample targets)
        return StepOut(logits=torch.cat([o.logits for o in outs]), hidden=torch.cat([o.hidden for o in outs]))

    # forward and commit: ``RowEndTarget``'s (the end-of-lines), over this model call
    def _run_entries(self, ids: torch.Tensor, positions: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        return self.model.run(ids, positions, self.cache, attend)

    @torch.no_grad()
    def decode_raw(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, n_image_tokens) codes -> the VQ decoder's pixels (B, 3, H, W), float32, in the model's
        normalised space (``Emu3Model.decode_image_tokens`` without the end-of-line column)."""
        vq = self.model.vq
        codes = tokens.to(vq.device, torch.long).view(-1, self.h_latent, self.w_latent)
        return vq.decode(codes).float()

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, n_image_tokens) -> (B, 3, H, W) in [0, 1]: the image processor's unnormalisation
        ``x * std + mean`` (``Emu3ImageProcessor.postprocess``), clamped."""
        x = self.decode_raw(tokens)
        mean = torch.tensor(self.image_mean, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(self.image_std, device=x.device).view(1, 3, 1, 1)
        return (x * std + mean).clamp(0.0, 1.0)


# ---------------------------------------------------------------------------------------- loading
def load_emu3(folder: str | Path, *, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"):
    """transformers' ``Emu3ForConditionalGeneration`` from a local folder in the HF layout
    (config.json, ``*.safetensors``): safetensors only, never the network, and strict (a missing,
    unexpected or mis-shaped tensor is one error naming the folder, never a random init)."""
    from transformers import Emu3ForConditionalGeneration

    d = Path(folder)
    if not (d / "config.json").is_file():
        raise MissingInputFile(f"Emu3-Gen folder {d} lacks config.json; download {EMU3_SOURCE}")
    with reading(d, "an Emu3-Gen model folder in the transformers layout", EMU3_SOURCE):
        hf, info = Emu3ForConditionalGeneration.from_pretrained(
            str(d), dtype=dtype, local_files_only=True, use_safetensors=True, attn_implementation="sdpa",
            output_loading_info=True)
    bad = {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        parts = "; ".join(f"{k.replace('_', ' ')} ({len(v)}): {', '.join(map(str, v[:4]))}" for k, v in bad.items())
        raise BadInputFile(f"{d} does not fit Emu3ForConditionalGeneration ({parts}); expected {EMU3_SOURCE}")
    return hf.to(device).eval()


def load_emu3_target(
    folder: str | Path,
    *,
    h_latent: int,
    w_latent: int,
    cfg_scale: float,
    image_mean: Sequence[float] = (0.5, 0.5, 0.5),
    image_std: Sequence[float] = (0.5, 0.5, 0.5),
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> Emu3Target:
    """The real target from a local Emu3-Gen-hf folder: the model (VQ included) and its
    ``vocabulary_map``, checked against the VQ codebook."""
    hf = load_emu3(folder, dtype=dtype, device=device)
    with reading(Path(folder) / "config.json", "Emu3's config.json (with its vocabulary_map)", EMU3_SOURCE):
        vmap = hf.config.vocabulary_map
        if not isinstance(vmap, Mapping):
            raise ValueError("config.json has no vocabulary_map (needed for the visual token <-> code mapping)")
        codes = ImageCodes(vmap, hf.config.vq_config.codebook_size)
    return Emu3Target(Emu3Backbone(hf), codes, h_latent=h_latent, w_latent=w_latent, cfg_scale=cfg_scale,
                      image_mean=image_mean, image_std=image_std)


__all__ = [
    "EMU3_SOURCE", "Emu3Backbone", "Emu3Prompt", "Emu3Target", "ImageCodes", "generate_size", "generation_prompt",
    "load_emu3", "load_emu3_target",
]
