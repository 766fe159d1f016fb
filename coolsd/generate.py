"""The one generation loop (METHODS.md 1.3, 4): every discrete method runs through here.

Round: the drafter proposes a tree rooted at the last emitted token; ONE target forward scores
the root and every node under the tree mask; ``verify_tree`` walks it with the method's rule;
the target commits the root and the accepted path; the drafter observes the result.
Plain AR is the same loop with the empty tree (tau = 1).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from coolsd.decoding.distortion import chain_distortion, expected_nll, lossless
from coolsd.decoding.rules import Rule
from coolsd.decoding.sampling import sample_inverse_cdf
from coolsd.decoding.trees import EMPTY_TREE, Tree
from coolsd.compiled import compiled_for
from coolsd.decoding.verify import verify_tree
from coolsd.drafting import RoundInfo, SamplingConfig
from coolsd.protocols import ARModel
from coolsd.timing import IntervalTimer


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # (B, N)
    round_lengths: list[list[int]]  # per sample: tokens emitted in each round
    target_forwards: list[int]  # per sample: target forwards incl. prefill
    draft_forwards: int  # drafter forwards for the whole batch
    seconds: float  # wall time of the loop (prefill included, decoding to pixels excluded)
    first_from_prefill: bool = True
    # "signal_s": the eager loop's time on the quality signals (seconds, device-timed: CUDA events),
    # inside ``seconds``; absent for compiled rounds (their signals are fused into the round)
    extra: dict = field(default_factory=dict)
    # (B, N) per emitted token: TV and KL of the distribution it was emitted from to the target's
    # (coolsd.decoding.distortion, docs/distortion.md); 0 for tokens drawn from p (AR, bonus, lossless
    # rules), NaN for trees with siblings (no closed form)
    step_tv: Optional[torch.Tensor] = None
    step_kl: Optional[torch.Tensor] = None
    # (B, N) per emitted token: -log p(x_t) under the target's guided distribution at the sampling
    # temperature, before top-k / top-p (``token_nll``); whether x_t lies outside the warped support
    # (``token_off_support``, 0/1: a relaxed rule can accept such a token); the round depth it was
    # verified at (``token_depth``: 1..L, 0 for a token drawn from p: the first, a bonus, AR);
    # ``token_nll_expected``: E[-log p(x_t) | prefix, round] = -sum_y pi_t(y) log p(y), the exact
    # conditional expectation of ``token_nll`` (the same mean, without the token draw's noise;
    # docs/distortion.md section 6), NaN where pi_t has no closed form (verified sibling nodes)
    token_nll: Optional[torch.Tensor] = None
    token_nll_expected: Optional[torch.Tensor] = None
    token_off_support: Optional[torch.Tensor] = None
    token_depth: Optional[torch.Tensor] = None

    def accepted_length(self, b: int) -> float:
        """tau: mean tokens per verification round (METHODS.md 0)."""
        r = self.round_lengths[b]
        return sum(r) / len(r) if r else float("nan")


class NonFiniteLogits(FloatingPointError):
    """The target produced NaN or inf logits for ``sample`` while predicting image token
    ``position`` (the sample cannot continue; a job records it as failed and goes on)."""

    def __init__(self, sample: int, position: int):
        super().__init__(f"non-finite (nan/inf) target logits for sample {sample} at image token position {position}")
        self.sample, self.position = sample, position


def _nonfinite(logits: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """(B,) active samples whose logits (B, m, V) are not all finite (no host read)."""
    return ~torch.isfinite(logits).all(-1).all(-1) & active.to(logits.device)


def _check_finite(logits: torch.Tensor, n_out: torch.Tensor, active: torch.Tensor) -> None:
    """logits (B, m, V): every active sample's rows must be finite (one reduction, one sync)."""
    bad = _nonfinite(logits, active)
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        raise NonFiniteLogits(b, int(n_out[b]))


def speculative_generate(
    target: ARModel,
    n_tokens: int,
    rng,
    *,
    rule: Optional[Rule] = None,
    drafter=None,
    tree: Tree = EMPTY_TREE,
    sampling: SamplingConfig = SamplingConfig(),
    cond: Any = None,
    batch_size: int = 1,
    bos_token: Optional[int] = None,
    sync: Callable[[], None] = lambda: None,
    distortion: bool = True,
) -> GenerationResult:
    """Generate ``n_tokens`` per sample.

    If ``bos_token`` is None the first token is sampled from the prefill output and is not a
    round (EAGLE/LANTERN convention); otherwise the first round is rooted at ``bos_token``
    (the theory lab: generation from the empty prefix, every token from a round).
    ``rng`` gives uniforms per sample (``coolsd.decoding.rng``: counter-based, computed on the
    target's device, the same values on every device).

    ``distortion``: record each emitted token's quality signals (exact distortion ``step_tv`` /
    ``step_kl``, docs/distortion.md; ``token_nll``, ``token_nll_expected``, ``token_off_support``,
    ``token_depth``); False
    skips that work and leaves them NaN (to measure what it costs).

    The loop's state lives on the target's device (``target.device``; the CPU if it has none):
    on another device the loop runs under ``torch.device(...)`` (factory calls allocate there),
    with the tree and the rule moved there and the uniforms computed there. Untested on a GPU so far.
    """
    dev = torch.device(getattr(target, "device", "cpu"))
    rng = rng.on(dev)  # counter-based streams computed on the target's device (coolsd.decoding.rng)
    rule = rule.on(dev) if rule is not None else None
    if dev.type != "cpu":
        with torch.device(dev):
            return _generate(target, n_tokens, rng, rule, drafter, tree.on(dev), sampling, cond, batch_size,
                             bos_token, sync, distortion)
    return _generate(target, n_tokens, rng, rule, drafter, tree, sampling, cond, batch_size, bos_token, sync, distortion)


def _generate(target, n_tokens, rng, rule, drafter, tree, sampling, cond, batch_size, bos_token, sync, distortion):
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    if drafter is None:
        tree = EMPTY_TREE
    if rule is None and tree.n_nodes > 0:
        raise ValueError("a drafted tree needs an acceptance rule")
    B = batch_size
    sync()
    t0 = time.perf_counter()
    prefill = target.begin(cond, B)
    compiled = getattr(target, "compiled", False)
    # the round's in-place state: buf (tokens, then a dump column), dist (per-token signals, channels
    # TOKEN_SIGNALS), n_out, t_len (committed target entries after the condition), forwards, root
    ws = _workspace(target, compiled, B, n_tokens + tree.max_depth + 2, distortion)
    buf, dist, n_out, t_len, forwards, root, log = (ws[k] for k in ("buf", "dist", "n_out", "t_len", "forwards",
                                                                     "root", "log"))
    forwards.fill_(1 if prefill is not None else 0)
    if bos_token is None:
        if prefill is None:
            raise ValueError("a target without a condition needs bos_token")
        _check_finite(prefill.logits[:, -1:], n_out, torch.ones(B, dtype=torch.bool))
        u0 = rng.uniform(1)[:, 0]
        p0 = sampling.probs(prefill.logits[:, -1:])  # (B, 1, V): the first token's distribution
        root.copy_(sample_inverse_cdf(p0[:, 0], u0))
        buf[:, 0] = root
        n_out += 1
    else:
        root.fill_(int(bos_token))
    n_out0 = 0 if bos_token is not None else 1
    if drafter is not None:
        drafter.begin(cond, B, root.clone(), prefill, n_tokens=n_tokens)
    round_fn = compiled_for(target, "round", verify_round) if compiled else verify_round
    # the first token comes from p (no distortion, on the support, depth 0); NaN throughout if not asked for
    if distortion and bos_token is None:  # the first token's NLL and its expectation (drawn from p), from the prefill
        logp0 = target_log_probs(prefill.logits[:, -1:], sampling)
        dist[:, NLL, 0] = -logp0[:, 0].gather(1, buf[:, :1])[:, 0].to(dist.dtype)
        dist[:, XNLL, 0] = expected_nll(p0, logp0)[:, 0].to(dist.dtype)
    # compiled rounds write their signals in the round (static shapes); eager rounds keep the
    # round's inputs and compute them for many rounds at once (_DeferredSignals): same function
    sink = (dist if compiled else _DeferredSignals(dist, tree, rule, sampling)) if distortion else None
    n1 = tree.n_nodes + 1
    more = n_out0 < n_tokens  # host-known: every sample starts with the same count
    rounds = 0
    emitted = [n_out0] * B  # each sample's tokens so far, host-known (from the last round's read)
    while more:
        active = n_out < n_tokens
        remaining = n_tokens - n_out
        max_depth = torch.clamp(remaining, max=tree.max_depth) if tree.n_nodes else torch.zeros_like(remaining)
        cap = drafter.depth_cap(n_out) if drafter is not None else None
        if cap is not None:
            max_depth = torch.minimum(max_depth, cap)
        max_depth = torch.where(active, max_depth, torch.zeros_like(max_depth))
        u_accept = rng.uniform(n1)
        u_emit = rng.uniform(1)[:, 0]
        if drafter is not None:  # every active sample emits >= 1 token a round: a host bound of max_depth.max()
            depth_bound = max(0, min(tree.max_depth, n_tokens - n_out0 - rounds))
            tokens, q = drafter.propose(tree, rng, max_depth, depth_bound=depth_bound, emitted=emitted)
        else:
            tokens, q = root.unsqueeze(1).clone(), None  # root itself advances in place
        hidden, p, path, n_accepted, emitted, logged, status = round_fn(
            target, tokens, t_len, tree, q, rule or _NO_RULE, u_accept, u_emit, max_depth, remaining, active, sampling,
            buf, n_out, root, forwards, sink)
        log[:, rounds].copy_(logged)  # a copy: no graph output is kept across replays (CUDA graphs)
        if drafter is not None:
            drafter.observe(RoundInfo(tokens, path, n_accepted, emitted, p, hidden))
        # the round's one host read (in compiled mode; eager drafting and verification add early exits)
        failed, more, *emitted = status.tolist()
        rounds += 1
        if failed:
            b = int(logged.eq(-2).nonzero()[0, 0])
            raise NonFiniteLogits(b, int(n_out[b]))
    if isinstance(sink, _DeferredSignals):
        sink.flush()
    sync()
    seconds = time.perf_counter() - t0
    extra = {"signal_s": sink.seconds} if isinstance(sink, _DeferredSignals) else {}
    out = buf[:, :n_tokens].clone()  # copies: the workspace is the next image's
    dist = dist[:, :, :n_tokens].clone()
    round_lengths = [[n for n in row if n >= 0] for row in log[:, :rounds].tolist()]
    return GenerationResult(
        tokens=out,
        round_lengths=round_lengths,
        target_forwards=forwards.tolist(),
        draft_forwards=getattr(drafter, "forwards", 0),
        seconds=seconds,
        first_from_prefill=bos_token is None,
        extra=extra,
        step_tv=dist[:, TV],
        step_kl=dist[:, KL],
        token_nll=dist[:, NLL],
        token_nll_expected=dist[:, XNLL],
        token_off_support=dist[:, OFF],
        token_depth=dist[:, DEPTH],
    )


def _workspace(target, compiled: bool, B: int, width: int, distortion: bool) -> dict:
    """The loop's state tensors, reset. Compiled loops keep them on the target, one set per (batch,
    width, signals), marked static: the compiled round mutates them in place, and CUDA graphs
    (``reduce-overhead``) capture a graph only if every input it mutates has a static address;
    reused across images, the addresses never change. Eager loops allocate them per call."""
    key = (B, width, distortion)
    cache = target.__dict__.setdefault("_loop_workspaces", {}) if compiled else {}
    if key not in cache:
        long = lambda *shape: torch.zeros(*shape, dtype=torch.long)  # noqa: E731
        cache[key] = ws = {"buf": long(B, width), "dist": torch.zeros(B, len(TOKEN_SIGNALS), width, dtype=torch.float64),
                           "n_out": long(B), "t_len": long(B), "forwards": long(B), "root": long(B),
                           "log": long(B, width)}
        if compiled:
            from torch._dynamo import mark_static_address

            for t in ws.values():
                mark_static_address(t)
    ws = cache[key]
    for k in ("buf", "n_out", "t_len", "forwards", "root"):
        ws[k].zero_()
    ws["dist"].fill_(0.0 if distortion else float("nan"))
    ws["log"].fill_(-1)
    return ws


TOKEN_SIGNALS = ("tv", "kl", "nll", "nll_expected", "off_support", "depth")  # the loop's per-token channels
TV, KL, NLL, XNLL, OFF, DEPTH = range(len(TOKEN_SIGNALS))


def teacher_forced_probs(target: ARModel, tokens: torch.Tensor, cond: Any, sampling: SamplingConfig) -> torch.Tensor:
    """(B, N, V): the target's (warped) distribution of each of ``tokens`` (B, N) given the tokens
    before it, scored the way AR decoding scores them (the prefill for token 0, then ONE causal
    forward over tokens 0..N-2 at the loop's positions 0..N-2), outside any decoding loop: the
    reference a decoded sequence's per-token draws are tested against
    (``coolsd.decoding.sampling.randomized_pit``, benchmarks/exactness.py). Targets with a
    condition (a prefill) only. Leaves the target's cache with N-1 pending entries; the next
    ``begin`` resets it."""
    B, N = tokens.shape
    prefill = target.begin(cond, B)
    if prefill is None:
        raise ValueError("teacher_forced_probs needs a target with a condition (its prefill scores token 0)")
    p0 = sampling.probs(prefill.logits[:, -1:])
    if N == 1:
        return p0
    positions = torch.arange(N - 1).unsqueeze(0).expand(B, N - 1)
    step = target.forward(tokens[:, : N - 1], positions, torch.ones(N - 1, N - 1, dtype=torch.bool).tril(), None)
    return torch.cat([p0, sampling.probs(step.logits).to(p0.dtype)], 1)


def target_log_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """log p (..., V) of the target's guided distribution at the sampling temperature (1 for
    greedy), before top-k / top-p truncation: what issue 15's target_nll scores tokens with; in
    the logits' precision (at least float32); finite (``distortion.expected_nll`` relies on it)."""
    t = sampling.temperature if sampling.temperature > 0 else 1.0
    x = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    # masked tokens (-inf logits) get the lowest finite value: products with a 0 probability stay 0
    return torch.log_softmax(x / t if t != 1.0 else x, -1).clamp_(min=torch.finfo(x.dtype).min)


def verify_round(target, tokens, t_len, tree: Tree, q, rule: Rule, u_accept, u_emit, max_depth, remaining, active,
                 sampling: SamplingConfig, buf, n_out, root, forwards, dist):
    """The target's side of a round (one compiled call under ``compile=true``): ONE forward over
    the root and the drafted tree, the method's verification walk, the commit of the root and
    the accepted path, and the loop's bookkeeping, in place: accepted drafts then the emitted
    token appended to ``buf`` at each sample's ``n_out`` (and their distortion to ``dist``),
    ``n_out``, ``t_len``, ``root`` and ``forwards`` advanced. Nothing here reads the host. Returns (hidden, p, path, n_accepted,
    emitted, logged, status): ``logged`` (B,) the tokens each sample emitted this round (-1 if
    it was done, -2 if its logits were not finite; then nothing else is valid), ``status`` (2 + B,)
    = [any sample failed, any sample still needs tokens, each sample's tokens so far]."""
    B = tokens.shape[0]
    n_tokens = buf.shape[1] - tree.max_depth - 2  # buf's last columns are a dump for writes past the end
    positions = t_len.unsqueeze(1) + tree.depth.unsqueeze(0)
    step = target.forward(tokens, positions, tree.ancestors, None)
    bad = _nonfinite(step.logits, active)
    p = sampling.probs(step.logits)
    if q is None:
        q = torch.zeros_like(p)
    v = verify_tree(p, q.to(p.dtype), tokens, tree, rule, u_accept, u_emit, max_depth, emit_allowed_after=remaining)
    # the root, then the accepted path; on a chain (and AR) that is the first pending entries in
    # order (node j at depth j): keep=None, nothing moves
    keep = None if tree.max_children <= 1 else torch.cat([torch.zeros(B, 1, dtype=torch.long), v.path.clamp(min=0)], 1)
    n_keep = torch.where(active, v.n_accepted + 1, torch.zeros_like(v.n_accepted))
    target.commit(keep, n_keep)
    t_len += n_keep
    forwards += active.long()
    D = v.path.shape[1]
    vals = torch.cat([tokens.gather(1, v.path.clamp(min=0)), torch.zeros(B, 1, dtype=torch.long)], 1)
    vals.scatter_(1, v.n_accepted.unsqueeze(1), v.emitted.clamp(min=0).unsqueeze(1))
    n_new = v.n_accepted + (v.emitted >= 0).long()
    n_new = torch.where(active, n_new, torch.zeros_like(n_new))
    cols = torch.arange(D + 1).unsqueeze(0)
    write = cols < n_new.unsqueeze(1)
    where = torch.where(write, n_out.unsqueeze(1) + cols, n_tokens + D)  # dump column
    buf.scatter_(1, where, torch.where(write, vals, 0))
    # each written token's quality signals (_round_signals) go to the same columns of ``dist``;
    # None: not asked for (speculative_generate(distortion=False)), left NaN
    if isinstance(dist, _DeferredSignals):  # eager: kept, computed with later rounds'
        dist.add(step.logits, p, q, v.path, v.n_accepted, vals, max_depth, where, write)
    elif dist is not None:
        signals = _round_signals(step.logits, p, q, v.path, v.n_accepted, vals, tree, rule, max_depth, sampling, dist.dtype)
        _write_signals(dist, signals, where, write)
    logged = torch.where(bad, -2, torch.where(active, n_new, -1))
    n_out += torch.where(bad, 0, n_new)
    root.copy_(torch.where(v.emitted >= 0, v.emitted, root))
    status = torch.cat([torch.stack([bad.any(), (n_out < n_tokens).any()]).long(), n_out])
    return step.hidden, p, v.path, v.n_accepted, v.emitted, logged, status


def _write_signals(dist, signals, where, write) -> None:
    """Scatter signals (B, C, W) to ``dist`` (B, C, T) at the token columns ``where`` (B, W) where
    ``write``; unwritten entries go to ``where``'s dump column as 0 (every dump write is 0, so
    duplicates there are harmless; every other column is written at most once)."""
    B, C, W = signals.shape
    dist.scatter_(2, where.unsqueeze(1).expand(B, C, W), torch.where(write.unsqueeze(1), signals, 0))


class _DeferredSignals:
    """The eager loop's signal sink: each round's inputs to ``_round_signals`` are copied into
    preallocated buffers and computed for many rounds in one call, stacked along the batch dim:
    every one of its ops is per row (a sample's round), so R rounds of B samples are R*B rows, and
    the ~100 small ops a round's signals take at batch 1 are paid once per ``flush`` instead of once
    per round (issue 15: < 5% of decode time). Copies into buffers allocated once, not kept round
    tensors: holding the rounds' own (B, n+1, V) tensors would keep the allocator from reusing
    their memory, and every round would fault in fresh pages (measured: +10% decode time at batch
    16 for LANTERN++ with 5% spent in the signals themselves). Flushed when the buffers are full
    (at most ``max_elements`` per buffer: bounded memory on a real target's vocabulary) and when
    the loop ends. On the CPU the buffers hold at most ``cpu_max_elements``: a flush's ~200 ops
    are still paid once per ~50 rows on the toy world (3 rounds at batch 16, 51 at batch 1), while
    the buffers and a flush's temporaries stay a few hundred KiB, which the allocator reuses from
    flush to flush; buffers of 16 MiB and flushes of all of a run's rounds at once were fresh
    pages from the OS at every run (measured on the toy world at batch 16: 4-16 thousand page
    faults a run, up to a third of the signal time; ~0 now). The values are those of the inline
    (compiled) path, up to per-row float reductions."""

    max_elements = 1 << 22  # rounds * B * (n+1) * V elements per buffer at most (16 MiB of float32)
    cpu_max_elements = 1 << 17  # the same on the CPU (512 KiB of float32): see above
    max_rounds = 64

    def __init__(self, dist, tree: Tree, rule: Rule, sampling: SamplingConfig):
        self.dist, self.tree, self.rule, self.sampling = dist, tree, rule, sampling
        self.big = None  # (logits, p, q) buffers, each (rounds, B, n+1, V)
        self.small: list[tuple] = []  # per round: path, n_accepted, vals, max_depth, where, write
        self.timer = IntervalTimer(dist.device)  # the device's time spent here (events on CUDA: no sync)

    @property
    def seconds(self) -> float:
        """Time spent on the signals (after the loop's final sync on CUDA)."""
        return self.timer.seconds()

    def add(self, logits, p, q, path, n_accepted, vals, max_depth, where, write) -> None:
        self.timer.start()
        if self.big is None:
            limit = self.cpu_max_elements if p.device.type == "cpu" else self.max_elements
            rounds = max(1, min(self.max_rounds, limit // p.numel()))
            self.big = tuple(torch.empty((rounds, *x.shape), dtype=x.dtype, device=x.device) for x in (logits, p, q))
        i = len(self.small)
        for buf, x in zip(self.big, (logits, p, q)):
            buf[i].copy_(x)
        self.small.append((path, n_accepted, vals, max_depth, where, write))
        self.timer.stop()
        if len(self.small) == self.big[0].shape[0]:
            self.flush()

    def flush(self) -> None:
        if not self.small:
            return
        self.timer.start()
        self._flush()
        self.timer.stop()

    def _flush(self) -> None:
        R = len(self.small)
        logits, p, q = (buf[:R].flatten(0, 1) for buf in self.big)  # (R*B, n+1, V) views, round-major
        path, n_accepted, vals, max_depth, where, write = (torch.cat(x) for x in zip(*self.small))
        B = self.big[0].shape[1]
        self.small = []
        sig = _round_signals(logits, p, q, path, n_accepted, vals, self.tree, self.rule, max_depth, self.sampling,
                             self.dist.dtype)  # (R*B, C, W), round-major rows
        C, W = sig.shape[1:]
        per_sample = lambda x: x.view(R, B, *x.shape[1:]).transpose(0, 1)  # noqa: E731  (B, R, ...)
        sig = per_sample(sig).permute(0, 2, 1, 3).reshape(B, C, R * W)
        _write_signals(self.dist, sig, per_sample(where).reshape(B, R * W), per_sample(write).reshape(B, R * W))


def _round_signals(logits, p, q, path, n_accepted, vals, tree: Tree, rule: Rule, max_depth, sampling: SamplingConfig,
                   dtype):
    """(B, len(TOKEN_SIGNALS), D + 1): the signals of the round's candidate tokens ``vals`` (the
    accepted path, then the emitted token), position j = round depth j + 1. The token at depth j+1
    was verified at that depth if j < max_depth, else drawn from p (a bonus, the image's end); its
    parent node (whose p it was drawn or verified against) is the root for j = 0, else path[j-1].
    Few, batched ops: at batch 1 on a small target their count, not their size, is the cost."""
    B, D = path.shape
    V = p.shape[-1]
    parent = torch.cat([torch.zeros(B, 1, dtype=torch.long), path.clamp(min=0)], 1)  # (B, D+1)
    # positions past the round's tokens (never written) may hold the BOS id
    at = parent * V + vals.clamp(max=V - 1)
    logp = target_log_probs(logits, sampling)  # (B, n+1, V) at every node
    nll = -logp.flatten(1).gather(1, at)
    off = p.flatten(1).gather(1, at) <= 0  # p(x) at the parent node
    depth = torch.arange(1, D + 2).unsqueeze(0)
    verified = depth <= max_depth.unsqueeze(1)  # (B, D+1)
    drawn = expected_nll(p, logp)  # (B, n+1): E[-log p(x)] for a token drawn from p at each node
    if tree.n_nodes == 0 or lossless(rule, D):  # pi = p at the emitting node: distortion 0, E[NLL] that of p
        # at the parent (AR: the root only; a tree's siblings change nothing: recursive rejection is exact,
        # METHODS.md 1.3)
        tv_kl, xnll = torch.zeros(B, 2, D + 1, dtype=dtype), drawn.gather(1, parent)
    elif tree.max_children == 1:  # chain: exact per depth (docs/distortion.md), at the depths the round emitted
        need = (verified & (depth <= n_accepted.unsqueeze(1) + 1))[:, :D]
        d = chain_distortion(rule, p, q, D, need, logp)
        per_depth = torch.nn.functional.pad(torch.stack(d, 1), (0, 1))  # (B, 3, D+1): tv, kl, E nll; bonus column 0
        tv_kl = torch.where(verified.unsqueeze(1), per_depth[:, :2], 0).to(dtype)
        xnll = torch.where(verified, per_depth[:, 2], drawn[:, : D + 1])
    else:  # siblings drawn without replacement: no closed form (docs/distortion.md); a draw from p has one
        tv_kl = torch.full((B, 2, D + 1), float("nan"), dtype=dtype)
        xnll = torch.where(verified, float("nan"), drawn.gather(1, parent))
    rest = torch.stack([nll, xnll, off.to(nll.dtype), torch.where(verified, depth, 0).to(nll.dtype)], 1)
    return torch.cat([tv_kl, rest.to(dtype)], 1)


class _NoRule(Rule):
    name = "none"

    def numerator(self, p_res, depth):  # never called: the empty tree has no siblings
        return p_res


_NO_RULE = _NoRule()
