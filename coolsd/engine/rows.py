"""Row-parallel decoding (docs/methods.md section 8.1): ZipAR (arXiv 2412.04062, ThisisBillhe/ZipAR).

A row of the image grid starts before the row above is finished; every forward advances every
active row by one token, each sampled from the target's distribution given what its query can see.
The schedule does not depend on the tokens, so it is computed once per grid (``zipar_schedule``)
and every sample of a batch runs the same forwards.

What a query sees (``KVCache``'s visibility by position): the entries at EARLIER logical positions
that exist when it runs (the condition, every token fed before, and this forward's tokens at
positions <= its own), nothing of the not-yet-decoded context. A token fed at a position that an
older entry holds replaces that entry for every later query. Upstream differs in one detail: its
LlamaGen code attends its zero-initialised static cache at every slot <= p, so each not-yet-decoded
slot is a key and value of zeros that takes softmax mass (``generate_zipar.py`` /
``gpt.py`` ``KVCache``); here those slots are masked out. docs/methods.md section 8.1 says why.

Upstream's schedule, as ``decode_n_tokens_zipar`` runs it on an H x W grid with window w:
row 0 is plain AR; row 1 starts when row 0 is complete (its first query is row 0's last token,
fed at its own position); row r+1 (r >= 1) starts in the forward after row r reaches w tokens: its
first query is an auxiliary copy of the latest token of row r-1, fed at the position of row r's
last token (so it predicts row r+1's first token); when a row completes, its last token is fed
once more in the next forward (its entry then replaces the auxiliary one), its output unused.

Lossy by construction: a token of row r+1 is drawn without the right part of row r. The per-token
signal is exact: after the image is done (outside the timed loop), one teacher-forced forward
gives the target's distribution p_t(. | x_<t) at every position, and ``step_tv`` = TV(q_t, p_t)
for the q_t each token was drawn from (0 for row 0 and row 1, whose queries see the whole raster prefix).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from coolsd.engine.decoding.distortion import expected_nll, kl, tv
from coolsd.engine.decoding.rules import ExactRule
from coolsd.engine.decoding.sampling import sample_inverse_cdf
from coolsd.engine.drafting import register_drafter
from coolsd.engine.generation_result import GenerationResult, _check_finite
from coolsd.engine.signals import DEPTH, KL, NLL, OFF, TOKEN_SIGNALS, TV, XNLL, target_log_probs


@dataclass(frozen=True)
class RowStep:
    """One forward: ``fed`` (m,) the image-token index whose token each query feeds, ``positions``
    (m,) the logical position it is fed at, ``sample`` (m,) the image-token index its output draws
    (-1: the output is unused)."""

    fed: tuple[int, ...]
    positions: tuple[int, ...]
    sample: tuple[int, ...]


def zipar_schedule(height: int, width: int, window: int) -> list[RowStep]:
    """ZipAR's forwards after the prefill (which draws token 0) on a ``height`` x ``width`` grid
    (the module docstring), each row starting ``window`` tokens behind the row above."""
    if not 1 <= window < width:
        raise ValueError(f"zipar window must be in [1, {width - 1}] (the grid is {width} tokens wide), got {window}")
    W = width
    steps = [RowStep((j,), (j,), (j + 1,)) for j in range(W - 1)]  # row 0: plain AR
    if height == 1:
        return steps
    count = [W] + [0] * (height - 1)  # tokens decoded per row
    aux = {}  # row -> image index of its auxiliary first query's token
    active = [1]
    finished = None  # a row completed in the last forward: feed its last token once more
    while active:
        fed, pos, smp = [], [], []
        if finished is not None:
            last = (finished + 1) * W - 1
            fed.append(last), pos.append(last), smp.append(-1)
            finished = None
        for r in active:
            c = count[r]
            if c == 0:
                fed.append(aux.get(r, r * W - 1)), pos.append(r * W - 1)
            else:
                fed.append(r * W + c - 1), pos.append(r * W + c - 1)
            smp.append(r * W + c)
        steps.append(RowStep(tuple(fed), tuple(pos), tuple(smp)))
        started = []
        for r in list(active):
            count[r] += 1
            if count[r] == window and r + 1 < height and r + 1 not in active and r + 1 not in started:
                aux[r + 1] = (r - 1) * W + count[r - 1] - 1  # the latest token of row r-1 (counted already)
                started.append(r + 1)
            if count[r] == W:
                finished = r
                active.remove(r)
        active += started
    return steps


def visibility(steps: list[RowStep]) -> torch.Tensor:
    """(E, E) bool over every entry the schedule feeds, in feed order: whether entry e's query
    sees entry e' (an independent statement of the rule ``KVCache`` implements by position: e' was
    fed before e at an earlier position and no entry fed before e replaced it, or e' is in e's own
    forward at a position <= e's). Row 0's entries (fed one per forward) included."""
    pos, it = [], []
    for k, s in enumerate(steps):
        pos += list(s.positions)
        it += [k] * len(s.positions)
    E = len(pos)
    out = torch.zeros(E, E, dtype=torch.bool, device="cpu")  # a host-side statement of the rule
    for e in range(E):
        for f in range(E):
            if it[f] == it[e]:
                out[e, f] = pos[f] <= pos[e]
            elif it[f] < it[e] and pos[f] < pos[e]:
                out[e, f] = not any(pos[g] == pos[f] and it[f] < it[g] <= it[e] for g in range(E))
    return out


class RowParallel:
    """The decoding state a row-parallel method runs with (``coolsd.engine.drafting`` kind ``rows``):
    the grid width and the window; ``speculative_generate`` hands a round of rows to
    ``row_parallel_generate``."""

    def __init__(self, window, grid_width: int):
        """``window`` None: upstream's 8 (LlamaGen-ZipAR's ``zipar_window_size``), or half a row on
        rows of fewer than 16 tokens (the toy world's 8)."""
        self.grid_width = int(grid_width)
        self.window = min(8, self.grid_width // 2) if window is None else int(window)

    def own_loop(self, target, n_tokens: int, rng, sampling, cond, batch_size: int, sync, distortion: bool):
        """``speculative_generate`` hands a drafter with an ``own_loop`` the whole generation: here
        ``row_parallel_generate``."""
        return row_parallel_generate(target, n_tokens, rng, self, sampling, cond, batch_size, sync, distortion)

    def schedule(self, n_tokens: int) -> list[RowStep]:
        if n_tokens % self.grid_width:
            raise ValueError(f"zipar needs whole rows: {n_tokens} image tokens is not a multiple of the grid width "
                             f"{self.grid_width}")
        return zipar_schedule(n_tokens // self.grid_width, self.grid_width, self.window)


@register_drafter("rows", row_parallel=True)
def _rows(method, draft_model, sampling, vocab_size, token_range, grid_width):
    if not grid_width:
        raise ValueError(f"method {method.name!r} decodes rows of an image grid; this target has no grid width")
    return RowParallel(method.params["window"], grid_width)


@register_drafter("pjd", row_parallel=True)
def _pjd(method, draft_model, sampling, vocab_size, token_range, grid_width):
    if not grid_width:
        raise ValueError(f"method {method.name!r} decodes rows of an image grid; this target has no grid width")
    p = method.params
    return PJDRows(p["window"], p["start"], grid_width, vocab_size, token_range, p["keep_above"])


def row_parallel_generate(target, n_tokens: int, rng, rows: RowParallel, sampling, cond, batch_size: int,
                          sync, distortion: bool):
    """``speculative_generate`` for a row-parallel method: the schedule's forwards, each token drawn
    by inverse CDF from the target's warped distribution at its query (``sampling.probs``), one
    uniform per query per forward from each sample's stream; then, outside ``seconds``, the exact
    per-token signals from a teacher-forced forward (the module docstring)."""

    if not getattr(target, "row_parallel", False):
        raise ValueError(f"row-parallel decoding needs a target whose forward takes by_position=True; "
                         f"{type(target).__name__} has none (toy, llamagen_xl, janus_pro, janus_pro_7b)")
    steps = rows.schedule(n_tokens)
    B, dev = batch_size, torch.device(getattr(target, "device", "cpu"))  # where the loop's state lives
    # every forward's index and mask tensors, made once: a round makes no tensor from Python data and
    # reads the host once (the finite check), as the one loop's rounds (docs/gpu.md)
    S, M = len(steps), max(len(s.fed) for s in steps)
    pad = lambda xs, v=0: list(xs) + [v] * (M - len(xs))  # noqa: E731
    outs = [[i for i, j in enumerate(s.sample) if j >= 0] for s in steps]
    table = torch.tensor([[pad(s.fed), pad(s.positions), pad(o), pad([s.sample[i] for i in o])]
                          for s, o in zip(steps, outs)], device=dev)  # (S, 4, M): one tensor for the whole schedule
    masks = torch.tensor([[pad([b <= a for b in s.positions], False) for a in pad(s.positions)] for s in steps],
                         device=dev)
    ms = torch.tensor([len(s.fed) for s in steps], device=dev).unsqueeze(1).expand(S, B)
    firsts = table[:, 3, :1].expand(S, B)
    ar = torch.arange(M, device=dev).expand(B, M)
    plan = [(table[k, 0, :m], table[k, 1, :m].expand(B, m), masks[k, :m, :m], ar[:, :m], ms[k],
             table[k, 2, :len(o)], table[k, 3, :len(o)], firsts[k])
            for k, (m, o) in enumerate((len(s.fed), o) for s, o in zip(steps, outs))]
    sync()
    t0 = time.perf_counter()
    prefill = target.begin(cond, B)
    if prefill is None:
        raise ValueError("row-parallel decoding needs a conditioned target (the first token comes from the prefill)")
    buf = torch.zeros(B, n_tokens, dtype=torch.long, device=dev)
    q = torch.zeros(B, n_tokens, target.vocab_size, dtype=torch.float64, device=dev) if distortion else None
    everyone = torch.ones(B, dtype=torch.bool, device=dev)
    _check_finite(prefill.logits[:, -1:], torch.zeros(B, dtype=torch.long, device=dev), everyone)
    p0 = sampling.probs(prefill.logits[:, -1:])[:, 0]
    buf[:, 0] = sample_inverse_cdf(p0, rng.uniform(1)[:, 0])
    if distortion:
        q[:, 0] = p0
    for fed, positions, attend, keep, n_keep, outs, cols, first in plan:
        out = target.forward(buf[:, fed], positions, attend, by_position=True)
        target.commit(keep, n_keep)
        u = rng.uniform(fed.shape[0])
        logits = out.logits[:, outs]
        _check_finite(logits, first, everyone)
        p = sampling.probs(logits)
        buf[:, cols] = sample_inverse_cdf(p, u[:, outs])
        if distortion:
            q[:, cols] = p.to(q.dtype)
    lengths = [sum(j >= 0 for j in s.sample) for s in steps]
    return _result(target, cond, buf, sampling, sync, t0, [list(lengths) for _ in range(B)], [1 + len(steps)] * B,
                   distortion, q)


def _result(target, cond, buf, sampling, sync, t0: float, lengths: list, forwards: list, distortion: bool, q=None):
    """The ``GenerationResult`` of a row-parallel run that started at ``t0``: ``seconds`` stops
    here; then, outside it (``signal_s``), the per-token signals from one teacher-forced forward:
    all of them where ``q`` (B, N, V), the distributions the tokens were drawn from, is known,
    those that need only the target's where it is not (PJD)."""
    sync()
    seconds = time.perf_counter() - t0
    B, N = buf.shape
    dist = torch.full((B, len(TOKEN_SIGNALS), N), float("nan"), dtype=torch.float64, device=buf.device)
    extra = {}
    if distortion:
        t1 = time.perf_counter()
        _signals(target, cond, buf, sampling, dist, q)
        sync()
        extra["signal_s"] = time.perf_counter() - t1
    return GenerationResult(
        tokens=buf, round_lengths=lengths, target_forwards=forwards, draft_forwards=0, seconds=seconds,
        first_from_prefill=True, extra=extra, step_tv=dist[:, TV], step_kl=dist[:, KL], token_nll=dist[:, NLL],
        token_nll_expected=dist[:, XNLL], token_off_support=dist[:, OFF], token_depth=dist[:, DEPTH])


def teacher_forced_logits(target, cond, tokens: torch.Tensor) -> torch.Tensor:
    """(B, N, V): the target's logits for every image token given the whole raster prefix (one
    prefill and one causal forward over tokens[:, :-1])."""
    B, N = tokens.shape
    dev = tokens.device
    first = target.begin(cond, B).logits[:, -1:]
    if N == 1:
        return first
    ar = torch.ones(N - 1, N - 1, dtype=torch.bool, device=dev).tril()
    rest = target.forward(tokens[:, :-1], torch.arange(N - 1, device=dev).expand(B, -1), ar).logits
    target.commit(None, torch.zeros(B, dtype=torch.long, device=dev))
    return torch.cat([first, rest.to(first.dtype)], 1)


SIGNAL_CHUNK = 64  # image positions whose float64 (B, chunk, V) distributions the signals hold at once


def _signals(target, cond, tokens, sampling, dist, q=None) -> None:
    """Each token's signals from one teacher-forced forward (``teacher_forced_logits``): its NLL under
    the target's p_t(. | x_<t), whether it lies off p_t's warped support, depth 0 (no verification);
    where ``q`` (B, N, V), the distributions the tokens were drawn from, is given, also TV and KL of
    q_t to p_t and the NLL's expectation under q_t (docs/distortion.md). The float64 distributions are
    formed ``SIGNAL_CHUNK`` positions at a time: (B, N, V) of them at once would be 75 MB a sample
    at Janus-Pro's 576 x 16,384 (every step is per position, so chunks change no value)."""
    logits = teacher_forced_logits(target, cond, tokens)
    x = tokens.to(logits.device).unsqueeze(-1)
    N = tokens.shape[1]
    for a in range(0, N, SIGNAL_CHUNK):
        b = min(a + SIGNAL_CHUNK, N)
        p = sampling.probs(logits[:, a:b]).to(torch.float64)
        logp = target_log_probs(logits[:, a:b], sampling).to(torch.float64)
        dist[:, NLL, a:b] = -logp.gather(-1, x[:, a:b])[..., 0].cpu()
        dist[:, OFF, a:b] = (p.gather(-1, x[:, a:b])[..., 0] <= 0).to(torch.float64).cpu()
        if q is not None:
            qc = q[:, a:b].to(p.device)
            dist[:, TV, a:b] = tv(qc, p).cpu()
            dist[:, KL, a:b] = kl(qc, p).cpu()
            dist[:, XNLL, a:b] = expected_nll(qc, logp).cpu()
    dist[:, DEPTH] = 0.0


# ---------------------------------------------------------------------------------------------- PJD
PJD_MAX_INPUTS = 8  # a row's anchor and at most 7 drafts a forward (upstream's window_size)


class PJDRows:
    """The state a PJD run carries (``coolsd.engine.drafting`` kind ``pjd``): the grid width, the
    window (anchor + drafts a row feeds at most), ``start``, the committed tokens of row r after
    which row r+1 becomes active (upstream's c = 8), and ``keep_above``: after a row's first
    rejection, a later draft stays the next forward's draft if its acceptance probability exceeds
    it (upstream 0.5; None: never, the fresh sample as SJD)."""

    def __init__(self, window: int, start: int, grid_width: int, vocab_size: int, token_range=None,
                 keep_above=0.5):
        self.window, self.start, self.grid_width = int(window), int(start), int(grid_width)
        self.keep_above = keep_above
        self.token_range = token_range or (0, vocab_size)
        if not 1 <= self.start:
            raise ValueError(f"pjd start must be >= 1, got {start}")

    def own_loop(self, target, n_tokens: int, rng, sampling, cond, batch_size: int, sync, distortion: bool):
        """The whole generation (``RowParallel.own_loop``): ``pjd_generate``."""
        return pjd_generate(target, n_tokens, rng, self, sampling, cond, batch_size, sync, distortion)


class _Row:
    """One active row of one sample: its index, its next window size (anchor + drafts) and the
    drafts (token, q or None for a uniform top-up) it carries to the next forward."""

    def __init__(self, r: int, v: int):
        self.r, self.v, self.drafts = r, v, []


def _aux_token(buf_b, n: list, k: int, W: int) -> int:
    """The token a row k's first anchor feeds at the position of row k-1's last token while that
    token is not decoded: the latest committed token of row k-2 (ZipAR-LlamaGen's rule), of row 0
    for k = 1; row k-1's real last token once it is decoded."""
    if n[k - 1] == W:
        return int(buf_b[k * W - 1])
    src = max(k - 2, 0)
    return int(buf_b[src * W + n[src] - 1])


class RowVerdict(NamedTuple):
    """What one PJD row's verification decided: ``committed`` (the tokens it emits, in order),
    ``drafts`` (the next forward's drafts at the positions after them: (token, the q it is tested
    with)), ``residual`` (the distribution the top row's correction was drawn from, None if none)."""
    committed: list
    drafts: list
    residual: torch.Tensor | None


def pjd_verify_row(ps, drafts, u_accept, u_resid, u_sample, top: bool, keep_above, rule) -> RowVerdict:
    """One row of a PJD forward (docs/methods.md section 8.2, "Verification"). ``ps`` (v, V): the
    target's distributions at the row's v inputs (the anchor, then ``drafts``; ``ps[j]`` predicts
    the position after input j); ``drafts``: v - 1 pairs (token, q or None for a one-hot top-up);
    ``u_accept`` (v - 1,) draft j's test uniform; ``u_resid`` the residual draw's uniform;
    ``u_sample`` (v,) the target samples' uniforms, by inverse CDF (``sample_inverse_cdf``).

    Draft j is accepted while ``u < min(1, p_{j-1}(d_j) / q_j(d_j))`` (``rule``). The top row is
    SJD: the first rejection emits a draw from ``Norm([p_{j-1} - q_j]_+)``, all accepted emits the
    last output's sample. A lower row emits only its accepted drafts; its sample at the first
    rejected position is the next draft there. After the first rejection a draft with acceptance
    probability above ``keep_above`` stays the next draft with its q (None: the fresh sample)."""
    v = ps.shape[0]
    samples = [int(sample_inverse_cdf(ps[j], u_sample[j])) for j in range(v)]
    committed, nxt, rejected, residual = [], [], False, None
    for j, (d, q) in enumerate(drafts, 1):
        qv = q if q is not None else torch.zeros_like(ps[0]).index_fill_(0, torch.tensor(d, device=ps.device), 1.0)
        f, resid = rule.step(ps[j - 1].unsqueeze(0), qv.unsqueeze(0), torch.tensor([d], device=ps.device), 1)
        f = float(f)
        if not rejected and float(u_accept[j - 1]) < f:
            committed.append(d)
        elif not rejected:
            rejected = True
            if top:  # SJD at the top row: the residual's sample replaces the draft
                residual = resid[0] / resid[0].sum() if float(resid[0].sum()) > 0 else ps[j - 1]
                committed.append(int(sample_inverse_cdf(residual, u_resid)))
            else:  # a lower row: the sample here is the next forward's draft
                nxt.append((samples[j - 1], ps[j - 1]))
        else:  # after the first rejection: the old draft stays a draft if f > keep_above (upstream 1/2)
            keep_old = keep_above is not None and f > keep_above
            nxt.append((d, qv) if keep_old else (samples[j - 1], ps[j - 1]))
    if top and not rejected:  # every draft accepted: the bonus token
        committed.append(samples[v - 1])
    else:  # the last output's sample is a draft of the next forward (a lower row's would-be bonus)
        nxt.append((samples[v - 1], ps[v - 1]))
    return RowVerdict(committed, nxt, residual)


def pjd_generate(target, n_tokens: int, rng, pjd: PJDRows, sampling, cond, batch_size: int, sync, distortion: bool):
    """PJD (docs/methods.md section 8.2) through the target's cache with visibility by position.

    Each sample runs its own schedule (it depends on what is accepted); a forward holds every
    sample's inputs, padded to the longest with entries no query sees and no commit keeps. Each
    sample draws a fixed number of uniforms a forward from its own stream (3 per possible input),
    so a batch never changes a sample's draws. Host reads every forward (the acceptance tests
    decide the next inputs): eager only."""
    if not getattr(target, "row_parallel", False):
        raise ValueError(f"PJD needs a target whose forward takes by_position=True; {type(target).__name__} has none "
                         f"(toy, llamagen_xl, janus_pro, janus_pro_7b)")
    W = pjd.grid_width
    if n_tokens % W:
        raise ValueError(f"pjd needs whole rows: {n_tokens} image tokens is not a multiple of the grid width {W}")
    H, B, rule, dev = n_tokens // W, batch_size, ExactRule(), torch.device(getattr(target, "device", "cpu"))
    lo, hi = pjd.token_range
    cap = 1 + H * pjd.window  # the most inputs a sample feeds a forward (an extra token, every row's window)
    sync()
    t0 = time.perf_counter()
    prefill = target.begin(cond, B)
    if prefill is None:
        raise ValueError("PJD needs a conditioned target (the first token comes from the prefill)")
    buf = torch.zeros(B, n_tokens, dtype=torch.long, device=dev)
    n_out = torch.zeros(B, dtype=torch.long, device=dev)
    _check_finite(prefill.logits[:, -1:], n_out, torch.ones(B, dtype=torch.bool, device=dev))
    p0 = sampling.probs(prefill.logits[:, -1:])[:, 0]
    buf[:, 0] = sample_inverse_cdf(p0, rng.uniform(1)[:, 0]).to(buf.device)
    n = [[1] + [0] * (H - 1) for _ in range(B)]  # committed tokens per row
    rows = [[_Row(0, min(W - 1, pjd.window))] for _ in range(B)]
    finished = [None] * B  # a row completed in the last forward: its last token is fed once more (KV only)
    forwards, lengths = [1] * B, [[] for _ in range(B)]
    host = buf.cpu()
    while any(rows[b] or finished[b] is not None for b in range(B)):
        u = rng.uniform(3 * cap).cpu()  # (B, 3 cap): draft tokens, acceptance tests, target samples
        plans = []
        for b in range(B):
            plan = []  # (kind, row, j, token, position)
            extra = None if finished[b] is None else (finished[b] + 1) * W - 1
            finished[b] = None  # fed once: as the extra entry, or as the anchor below
            # a row whose first anchor sits at the completed row's last position feeds that very token
            # (``_aux_token``): its anchor is the entry. It is the top row then, which commits >= 1
            # token, so the entry is kept.
            if extra is not None and all(n[b][x.r] > 0 or x.r * W - 1 != extra for x in rows[b]):
                plan.append(("extra", None, 0, int(host[b, extra]), extra))
            for row in rows[b]:
                r, c = row.r, n[b][row.r]
                apos = r * W + c - 1
                tok = int(host[b, apos]) if c > 0 else _aux_token(host[b], n[b], r, W)
                plan.append(("anchor", row, 0, tok, apos))
                need = row.v - 1
                row.drafts = row.drafts[:need]
                k = 0
                while len(row.drafts) < need:  # top up with uniform random tokens (q one-hot)
                    t = lo + min(int(u[b, len(plan) + k] * (hi - lo)), hi - lo - 1)
                    row.drafts.append((t, None))
                    k += 1
                for j, (t, _) in enumerate(row.drafts, 1):
                    plan.append(("draft", row, j, t, apos + j))
            plans.append(plan)
        m = max(len(p) for p in plans)
        if m == 0:
            break
        # the forward's inputs are filled entry by entry on the host, then moved in one copy each
        tokens = torch.zeros(B, m, dtype=torch.long, device="cpu")
        positions = torch.full((B, m), -1, dtype=torch.long, device="cpu")
        attend = torch.zeros(B, m, m, dtype=torch.bool, device="cpu")
        for b, plan in enumerate(plans):
            for i, (kind, row, j, tok, pos) in enumerate(plan):
                tokens[b, i], positions[b, i] = tok, pos
                for i2, (kind2, row2, _, _, pos2) in enumerate(plan):
                    # a query sees this forward's entries at positions <= its own: its own row's, and
                    # the other rows' anchors and the extra token, never their drafts
                    attend[b, i, i2] = pos2 <= pos and (row2 is row or kind2 != "draft")
            for i in range(len(plan), m):
                positions[b, i] = n_tokens + 1  # padding: after every real entry, seen by nobody, never kept
        out = target.forward(tokens.to(dev), positions.to(dev), attend.to(dev), by_position=True)
        live = torch.tensor([bool(p) for p in plans], device=dev)
        _check_finite(out.logits, torch.tensor([sum(r) for r in n], device=dev), live)
        probs = sampling.probs(out.logits).double().cpu()
        keep = torch.zeros(B, m, dtype=torch.long, device="cpu")  # filled on the host, moved once
        n_keep = torch.zeros(B, dtype=torch.long, device="cpu")
        for b, plan in enumerate(plans):
            if not plan:
                continue
            forwards[b] += 1
            kept, drawn = [], 0
            if plan[0][0] == "extra":
                kept.append(0)
            i = 0
            while i < len(plan):
                kind, row, _, _, apos = plan[i]
                if kind != "anchor":
                    i += 1
                    continue
                top = row is rows[b][0]
                us = u[b, cap + i : cap + i + row.v]  # us[0]: the residual's draw, us[j]: draft j's test
                verdict = pjd_verify_row(probs[b, i : i + row.v], row.drafts, us[1:], us[0],
                                         u[b, 2 * cap + i : 2 * cap + i + row.v], top, pjd.keep_above, rule)
                committed, nxt = verdict.committed, verdict.drafts
                mc = len(committed)
                base = row.r * W + n[b][row.r]
                for k, t in enumerate(committed):
                    host[b, base + k] = t
                kept += list(range(i, i + mc))  # the anchor and the accepted drafts before the last committed token
                n[b][row.r] += mc
                drawn += mc
                row.drafts = nxt
                i += row.v
            # windows of the next forward, rows that start, rows that finish
            for k, row in enumerate(rows[b]):
                left = W - n[b][row.r]
                above = n[b][row.r - 1] if row.r > 0 else W
                row.v = min(left, pjd.window) if k == 0 else min(above - n[b][row.r], pjd.window, left)
            for row in list(rows[b]):
                r = row.r
                # a row starts once the one above has ``start`` tokens, at the latest when it is complete
                if n[b][r] >= min(pjd.start, W) and r + 1 < H and all(x.r != r + 1 for x in rows[b]) and n[b][r + 1] == 0:
                    rows[b].append(_Row(r + 1, min(n[b][r], pjd.window)))
            if rows[b] and n[b][rows[b][0].r] == W:
                done = rows[b].pop(0)
                finished[b] = done.r if done.r + 1 < H else None
                if rows[b]:
                    rows[b][0].v = min(W - n[b][rows[b][0].r], pjd.window)
            keep[b, : len(kept)] = torch.tensor(kept, dtype=torch.long, device="cpu")
            n_keep[b] = len(kept)
            lengths[b].append(drawn)
        target.commit(keep.to(dev), n_keep.to(dev))
    # TV, KL and E[NLL] have no closed form here (docs/methods.md section 8.2): q unknown
    return _result(target, cond, host.to(buf.device), sampling, sync, t0, lengths, forwards, distortion)
