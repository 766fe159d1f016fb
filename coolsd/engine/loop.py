"""The one generation loop (docs/methods.md#13-verification-at-one-tree-depth-d, #4-sjd): every discrete method runs through here
(row-parallel ones, several image rows a forward, through their drafter's ``own_loop``: ``coolsd.engine.rows``).

Round: the drafter proposes a tree rooted at the last emitted token; ONE target forward scores
the root and every node under the tree mask; ``verify_tree`` walks it with the method's rule;
the target commits the root and the accepted path; the drafter observes the result.
Plain AR is the same loop with the empty tree (tau = 1).
"""
from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple, Optional

import torch

from coolsd.engine.compiled import compiled_for
from coolsd.engine.decoding.distortion import expected_nll
from coolsd.engine.decoding.rules import Rule
from coolsd.engine.decoding.sampling import sample_inverse_cdf
from coolsd.engine.decoding.trees import EMPTY_TREE, Tree
from coolsd.engine.decoding.verify import verify_tree
from coolsd.engine.drafting import RoundInfo, SamplingConfig
from coolsd.engine.generation_result import GenerationResult, NonFiniteLogits, _check_finite, _nonfinite  # noqa: F401
from coolsd.engine.model_protocol import ARModel
from coolsd.engine import rows  # noqa: F401  (registers the row-parallel drafter kinds)
from coolsd.engine.signals import (
    DEPTH,
    KL,
    NLL,
    OFF,
    TOKEN_SIGNALS,
    TV,
    XNLL,
    DeferredSignals,
    round_signals,
    target_log_probs,
    write_signals,
)


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
    ``rng`` gives uniforms per sample (``coolsd.engine.decoding.rng``: counter-based, computed on the
    target's device, the same values on every device).

    ``distortion``: record each emitted token's quality signals (exact distortion ``step_tv`` /
    ``step_kl``, docs/distortion.md; ``token_nll``, ``token_nll_expected``, ``token_off_support``,
    ``token_depth``); False
    skips that work and leaves them NaN (to measure what it costs).

    The loop's state lives on the target's device (``target.device``; the CPU if it has none):
    the tree, the rule and the uniforms are moved or computed there, and every tensor the loop
    makes takes its device from an input tensor, never from an ambient ``torch.device`` context
    (tests/engine/test_explicit_devices.py holds it for every method, target and mode).
    """
    dev = torch.device(getattr(target, "device", "cpu"))
    rng = rng.on(dev)  # counter-based streams computed on the target's device (coolsd.engine.decoding.rng)
    own_loop = getattr(drafter, "own_loop", None)  # several rows a forward (ZipAR, PJD): coolsd.engine.rows
    if own_loop is not None:
        if bos_token is not None or tree.n_nodes or rule is not None:
            raise ValueError("row-parallel decoding takes no bos_token, tree or rule: the first token comes from the "
                             "prefill and coolsd.engine.rows feeds the rows itself")
        return own_loop(target, n_tokens, rng, sampling, cond, batch_size, sync, distortion)
    rule = rule.on(dev) if rule is not None else None
    tree = (EMPTY_TREE if drafter is None else tree).on(dev)  # no drafter: plain AR, the empty tree
    return _generate(target, n_tokens, rng, rule, drafter, tree, sampling, cond, batch_size, bos_token, sync, distortion)


def _generate(target, n_tokens, rng, rule, drafter, tree, sampling, cond, batch_size, bos_token, sync, distortion):
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    if rule is None and tree.n_nodes > 0:
        raise ValueError("a drafted tree needs an acceptance rule")
    B = batch_size
    sync()
    t0 = time.perf_counter()
    prefill = target.begin(cond, B)
    compiled = getattr(target, "compiled", False)
    # the round's in-place state: buf (tokens, then a dump column), dist (per-token signals, channels
    # TOKEN_SIGNALS), n_out, t_len (committed target entries after the condition), forwards, root
    ws = _workspace(target, compiled, B, n_tokens + tree.max_depth + 2, distortion, rng.device)
    buf, dist, n_out, t_len, forwards, root, log = (ws[k] for k in ("buf", "dist", "n_out", "t_len", "forwards",
                                                                     "root", "log"))
    forwards.fill_(1 if prefill is not None else 0)
    if bos_token is None:
        if prefill is None:
            raise ValueError("a target without a condition needs bos_token")
        _check_finite(prefill.logits[:, -1:], n_out, torch.ones(B, dtype=torch.bool, device=n_out.device))
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
    # round's inputs and compute them for many rounds at once (DeferredSignals): same function
    sink = (dist if compiled else DeferredSignals(dist, tree, rule, sampling)) if distortion else None
    state = LoopState(buf, n_out, t_len, root, forwards, sink)
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
            target, tree, rule or _NO_RULE, sampling, state,
            RoundInputs(tokens, q, u_accept, u_emit, max_depth, remaining, active))
        log[:, rounds].copy_(logged)  # a copy: no graph output is kept across replays (CUDA graphs)
        if drafter is not None:
            drafter.observe(RoundInfo(tokens, path, n_accepted, emitted, p, hidden))
        # the round's one host read (in compiled mode; eager drafting and verification add early exits)
        failed, more, *emitted = status.tolist()
        rounds += 1
        if failed:
            b = int(logged.eq(-2).nonzero()[0, 0])
            raise NonFiniteLogits(b, int(n_out[b]))
    if isinstance(sink, DeferredSignals):
        sink.flush()
    sync()
    seconds = time.perf_counter() - t0
    extra = {"signal_s": sink.seconds} if isinstance(sink, DeferredSignals) else {}
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


def _workspace(target, compiled: bool, B: int, width: int, distortion: bool, device: torch.device) -> dict:
    """The loop's state tensors on ``device``, reset. Compiled loops keep them on the target, one
    set per (batch, width, signals, device), marked static: the compiled round mutates them in
    place, and CUDA graphs (``reduce-overhead``) capture a graph only if every input it mutates has a
    static address; reused across images, the addresses never change. Eager loops allocate them
    per call."""
    key = (B, width, distortion, device)
    cache = target.__dict__.setdefault("_loop_workspaces", {}) if compiled else {}
    if key not in cache:
        long = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=device)  # noqa: E731
        cache[key] = ws = {"buf": long(B, width),
                           "dist": torch.zeros(B, len(TOKEN_SIGNALS), width, dtype=torch.float64, device=device),
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


class LoopState(NamedTuple):
    """The loop's in-place state (``_workspace``), advanced by every round: ``buf`` (B, W) each
    sample's tokens so far, then a dump column for writes past the end; ``n_out`` (B,) tokens so
    far; ``t_len`` (B,) committed target entries after the condition; ``root`` (B,) the last
    emitted token; ``forwards`` (B,) target forwards; ``signals`` where the per-token signals go
    (the (B, C, W) tensor in a compiled round, a ``DeferredSignals`` in an eager one, None when not
    asked for)."""

    buf: torch.Tensor
    n_out: torch.Tensor
    t_len: torch.Tensor
    root: torch.Tensor
    forwards: torch.Tensor
    signals: Any


class RoundInputs(NamedTuple):
    """One round's inputs: the drafted ``tokens`` (B, n+1), root first, and their draft
    probabilities ``q`` (B, n+1, V) or None (no drafter); the uniforms ``u_accept`` (B, n+1) and
    ``u_emit`` (B,); ``max_depth`` (B,) the deepest depth a sample may accept this round;
    ``remaining`` (B,) its tokens still to emit; ``active`` (B,) whether it needs any."""

    tokens: torch.Tensor
    q: Optional[torch.Tensor]
    u_accept: torch.Tensor
    u_emit: torch.Tensor
    max_depth: torch.Tensor
    remaining: torch.Tensor
    active: torch.Tensor


def verify_round(target, tree: Tree, rule: Rule, sampling: SamplingConfig, state: LoopState, inputs: RoundInputs):
    """The target's side of a round (one compiled call under ``compile=true``): ONE forward over
    the root and the drafted tree, the method's verification walk, the commit of the root and
    the accepted path, and the loop's bookkeeping, in place on ``state``: accepted drafts then the
    emitted token appended to ``buf`` at each sample's ``n_out`` (and their signals to ``signals``),
    ``n_out``, ``t_len``, ``root`` and ``forwards`` advanced. Nothing here reads the host. Returns (hidden, p, path, n_accepted,
    emitted, logged, status): ``logged`` (B,) the tokens each sample emitted this round (-1 if
    it was done, -2 if its logits were not finite; then nothing else is valid), ``status`` (2 + B,)
    = [any sample failed, any sample still needs tokens, each sample's tokens so far]."""
    tokens, q, u_accept, u_emit, max_depth, remaining, active = inputs
    buf, n_out, t_len, root, forwards, dist = state
    B, dev = tokens.shape[0], tokens.device
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
    keep = None if tree.max_children <= 1 else \
        torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), v.path.clamp(min=0)], 1)
    n_keep = torch.where(active, v.n_accepted + 1, torch.zeros_like(v.n_accepted))
    target.commit(keep, n_keep)
    t_len += n_keep
    forwards += active.long()
    D = v.path.shape[1]
    vals = torch.cat([tokens.gather(1, v.path.clamp(min=0)), torch.zeros(B, 1, dtype=torch.long, device=dev)], 1)
    vals.scatter_(1, v.n_accepted.unsqueeze(1), v.emitted.clamp(min=0).unsqueeze(1))
    n_new = v.n_accepted + (v.emitted >= 0).long()
    n_new = torch.where(active, n_new, torch.zeros_like(n_new))
    cols = torch.arange(D + 1, device=dev).unsqueeze(0)
    write = cols < n_new.unsqueeze(1)
    where = torch.where(write, n_out.unsqueeze(1) + cols, n_tokens + D)  # dump column
    buf.scatter_(1, where, torch.where(write, vals, 0))
    # each written token's quality signals (round_signals) go to the same columns of ``dist``;
    # None: not asked for (speculative_generate(distortion=False)), left NaN
    if isinstance(dist, DeferredSignals):  # eager: kept, computed with later rounds'
        dist.add(step.logits, p, q, v.path, v.n_accepted, vals, max_depth, where, write, v.choices)
    elif dist is not None:
        signals = round_signals(step.logits, p, q, v.path, v.n_accepted, vals, tree, rule, max_depth, sampling, dist.dtype,
                                v.choices)
        write_signals(dist, signals, where, write)
    logged = torch.where(bad, -2, torch.where(active, n_new, -1))
    n_out += torch.where(bad, 0, n_new)
    root.copy_(torch.where(v.emitted >= 0, v.emitted, root))
    status = torch.cat([torch.stack([bad.any(), (n_out < n_tokens).any()]).long(), n_out])
    return step.hidden, p, v.path, v.n_accepted, v.emitted, logged, status


class _NoRule(Rule):
    name = "none"

    def numerator(self, p_res, depth):  # never called: the empty tree has no siblings
        return p_res


_NO_RULE = _NoRule()
