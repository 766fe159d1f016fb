"""Lumina-mGPT text-to-image (Alpha-VLLM/Lumina-mGPT, 7B, 768 px) as an ``ImageTarget`` in
IMAGE-CODE space, over ``coolsd.models.chameleon.ChameleonLM``.

What the generation loop sees: tokens 0..n_codes-1 are VQ code indices (8192 at full size),
logits (B, m, n_codes) over codes, ``n_image_tokens = h_latent * w_latent`` (48 x 48 at 768 px),
positions = image-token indices j (token j's output predicts token j + 1). Everything structural
is the adapter's business (docs/methods.md#3-lantern-and-lantern: structural tokens are never drafted against):

* Sequence (models_sjd.md 2.3; upstream ``data/item_processor.py`` ``process_image`` and
  ``inference_solver.py``): ``prompt ids`` (``[BOS] + tokenize(template + caption + sep)``, built
  by ``prompt_ids``), then ``<racm3:break>`` (8197), ``8804 + h_grids``, ``8804 + w_grids``
  (grids = latent / 2; teacher-forced here, sampled with text top-k upstream), then h_latent rows
  of w_latent image BPE tokens, each row followed by the newline ``<reserved08799>`` (8803),
  then ``<eoss>`` (8196). The loop stops after the last image token, so neither the last row's
  newline nor the end token is ever fed.
* Logical positions (1D RoPE): image token j sits at ``offset + j + j // w_latent``, its row's
  newline (after a row end, ``(j + 1) % w_latent == 0``) at that + 1; ``offset`` = prompt
  length + 3 in the conditional half, 3 in the unconditional half.
* Newlines are inserted BY THE ADAPTER inside ``forward`` (``coolsd.models.row_ends``, which Emu3's
  end-of-lines share): for every new entry that is a row end (and not in the last row) a newline
  entry is added in the same forward; it attends exactly what that token attends plus the token
  itself (and itself); later entries that see the token also see its newline. The node's returned
  logits / hidden are the newline entry's (they predict the next row's first token). ``commit``
  keeps the newline that follows each kept row-end token. Within one forward the set of newline
  slots is shared by the batch (KV-cache pending counts are shared): a slot exists where ANY
  sample has a row end; in the other samples it is computed but never attended and never
  committed.
* CFG (upstream ``LLMImageStartTriggeredUnbatchedClassifierFreeGuidanceLogitsProcessor``):
  active as soon as ``<racm3:break>, h, w`` exist, i.e. for every image token; the unconditional
  context is the sequence from the last ``<racm3:break>`` on (no BOS, no text), positions from
  0, and it sees every later token including the newlines. Internally the batch is
  [cond; uncond] with different committed lengths and positions (per-sample KVCache lengths);
  logits are combined raw: ``uncond + s * (cond - uncond)`` (``cfg_combine``). ``cfg_scale == 1``
  runs no unconditional half (upstream returns the scores untouched).
* Image vocabulary (upstream ``MultiModalLogitsProcessor``: inside an image only ids 4..8195,
  the 8192 ``IMGIMG*`` tokens, are allowed; newline / end are forced): the returned logits are
  the lm_head rows of the image BPE ids in code order, so restricting to them and the forcing
  are exact. The BPE id <-> code mapping comes from ``config.json`` ``vocabulary_map``
  (``ImageVocab``; upstream ``chameleon_vae_ori/vocab.py:VocabTranslation.bpe2img``).
  The logits bypass upstream's ``config.mask_image_logits`` switch (the released configs must
  have it off, or upstream could not generate images at all).

CFG scale, temperature and top-k (Lumina's protocol: cfg 3.0 in SJD / COOL-SD, top-k 2000)
are configuration, not defaults of this class.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from coolsd.engine import batch_invariant
from coolsd.engine.model_protocol import StepOut, id_list
from coolsd.models.chameleon import HF_SOURCE, ChameleonLM, load_chameleon
from coolsd.models.chameleon_vq import CHAMELEON_VQGAN, load_vqgan
from coolsd.models.guided import right_padded
from coolsd.models.kv_cache import KVCache
from coolsd.models.row_ends import RowEndTarget
from coolsd.util.loading import reading

PROMPT_TEMPLATE = "Generate an image of {width}x{height} according to the following prompt:\n{caption}"


# ---------------------------------------------------------------------------------------- tokens
@dataclass(frozen=True)
class LuminaTokens:
    """Structural token ids (Chameleon vocabulary; ``<reservedNNNNN>`` has id NNNNN + 4)."""

    image_start: int = 8197  # <racm3:break>
    image_end: int = 8196  # <eoss>
    newline: int = 8803  # <reserved08799>
    grid_base: int = 8804  # <reserved08800>: the h / w grid-count tokens are grid_base + n_grids
    sep: int = 8710  # <reserved08706>: Lumina's Conversation.sep_token (end of turn)

    NAMES = {
        "image_start": "<racm3:break>", "image_end": "<eoss>", "newline": "<reserved08799>",
        "grid_base": "<reserved08800>", "sep": "<reserved08706>",
    }

    @classmethod
    def from_vocabulary_map(cls, vocabulary_map: Mapping[str, int]) -> "LuminaTokens":
        missing = [n for n in cls.NAMES.values() if n not in vocabulary_map]
        if missing:
            raise ValueError(f"vocabulary_map lacks the structural tokens {missing}")
        return cls(**{field: int(vocabulary_map[name]) for field, name in cls.NAMES.items()})

    def grid_token(self, n_grids: int, vocabulary_map: Optional[Mapping[str, int]] = None) -> int:
        """Id of the grid-count token for ``n_grids`` (checked against the map's
        ``<reserved{8800 + n_grids:05d}>`` when a map is given)."""
        tid = self.grid_base + n_grids
        if vocabulary_map is not None:
            name = f"<reserved{8800 + n_grids:05d}>"
            if vocabulary_map.get(name) != tid:
                raise ValueError(f"vocabulary_map gives {name} id {vocabulary_map.get(name)}, expected {tid}")
        return tid


def prompt_text(caption: str, width: int, height: int, sep_text: str = "<reserved08706>") -> str:
    """Lumina's t2i prompt (``generate_examples/generate.py``: ``f"Generate an image of {w}x{h}
    according to the following prompt:\\n{prompt}"`` as the human turn; ``Conversation.process``
    appends the sep token to the turn and nothing for the open assistant turn)."""
    return PROMPT_TEMPLATE.format(width=width, height=height, caption=caption) + sep_text


def prompt_ids(encode: Callable[[str], Sequence[int]], caption: str, width: int, height: int, bos_id: int) -> list[int]:
    """``[bos_id] + encode(prompt_text(...))`` (xllmx ``Tokenizer.encode(s, bos=True, eos=False)``:
    ``encode`` must tokenize without adding special tokens and map ``<reserved08706>`` to its id)."""
    return [int(bos_id)] + [int(t) for t in encode(prompt_text(caption, width, height))]


# ---------------------------------------------------------------------------------------- vocab
_IMAGE_NAME = re.compile(r"^IMGIMG([A-J]+)Z$")


class ImageVocab:
    """BPE id <-> VQ code for the image tokens of a ``vocabulary_map`` (token name -> id).
    Image tokens are named ``IMGIMG<letters>Z`` with letters A..J standing for the digits of the
    code (upstream ``VocabTranslation.bpe2img``). Strict: the codes must be exactly 0..n-1."""

    def __init__(self, vocabulary_map: Mapping[str, int], n_codes: Optional[int] = None):
        pairs = []
        for name, tid in vocabulary_map.items():
            if not name.startswith("IMGIMG"):
                continue
            mt = _IMAGE_NAME.match(name)
            if mt is None:
                raise ValueError(f"image token name {name!r} is not IMGIMG<letters A-J>Z")
            code = int("".join(str(ord(c) - ord("A")) for c in mt.group(1)))
            pairs.append((code, int(tid)))
        pairs.sort()
        codes = [c for c, _ in pairs]
        n = len(codes) if n_codes is None else n_codes
        if codes != list(range(n)):
            raise ValueError(f"vocabulary_map image tokens must cover codes 0..{n - 1} exactly once; "
                             f"got {len(codes)} tokens{'' if not codes else f', codes {codes[0]}..{codes[-1]}'}")
        ids = [t for _, t in pairs]
        if len(set(ids)) != len(ids):
            raise ValueError("vocabulary_map maps two image codes to the same BPE id")
        self.code_to_bpe = torch.tensor(ids, dtype=torch.long)
        self.n_codes = n

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any], n_codes: Optional[int] = None) -> "ImageVocab":
        vmap = hf_config.get("vocabulary_map")
        if not isinstance(vmap, Mapping):
            raise ValueError("config.json has no vocabulary_map (needed for the image BPE id <-> code mapping)")
        return cls(vmap, n_codes)

    def to_bpe(self, codes: torch.Tensor) -> torch.Tensor:
        return self.code_to_bpe.to(codes.device)[codes]

    def to_codes(self, bpe_ids: torch.Tensor) -> torch.Tensor:
        """Inverse mapping; a non-image id is an error."""
        table = self.code_to_bpe.to(bpe_ids.device)
        match = bpe_ids.unsqueeze(-1) == table
        if not bool(match.any(-1).all()):
            raise ValueError("ids outside the image vocabulary")
        return match.long().argmax(-1)


# ---------------------------------------------------------------------------------------- target
class LuminaTarget(RowEndTarget):
    """``ImageTarget`` over a ``ChameleonLM`` (see the module docstring for the token layout).

    ``cond`` for ``begin``: B prompt-id sequences (lists or 1-D tensors, any lengths), e.g. from
    ``prompt_ids``. Returned logits are CFG-combined over codes; hidden states (after the final
    norm) are (B, m, H), or (B, m, 2, H) = [cond, uncond] when guided.
    ``decoder``: a ``ChameleonVQ`` (``decode_codes(codes, h, w)``) or a callable codes -> images.
    ``prefill_features="all"``: ``begin``'s hidden carries every prefill slot's feature (B, L,
    [2,] H), right-aligned with zeros before a row's first slot (the EAGLE drafter's text
    prefix, ``coolsd.models.eagle.lumina``); "last": only the last slot's.
    Under ``coolsd.engine.batch_invariant`` with B > 1 every sample runs in its own batch-1 target.
    """

    def __init__(
        self,
        model: ChameleonLM,
        vocab: ImageVocab,
        *,
        h_latent: int,
        w_latent: int,
        cfg_scale: float,
        decoder: Any = None,
        tokens: LuminaTokens = LuminaTokens(),
        cache_headroom: int = 128,
        prefill_features: str = "last",
        compile: bool = False,
    ):
        if h_latent % 2 or w_latent % 2 or h_latent < 2 or w_latent < 2:
            raise ValueError(
                f"latent grid must be even (grid tokens count 32-px patches = 2 latents), got {h_latent}x{w_latent}"
            )
        V = model.config.vocab_size
        ids = [tokens.image_start, tokens.newline, tokens.grid_base + h_latent // 2, tokens.grid_base + w_latent // 2]
        if int(vocab.code_to_bpe.max()) >= V or max(ids) >= V or min(ids) < 0:
            raise ValueError(f"image or structural token ids exceed the model vocabulary ({V})")
        if prefill_features not in ("last", "all"):
            raise ValueError(f"prefill_features must be 'last' or 'all', got {prefill_features!r}")
        # "all": begin() hands over every prefill slot's feature (an EAGLE drafter's text prefix)
        self.prefill_features = prefill_features
        self.model = model.eval()
        self.vocab = vocab
        self.tokens = tokens
        self.cfg_scale = float(cfg_scale)
        self.decoder = decoder
        # spare slots for a round's pending entries; compiled, every token has an end-of-line slot: twice as many
        self.cache_headroom = 2 * cache_headroom if compile else cache_headroom
        # image codes = their BPE ids' embeddings; compile: forwards under torch.compile (``RowEndTarget``)
        self._init_grid(h_latent, w_latent, vocab.code_to_bpe, compile=compile)

    @property
    def row_end_id(self) -> int:
        """The newline ``<reserved08799>`` (``coolsd.models.row_ends``)."""
        return self.tokens.newline

    @property
    def structural_prefix(self) -> list[int]:
        """``<racm3:break>, grid_base + h_grids, grid_base + w_grids`` (teacher-forced)."""
        t = self.tokens
        return [t.image_start, t.grid_base + self.h_latent // 2, t.grid_base + self.w_latent // 2]

    def _new_cache(self, n: int, prefix_len: int) -> KVCache:
        cfg, m = self.model.config, self.model
        # the sequence's known maximum: prefix, every image token, a newline per row and the pending
        # entries of a round (cache_headroom), so a decode never grows the cache
        committed = prefix_len + self.n_image_tokens + self.h_latent
        return self._cache_for((cfg.num_layers, n, cfg.num_heads, cfg.head_dim, m.dtype, m.device),
                               committed + self.cache_headroom, 64, committed)

    def _out(self, hidden: torch.Tensor) -> StepOut:
        return self._guided_out(self.model.logits(hidden, rows=self._rows), hidden)

    # ------------------------------------------------------------------ protocol
    @torch.no_grad()
    def begin(self, cond: Any, batch_size: int, context: Optional[StepOut] = None) -> StepOut:
        model, dev = self.model, self.model.device
        if isinstance(cond, torch.Tensor) and cond.dim() == 2:
            cond = list(cond)
        if not isinstance(cond, Sequence) or len(cond) != batch_size:
            raise ValueError(f"cond must be {batch_size} prompt-id sequences, got {type(cond).__name__}")
        V = model.config.vocab_size
        prompts = []
        for p in cond:
            ids = id_list(p)
            if not ids or min(ids) < 0 or max(ids) >= V:
                raise ValueError(f"prompt ids must be a non-empty sequence of ids in [0, {V})")
            prompts.append(ids)
        self.batch_size = batch_size
        self._alone = None
        if batch_invariant.active() and batch_size > 1:
            return self._begin_alone(prompts)
        prefix = self.structural_prefix
        rows = [p + prefix for p in prompts] + ([prefix] * batch_size if self.guided else [])
        n = len(rows)
        ids, lens, L = right_padded(rows, dev)
        self.cache = self._new_cache(n, L)
        causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
        hidden = model.run(model.embed(ids), torch.arange(L, device=dev).expand(n, L), self.cache, causal, valid=lens)
        self.cache.commit(torch.arange(L, device=dev).expand(n, L), lens)
        self._offset = lens  # logical position of image token 0, per internal row
        self._reset_pending()
        out = self._out(hidden[torch.arange(n, device=dev), lens - 1].unsqueeze(1))
        if self.prefill_features == "all":
            # (B, L, [2,] H): every prefill slot's feature, RIGHT-aligned (each row's last slot at
            # index -1, zeros before its first): LANTERN's left zero padding of the uncond half
            # (``cnets_lumina_mgpt.Model.topK_generate``), here for every row
            ar = torch.arange(L, device=dev)
            src = (ar.unsqueeze(0) - (L - lens).unsqueeze(1))  # (n, L) source index, < 0 = padding
            feats = hidden.gather(1, src.clamp(min=0).unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
            feats = feats.masked_fill((src < 0).unsqueeze(-1), 0.0)
            out.hidden = self._halves(feats)
        return out

    def _begin_alone(self, prompts: list) -> StepOut:
        """``begin`` under ``coolsd.engine.batch_invariant`` for B > 1: every sample runs in its own batch-1
        target over the same model (the newline slots of a shared forward exist wherever ANY sample
        has a row end, so a sample's attention spans, hence its last bits, would depend on the others)."""
        self.cache = None  # freed before the per-sample caches are allocated
        self._alone = [LuminaTarget(self.model, self.vocab, h_latent=self.h_latent, w_latent=self.w_latent,
                                    cfg_scale=self.cfg_scale, tokens=self.tokens, cache_headroom=self.cache_headroom,
                                    prefill_features=self.prefill_features) for _ in prompts]
        outs = [t.begin([p], 1) for t, p in zip(self._alone, prompts)]
        hidden = None
        if outs[0].hidden is not None:  # right-aligned prefill features: left zero padding to the longest
            L = max(o.hidden.shape[1] for o in outs)
            hidden = torch.cat([torch.cat([o.hidden.new_zeros(1, L - o.hidden.shape[1], *o.hidden.shape[2:]), o.hidden], 1)
                                for o in outs])
        self.cache = self._alone[0].cache  # begun (forward and commit go to the per-sample targets)
        return StepOut(logits=torch.cat([o.logits for o in outs]), hidden=hidden)

    # forward and commit: ``RowEndTarget``'s (the newlines), over this model call
    def _run_entries(self, ids: torch.Tensor, positions: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        return self.model.run(self.model.embed(ids), positions, self.cache, attend)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.decoder is None:
            raise RuntimeError("LuminaTarget was built without a VQ decoder")
        if hasattr(self.decoder, "decode_codes"):
            return self.decoder.decode_codes(tokens, self.h_latent, self.w_latent)
        return self.decoder(tokens)


def load_lumina_target(
    folder: str | Path,
    vqgan_ckpt: Optional[str | Path],
    *,
    h_latent: int = 48,
    w_latent: int = 48,
    cfg_scale: float,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    vq_config=None,
    prefill_features: str = "last",
    compile: bool = False,
) -> LuminaTarget:
    """The real target from local files: the Lumina-mGPT checkpoint folder (config.json with
    ``vocabulary_map``, safetensors shards; huggingface.co/Alpha-VLLM/Lumina-mGPT-7B-768) and
    Meta's ``vqgan.ckpt`` (None: no decoder). Structural token ids are checked against the map."""

    model, hf = load_chameleon(folder, dtype=dtype, device=device)
    vq_config = vq_config or CHAMELEON_VQGAN
    with reading(Path(folder) / "config.json", "Lumina-mGPT's config.json (with its vocabulary_map)", HF_SOURCE):
        vocab = ImageVocab.from_hf_config(hf, n_codes=vq_config.n_embed)
        vmap = hf["vocabulary_map"]
        tokens = LuminaTokens.from_vocabulary_map(vmap)
        tokens.grid_token(h_latent // 2, vmap), tokens.grid_token(w_latent // 2, vmap)
    decoder = None if vqgan_ckpt is None else load_vqgan(vqgan_ckpt, vq_config, device=device)
    return LuminaTarget(model, vocab, h_latent=h_latent, w_latent=w_latent, cfg_scale=cfg_scale,
                        decoder=decoder, tokens=tokens, prefill_features=prefill_features, compile=compile)


__all__ = [
    "ImageVocab", "LuminaTarget", "LuminaTokens", "PROMPT_TEMPLATE", "load_lumina_target", "prompt_ids", "prompt_text",
]
