"""Row ends inserted by the adapter: the end-of-line entry that follows every image row in the
sequences of Lumina-mGPT (the newline ``<reserved08799>``, ``coolsd.models.lumina``) and Emu3-Gen
(``<|extra_200|>``, ``coolsd.models.emu3``), written once here for both.

The loop sees image tokens only (codes 0..V-1 at image-token indices j); a row end is never drafted
nor sampled. ``RowEndTarget.forward`` adds, for every new entry that is a row end
(``(j + 1) % w_latent == 0``) and not in the last row, an end-of-line entry in the same forward:
it attends exactly what its token attends plus the token itself (and itself); later entries that see
the token also see its end-of-line. Logical positions (1D RoPE): image token j sits at
``offset + j + j // w_latent`` (``logical_offset``), its end-of-line at that + 1. The node's
returned logits / hidden are the end-of-line entry's (they predict the next row's first token).
``commit`` keeps the end-of-line that follows each kept row-end token, right after it. Within one
forward the set of end-of-line slots is shared by the batch (KV-cache pending counts are shared):
a slot exists where ANY sample has a row end; in the other samples it is computed but never
attended and never committed.

Bookkeeping: caller pending entry -> cache pending index (``_p_int``, one row for the batch) and
that entry's end-of-line's cache pending index (``_p_nl``, per sample, -1 for none). The pure
functions ``plan_forward`` and ``kept_entries`` are the algorithm; ``RowEndTarget`` is the
``forward`` / ``commit`` pair of the ``ImageTarget`` protocol over them, mixed into a target that
provides the model call (``_run_entries``), the end-of-line id (``row_end_id``) and its own
``begin`` (which sets ``cache``, ``batch_size``, ``_offset`` and calls ``_reset_pending``).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from coolsd.engine.batch_invariant import commit_each, forward_each
from coolsd.engine.compiled import compile_step
from coolsd.engine.host_reads import host_checks
from coolsd.engine.model_protocol import StepOut
from coolsd.models.guided import GuidedCacheModel
from coolsd.models.kv_cache import KVCache


class RowEndStep(NamedTuple):
    """One forward of m image tokens with its k end-of-line slots (``plan_forward``)."""

    attend: torch.Tensor  # (B, m + k, Pi + m + k) bool over the cache's pending entries: [old, m tokens, k slots]
    rel: torch.Tensor  # (B, m + k) logical positions relative to image token 0
    cols: torch.Tensor  # (k,) the token columns that get an end-of-line slot
    pick: torch.Tensor  # (B, m) the entry whose output each node reports (its end-of-line's where it has one)
    p_int: torch.Tensor  # (P + m,) caller pending entry -> cache pending index, after this forward
    p_nl: torch.Tensor  # (B, P + m) its end-of-line's cache pending index or -1, after this forward


def logical_offset(j: torch.Tensor, w_latent: int) -> torch.Tensor:
    """Position of image token j relative to the first image token: j + j // w_latent."""
    return j + torch.div(j, w_latent, rounding_mode="floor")


def plan_forward(j: torch.Tensor, attend: torch.Tensor, p_int: torch.Tensor, p_nl: torch.Tensor, n_pending: int,
                 w_latent: int, n_image_tokens: int, every_slot: bool = False) -> RowEndStep:
    """The internal mask, positions and bookkeeping of a forward of m image tokens at indices ``j``
    (B, m) whose caller mask ``attend`` (B, m, P + m) is over the caller's P pending entries then the
    new ones; ``p_int`` / ``p_nl`` the bookkeeping so far, ``n_pending`` the cache's pending count.
    ``every_slot``: every token column gets an end-of-line slot (k = m), used only where it ends a
    row, so that the shapes depend on m alone (the compiled path: no host read of ``j``)."""
    B, m = j.shape
    P, Pi, dev = p_int.numel(), n_pending, j.device
    ar_m = torch.arange(m, device=dev)

    # row ends that get an end-of-line: (j + 1) % w == 0, not the last row
    row_end = ((j + 1) % w_latent == 0) & (j + 1 < n_image_tokens) & (j >= 0)
    # token columns that get an end-of-line slot
    cols = ar_m if every_slot else torch.nonzero(row_end.any(0)).flatten()
    k = cols.numel()
    ar_k = torch.arange(k, device=dev)
    slot_of = torch.full((m,), -1, dtype=torch.long, device=dev)
    slot_of[cols] = ar_k
    nl_new = torch.where(row_end, Pi + m + slot_of.clamp(min=0), -1)  # (B, m) cache pending index
    int_idx = torch.cat([p_int, Pi + ar_m])  # (P+m,) caller column -> cache pending index
    nl_all = torch.cat([p_nl, nl_new], 1)  # (B, P+m)

    # internal mask over the cache's pending entries: [old pending (Pi), m tokens, k end-of-line slots]
    T = Pi + m + k
    A = torch.zeros(B, m, T + 1, dtype=torch.bool, device=dev)  # the tokens' rows; last column: a dump
    A[:, :, int_idx] = attend
    # a token that sees an earlier row-end token also sees that token's end-of-line
    not_self = torch.ones(m, P + m, dtype=torch.bool, device=dev)
    not_self[ar_m, P + ar_m] = False
    add = attend & (nl_all >= 0).unsqueeze(1) & not_self
    idx = torch.where(add, nl_all.unsqueeze(1).expand(B, m, P + m), T)  # T = dump column
    A = A.scatter_(2, idx, add)[..., :T]  # True to each seen end-of-line, False to the dump column only
    if k:
        # an end-of-line sees what its token sees, the token, and itself
        A_nl = A[:, cols]
        A_nl[:, ar_k, Pi + cols] = True
        A_nl[:, ar_k, Pi + m + ar_k] = True
        A = torch.cat([A, A_nl], 1)

    rel = logical_offset(j, w_latent)  # (B, m) relative to image token 0
    rel = torch.cat([rel, rel[:, cols] + 1], 1)
    pick = torch.where(row_end, m + slot_of.clamp(min=0), ar_m)  # (B, m)
    return RowEndStep(A, rel, cols, pick, int_idx, nl_all)


def kept_entries(keep: torch.Tensor, n_keep: torch.Tensor, p_int: torch.Tensor,
                 p_nl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache pending entries a commit keeps: each kept caller entry ``keep[b, :n_keep[b]]`` (B, K),
    followed by its end-of-line where it has one. Returns (entries (B, 2K), the kept ones first in
    order; counts (B,)), for ``KVCache.commit``. Reads nothing on the host."""
    B, K = keep.shape
    kc = keep.clamp(0, p_int.numel() - 1)
    ent = p_int[kc]  # (B, K)
    nl = p_nl.gather(1, kc)
    pair = torch.stack([ent, nl.clamp(min=0)], 2).reshape(B, 2 * K)
    kept = torch.arange(K, device=keep.device).unsqueeze(0) < n_keep.unsqueeze(1)
    valid = torch.stack([kept, kept & (nl >= 0)], 2).reshape(B, 2 * K)
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)  # valid first, in order
    return pair.gather(1, order), valid.sum(1)


class RowEndTarget(GuidedCacheModel):
    """``forward`` and ``commit`` of an image target whose sequence has an end-of-line after every
    row (module docstring). The target's ``__init__`` sets ``model`` (with a ``device``) and
    ``cfg_scale`` and calls ``_init_grid``; its ``begin`` sets ``cache`` (a ``KVCache``),
    ``batch_size``, ``_offset`` (logical position of image token 0, per internal row) and ``_alone``
    (the per-sample targets under ``coolsd.engine.batch_invariant``, or None) and calls
    ``_reset_pending``. It provides ``row_end_id``, ``_run_entries`` and ``_out``. Internally the
    batch is [cond; uncond] when guided."""

    row_end_id: int  # the end-of-line token's input id
    cache: Optional[KVCache]  # set by begin

    def _init_grid(self, h_latent: int, w_latent: int, code_ids: torch.Tensor, compile: bool = False) -> None:
        """The image grid and the state before ``begin``. ``code_ids``: the input id (and lm_head
        row) of codes 0..n-1, in code order. ``compile``: the model call of every ``forward``
        (``_step``) under ``torch.compile`` over a static cache (``coolsd.engine.compiled``), every
        token with an end-of-line slot (``plan_forward(every_slot=True)``): one graph per (m, pending
        count), whatever the positions."""
        self.compiled = bool(compile)
        self._step_fn = compile_step(self._step, self.device) if self.compiled else self._step
        self.h_latent, self.w_latent = int(h_latent), int(w_latent)
        self.n_image_tokens = self.h_latent * self.w_latent
        self.vocab_size = code_ids.numel()
        self._rows = code_ids.to(self.device)  # lm_head rows / input ids of codes 0..n-1
        self.cache = None
        self.batch_size = 0
        self._alone: Optional[list] = None  # under coolsd.engine.batch_invariant: one batch-1 target per sample

    def logical_offset(self, j: torch.Tensor) -> torch.Tensor:
        """Position of image token j relative to the first image token: j + j // w_latent."""
        return logical_offset(j, self.w_latent)

    def _run_entries(self, ids: torch.Tensor, positions: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        """The model over input ids (n, m + k) at logical positions (n, m + k), ``attend`` (n, m + k, T)
        over the cache's pending entries then the new ones; appends them as pending. Returns hidden."""
        raise NotImplementedError

    def _out(self, hidden: torch.Tensor) -> StepOut:
        raise NotImplementedError

    def _reset_pending(self) -> None:
        dev = self.device
        self._p_int = torch.zeros(0, dtype=torch.long, device=dev)  # caller pending -> cache pending index
        self._p_nl = torch.zeros(self.batch_size, 0, dtype=torch.long, device=dev)  # its end-of-line's, or -1

    def _pending_count(self) -> int:
        """Pending entries, in the caller's numbering (host-known: every forward adds its m)."""
        return (self._alone[0] if self._alone is not None else self)._p_int.numel()

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        attend: torch.Tensor,
        features: Optional[torch.Tensor] = None,
    ) -> StepOut:
        """tokens: (B, m) codes; positions: (B, m) image-token indices j; attend: (m, P+m) or
        (B, m, P+m) over the caller's pending entries then the new ones."""
        if self._alone is not None:
            return forward_each(self._alone, tokens, positions, attend)
        if self.cache is None:
            raise RuntimeError("call begin() first")
        dev, B = self.device, self.batch_size
        tokens, j = tokens.to(dev), positions.to(dev).expand(tokens.shape)
        m = tokens.shape[1]
        P = self._p_int.numel()
        attend = attend.to(dev, torch.bool)
        if attend.shape[-2:] != (m, P + m):
            raise ValueError(f"attend must be (.., {m}, {P + m}), got {tuple(attend.shape)}")
        if host_checks() and bool(((tokens < 0) | (tokens >= self.vocab_size)).any()):
            raise ValueError(f"tokens must be image codes in [0, {self.vocab_size})")
        if self.compiled:  # a static cache never grows: a forward adds 2m entries (every token's end-of-line slot)
            self.cache.check_headroom(2 * m, self.cache_headroom)
        step = plan_forward(j, attend.expand(B, m, P + m), self._p_int, self._p_nl, self.cache.n_pending,
                            self.w_latent, self.n_image_tokens, every_slot=self.compiled)
        k = step.cols.numel()
        ids = torch.cat([self._rows[tokens], torch.full((B, k), self.row_end_id, device=dev)], 1)
        pos = self._double(step.rel) + self._offset.unsqueeze(1)
        logits, hidden = self._step_fn(self._double(ids), pos, self._double(step.attend), self._double(step.pick))
        self._p_int, self._p_nl = step.p_int, step.p_nl
        return StepOut(logits=logits, hidden=hidden)

    def _step(self, ids: torch.Tensor, positions: torch.Tensor, attend: torch.Tensor, pick: torch.Tensor):
        """The model call of a ``forward`` (compiled when ``compile``): the entries (n, m + k) run
        over the cache, then each node's output (``pick`` (n, m): its end-of-line's where it has
        one) as ``_out`` gives it: (logits, hidden)."""
        hidden = self._run_entries(ids, positions, attend)
        sel = hidden.gather(1, pick.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        out = self._out(sel)
        return out.logits, out.hidden

    @torch.no_grad()
    def commit(self, keep: Optional[torch.Tensor], n_keep: torch.Tensor) -> None:
        """keep: (B, K) caller pending indices; n_keep: (B,). The end-of-line after a kept row-end
        token is kept right after it. Reads nothing on the host."""
        if keep is None:  # the first pending entries in order: explicit indices for the end-of-line bookkeeping
            keep = torch.arange(self._pending_count(), device=n_keep.device).expand(n_keep.shape[0], -1)
        if self._alone is not None:
            return commit_each(self._alone, keep, n_keep)
        if self.cache is None:
            raise RuntimeError("call begin() first")
        dev, B = self.device, self.batch_size
        keep, n_keep = keep.to(dev, torch.long), n_keep.to(dev, torch.long)
        P, K = self._p_int.numel(), keep.shape[1]
        if host_checks() and bool(((n_keep < 0) | (n_keep > min(P, K))).any()):
            raise ValueError(f"n_keep must lie in [0, min({P} pending, {K} keep columns)]")
        if P == 0 or K == 0:
            self.cache.commit(torch.zeros(2 * B if self.guided else B, 0, dtype=torch.long, device=dev),
                              self._double(torch.zeros(B, dtype=torch.long, device=dev)))
        else:
            entries, counts = kept_entries(keep, n_keep, self._p_int, self._p_nl)
            self.cache.commit(self._double(entries), self._double(counts))
        self._reset_pending()


__all__ = ["RowEndStep", "RowEndTarget", "kept_entries", "logical_offset", "plan_forward"]
