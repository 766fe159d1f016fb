"""A static per-layer KV cache with per-sample committed lengths and tree-shaped pending entries.

Eager (``static=False``), every layer's keys and values are views of ONE buffer ``kv`` (2 * n_layers, B,
H, max_len, head_dim): keys of layer i at 2i, values at 2i + 1, so a commit moves the kept entries of
every layer in a few ops (a tree round's commit was 4 kernels a buffer, 8 a layer). Static (compiled),
each layer's keys and values are buffers of their own (``kv`` is None): Inductor writes a forward's
entries into a graph input in place, where a write into a view of one shared input costs it two more
kernels a buffer (functionalization rebuilds and copies back the base), and it fuses a commit's
per-buffer ops itself. Layout of sample b in each buffer (B, H, max_len, head_dim):
    slots [0, length[b])                    committed entries, in sequence order
    slots [length[b], length[b] + n_pending) pending entries, in the order forwards added them
    slots beyond                            free (stale values, never attended)

Invariants:
* ``n_pending`` is shared by the batch (every forward appends the same m entries to every
  sample); committed lengths may differ per sample.
* A committed slot is visible to every later query unless ``hidden_slots`` marks it (e.g. text
  padding); a pending entry is visible to a query only where the caller's ``attend`` says so.
* ``commit`` leaves no pending entries.
* Visibility by position (row-parallel decoding, docs/methods.md section 8.1): a forward given
  ``positions`` records each new entry's logical position and lets a query at position p see only
  the committed entries at positions < p (entries without a recorded position, the condition, stay
  visible); committing an entry at a position that an earlier committed entry holds hides the older
  one (upstream ZipAR overwrites that slot of its static cache).
* ``static=True`` (the compiled decode path, ``coolsd.engine.compiled``): every forward attends the whole
  buffer under its mask and writes by scatter, so shapes depend only on (m, P), never on the
  committed lengths, and ``prepare`` reads no tensor on the host; the buffer never grows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from coolsd.engine import batch_invariant
from coolsd.engine.host_reads import host_checks

NO_POSITION = -(1 << 62)  # a slot without a recorded position (the condition): visible to every query


@dataclass
class CacheStep:
    """What one forward of m new tokens needs in every layer."""

    mask: torch.Tensor  # (B, 1, m, span) bool, True = attend
    slots: torch.Tensor  # (B, m) long, where the new entries are written
    span: int  # attention runs over slots [0, span) only
    start: Optional[int] = None  # when every sample writes slots [start, start + m): slice writes
    # under coolsd.engine.batch_invariant: per sample, its valid new rows and its own span of slots
    rows: Optional[list[int]] = None
    spans: Optional[list[int]] = None
    static: bool = False  # a static cache's step: writes by index_put at (batch_index, slots)
    batch_index: Optional[torch.Tensor] = None  # (B, 1)


class KVCache:
    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        static: bool = False,
        max_committed: Optional[int] = None,
    ):
        if static:  # a buffer a layer: compiled writes land in the graph's inputs (see the module docstring)
            self.kv = None
            self.k, self.v = ([torch.zeros(batch_size, n_heads, max_len, head_dim, dtype=dtype, device=device)
                               for _ in range(n_layers)] for _ in range(2))
        else:
            self.kv = torch.zeros(2 * n_layers, batch_size, n_heads, max_len, head_dim, dtype=dtype, device=device)
            self._views()
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.slot_index = torch.arange(max_len, device=device)  # 0 .. max_len - 1, read as views
        self.dtype = dtype
        self.static = static
        # the most entries a sample ever commits, where the owner knows it (its prefix and every image
        # token): caps the host's bound of the committed length, so a cache sized for it never reads it
        self.cap = max_committed
        self.reset()
        if static:  # compiled graphs mutate these in place: static addresses, so CUDA graphs capture them
            from torch._dynamo import mark_static_address

            for t in (*self.k, *self.v, self.length, self.hidden_slots):
                mark_static_address(t)

    def _views(self) -> None:
        """``k[i]`` and ``v[i]``: layer i's keys and values, views of ``kv``."""
        n = self.kv.shape[0] // 2  # single views (``select``), not ``unbind``'s: written in place under any grad mode
        self.k = [self.kv[2 * i] for i in range(n)]
        self.v = [self.kv[2 * i + 1] for i in range(n)]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def matches(self, n_layers: int, batch_size: int, n_heads: int, head_dim: int, dtype, device) -> bool:
        """Whether this cache can be reused (after ``reset``) for the given shape."""
        B, H, _, D = self.k[0].shape
        return (
            len(self.k) == n_layers
            and (B, H, D) == (batch_size, n_heads, head_dim)
            and self.dtype == dtype
            and self.device == torch.device(device)
        )

    def fits(self, max_len: int) -> bool:
        """Whether the buffers hold ``max_len`` slots. A static cache that holds more is reused too:
        its compiled graphs are specialised to its buffers' shape, whatever the sequence needs, so
        reusing it (a prompt of another length) runs the same graphs."""
        return self.max_len >= max_len

    def reset(self, max_committed: Optional[int] = None) -> None:
        """Empty the cache for a new sequence. Every tensor keeps its storage (``length`` and
        ``hidden_slots`` are zeroed in place), so a reused cache keeps every buffer's address
        across images: graphs captured over them (CUDA graphs, ``coolsd.engine.compiled``) stay valid.
        ``max_committed``: the new sequence's most committed entries, where its owner knows it (a
        prompt of another length than the last one's): the cap of the host's bound is the new
        sequence's, never the last one's (a cap too small would leave committed entries unseen)."""
        if max_committed is not None:
            self.cap = max_committed
        B = self.batch_size
        if getattr(self, "length", None) is not None:
            self.length.zero_()
            self.hidden_slots.zero_()
            self.slot_pos.fill_(NO_POSITION)
        else:
            self.length = torch.zeros(B, dtype=torch.long, device=self.device)
            self.hidden_slots = torch.zeros(B, self.max_len, dtype=torch.bool, device=self.device)
            self.slot_pos = torch.full((B, self.max_len), NO_POSITION, dtype=torch.long, device=self.device)
        self.by_position = False  # set by the first forward given positions: commits then hide overwritten slots
        self._hiding = False  # whether any slot may be hidden (set by a commit that hides, or by positions)
        self.n_pending = 0
        self._max_committed = 0  # host upper bound of int(length.max()), advanced by commit without a read
        self._same_length = True  # whether every sample's length is known on the host to equal the bound

    # ------------------------------------------------------------------ forward side
    def prepare(self, attend: torch.Tensor, m: int, valid: Optional[torch.Tensor] = None,
                positions: Optional[torch.Tensor] = None) -> CacheStep:
        """Mask and write slots for m new tokens. ``attend``: (m, P+m) or (B, m, P+m) bool over
        the existing pending entries then the new ones (P = ``n_pending``). ``valid`` (B,): how
        many of the m rows are real per sample (right-padded prompts of different lengths; the
        padded rows' outputs are never used). ``positions`` (B, m): visibility by position (the
        module docstring): committed entries at positions >= a query's are hidden from it."""
        B, P = self.batch_size, self.n_pending
        attend = attend.to(device=self.device, dtype=torch.bool)
        if attend.shape[-2:] != (m, P + m):
            raise ValueError(f"attend must be (.., {m}, {P + m}), got {tuple(attend.shape)}")
        if self.static:  # reads no host copy of the lengths: one graph per (m, P) under torch.compile
            if batch_invariant.active():
                raise ValueError("compiled decoding and deterministic.batch_invariant exclude each other")
            span = self.max_len
        else:
            span = self._max_committed + P + m
            if span > self.max_len:  # the bound may exceed what is committed: grow only if the entries need it
                span = self._true_max() + P + m
                if span > self.max_len:
                    self._grow(span)
        rel = self.slot_index[:span].unsqueeze(0) - self.length.unsqueeze(1)  # (B, span): pending index of slot
        committed = rel < 0
        if self._hiding:  # some committed slot may be hidden (host-known: only commit(hide=) and positions hide)
            committed = committed & ~self.hidden_slots[:, :span]
        # attend padded with a False column either side: column 0 stands for every committed or
        # free slot, so one gather reads the pending entries' attention and False elsewhere
        att = F.pad(attend, (1, 1)).expand(B, m, P + m + 2)
        idx = (rel.clamp(-1, P + m) + 1).unsqueeze(1).expand(B, m, span)
        pending = torch.gather(att, 2, idx)
        slots = self.length.unsqueeze(1) + self.slot_index[P : P + m]
        if positions is not None:
            if self.static:
                raise ValueError("visibility by position (row-parallel decoding) needs the eager cache (compile=false)")
            positions = positions.to(self.device, torch.long).expand(B, m)
            self.slot_pos.scatter_(1, slots, positions)
            self.by_position = self._hiding = True
            held = self.slot_pos[:, :span]
            replaced = (held.unsqueeze(2) == positions.unsqueeze(1)).any(2)  # a new entry takes this position
            seen = (committed & ~replaced).unsqueeze(1) & (held.unsqueeze(1) < positions.unsqueeze(2))
            mask = (seen | pending).unsqueeze(1)
        else:
            mask = (committed.unsqueeze(1) | pending).unsqueeze(1)
        start = None if self.static or not self._same_length else self._max_committed + P
        rows = spans = None
        if batch_invariant.active():  # each sample over exactly what it would see alone
            rows = [m] * B if valid is None else valid.cpu().tolist()
            spans = (self.length.cpu() + P + torch.tensor(rows, device="cpu")).tolist()
        if self.static:
            return CacheStep(mask=mask, slots=slots, span=span, static=True,
                             batch_index=torch.arange(B, device=self.device).unsqueeze(1))
        return CacheStep(mask=mask, slots=slots, span=span, start=start, rows=rows, spans=spans)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: CacheStep
    ) -> torch.Tensor:
        """Write the new k, v (B, H, m, D) as pending entries of ``layer`` and attend q (B, H, m, D)."""
        if step.static:  # index_put on the buffer itself: the compiled graph writes in place, no copy
            self.k[layer][step.batch_index, :, step.slots] = k.transpose(1, 2)
            self.v[layer][step.batch_index, :, step.slots] = v.transpose(1, 2)
        elif step.start is not None:
            m = k.shape[2]
            self.k[layer][:, :, step.start : step.start + m] = k
            self.v[layer][:, :, step.start : step.start + m] = v
        else:
            idx = step.slots[:, None, :, None].expand_as(k)
            self.k[layer].scatter_(2, idx, k)
            self.v[layer].scatter_(2, idx, v)
        keys = self.k[layer][:, :, : step.span]
        values = self.v[layer][:, :, : step.span]
        if step.spans is None:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=step.mask)
        out = torch.zeros_like(q)
        for b, (r, s) in enumerate(zip(step.rows, step.spans)):  # contiguous copies: alike alone or in a batch
            out[b : b + 1, :, :r] = F.scaled_dot_product_attention(
                q[b : b + 1, :, :r].contiguous(), keys[b : b + 1, :, :s].contiguous(),
                values[b : b + 1, :, :s].contiguous(), attn_mask=step.mask[b : b + 1, :, :r, :s].contiguous())
        return out

    def check_headroom(self, m: int, headroom: int) -> None:
        """A static cache never grows. Its owner sizes it so that every committed entry fits with
        ``headroom`` slots to spare; a forward of m tokens fits if the pending entries do (host
        ints only: no sync)."""
        if self.n_pending + m > headroom:
            raise ValueError(f"a forward of {m} tokens over {self.n_pending} pending ones needs more than the static "
                             f"KV cache's {headroom} spare slots: use a smaller draft tree (or compile=false)")

    def advance(self, m: int) -> None:
        """Call once after all layers attended a step of m tokens."""
        self.n_pending += m

    # ------------------------------------------------------------------ round end
    def commit(self, keep: Optional[torch.Tensor], n_keep: torch.Tensor, hide: Optional[torch.Tensor] = None) -> None:
        """Append pending entries ``keep[b, :n_keep[b]]`` (in that order) to sample b's committed
        region and drop all pending entries; ``keep=None``: the first ``n_keep[b]`` pending entries
        in order (they already sit where they are committed: nothing moves). ``hide`` (B, K) bool
        marks kept entries that later queries must not see. Reads nothing on the host: the host
        keeps an upper bound of the longest committed length (each commit adds at most
        min(K, pending)), which sizes the next forwards' attention span; ``n_keep`` is trusted
        (``COOLSD_CHECKS=1`` validates it: ``coolsd.engine.host_reads.host_checks``)."""
        B, P = self.batch_size, self.n_pending
        K = P if keep is None else min(keep.shape[1], P)  # n_keep <= P: columns beyond P are never kept
        added = K  # the most entries any sample commits now: the host bound's step
        n_keep = n_keep.to(self.device, torch.long)
        if host_checks() and bool(((n_keep < 0) | (n_keep > K)).any()):
            raise ValueError(f"n_keep must lie in [0, min({P} pending, {K} keep columns)]")
        if keep is None:
            if hide is not None or self.by_position:
                keep = torch.arange(P, device=self.device).expand(B, P)
            else:
                K = 0  # in place, nothing to unhide
        else:
            keep = keep.to(self.device, torch.long)
        if self.static:
            return self._commit_static(keep, n_keep, hide)
        if K > 0:
            j = torch.arange(K, device=self.device)
            valid = j.unsqueeze(0) < n_keep.unsqueeze(1)  # (B, K)
            src = self.length.unsqueeze(1) + keep[:, :K].clamp(0, P - 1)
            dst = self.length.unsqueeze(1) + j  # distinct per row, < length + P <= max_len
            S, _, H, _, D = self.kv.shape  # every layer's keys and values at once
            src_i = src[None, :, None, :, None].expand(S, B, H, K, D)
            dst_i = dst[None, :, None, :, None].expand(S, B, H, K, D)
            moved = torch.gather(self.kv, 3, src_i)  # a copy, so src/dst overlap is safe
            old = torch.gather(self.kv, 3, dst_i)
            self.kv.scatter_(3, dst_i, torch.where(valid[None, :, None, :, None], moved, old))
            self._unhide(dst, valid, hide, K)
            if self.by_position:
                self._move_positions(src, dst, valid)
        self.length += n_keep  # in place: the address stays put (see ``reset``)
        self.n_pending = 0
        self._max_committed += added  # host bound, no read
        if self.cap is not None and not self.by_position:  # by position, replaced entries stay committed (hidden)
            self._max_committed = min(self._max_committed, self.cap)
        self._same_length = False  # unknown without a read: later forwards write by scatter

    def _move_positions(self, src: torch.Tensor, dst: torch.Tensor, valid: torch.Tensor) -> None:
        """Carry the kept entries' positions to their committed slots, and hide every older
        committed entry at one of those positions (visibility by position: the newer entry replaces it)."""
        pos = torch.gather(self.slot_pos, 1, src)
        old_len = self.length.unsqueeze(1)  # before this commit's ``length += n_keep``
        span = min(self._max_committed, self.max_len) or 1
        older = torch.arange(span, device=self.device).unsqueeze(0) < old_len  # (B, span)
        same = (self.slot_pos[:, :span].unsqueeze(2) == torch.where(valid, pos, NO_POSITION).unsqueeze(1)).any(2)
        self.hidden_slots[:, :span] |= older & same & (self.slot_pos[:, :span] != NO_POSITION)
        self.slot_pos.scatter_(1, dst, torch.where(valid, pos, torch.gather(self.slot_pos, 1, dst)))

    def _unhide(self, dst: torch.Tensor, valid: torch.Tensor, hide: Optional[torch.Tensor], K: int) -> None:
        self._hiding = self._hiding or hide is not None
        h = torch.zeros_like(valid) if hide is None else hide[:, :K].to(self.device, torch.bool)
        old_h = torch.gather(self.hidden_slots, 1, dst)
        self.hidden_slots.scatter_(1, dst, torch.where(valid, h, old_h))

    def _commit_static(self, keep: torch.Tensor, n_keep: torch.Tensor, hide: Optional[torch.Tensor]) -> None:
        """``commit`` without reading a tensor on the host (traceable by torch.compile): kept
        entries always move (index_put on the buffers themselves), ``length`` is updated in place;
        ``n_keep`` is trusted (the loop computes it)."""
        P = self.n_pending
        K = 0 if keep is None else min(keep.shape[1], P)
        if K > 0:
            j = torch.arange(K, device=self.device)
            valid = j.unsqueeze(0) < n_keep.unsqueeze(1)  # (B, K)
            src = self.length.unsqueeze(1) + keep[:, :K].clamp(0, P - 1)
            dst = self.length.unsqueeze(1) + j
            b = torch.arange(self.batch_size, device=self.device).unsqueeze(1)
            keep_it = valid[:, :, None, None]
            for buf in (*self.k, *self.v):  # compiled, each buffer's gather, select and write fuse into one kernel
                moved = buf[b, :, src]  # (B, K, H, D), a copy (src/dst may overlap)
                buf[b, :, dst] = torch.where(keep_it, moved, buf[b, :, dst])
            self._unhide(dst, valid, hide, K)
        self.length += n_keep
        self.n_pending = 0

    def _true_max(self) -> int:
        """The longest committed length, read on the host (only when the bound would grow the
        cache), which then tightens the bound."""
        if self.batch_size:
            top = self.length.max()
            self._max_committed, same = torch.stack([top, (self.length == top).all().long()]).tolist()  # one read
            self._same_length = bool(same)
        return self._max_committed

    # ------------------------------------------------------------------ capacity
    def _grow(self, needed: int) -> None:
        """Reallocate the buffer to hold ``needed`` slots (rounded up to a multiple of 64): for a
        moment the old and the new buffer are both alive (one buffer holds every layer, so that a
        commit is a few ops). Owners size their caches to the sequence's known maximum
        (``max_committed`` and a round's pending entries), so this is a fallback that decoding with
        a correctly sized cache never reaches."""
        new_len = -(-needed // 64) * 64
        old_len = self.max_len
        self.k = self.v = None  # the views' references: the old buffer goes with ``kv`` below
        kv = self.kv.new_zeros(*self.kv.shape[:3], new_len, self.kv.shape[4])
        kv[:, :, :, :old_len] = self.kv
        self.kv = kv
        self._views()
        hidden = torch.zeros(self.batch_size, new_len, dtype=torch.bool, device=self.device)
        hidden[:, :old_len] = self.hidden_slots  # slots beyond the old end are free: not hidden
        self.hidden_slots = hidden
        pos = torch.full((self.batch_size, new_len), NO_POSITION, dtype=torch.long, device=self.device)
        pos[:, :old_len] = self.slot_pos
        self.slot_pos = pos
        self.slot_index = torch.arange(new_len, device=self.device)


