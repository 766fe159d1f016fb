"""Row-parallel decoding (ZipAR, ``coolsd.engine.rows``) on a tiny float64 LlamaGen GPT.

* The schedule samples every image token once, feeds only tokens already drawn, and needs fewer
  forwards than AR.
* The KV cache's visibility by position gives, forward by forward, the logits of ONE cache-free
  forward over every entry the schedule feeds under ``visibility`` (an independent statement of what
  each query sees); plain committed visibility (every committed entry seen) does not.
* Exact distributions on a 3 x 3 grid with 2 codes (512 images, enumerated): ZipAR's own sequence
  distribution (the product of the distributions its queries draw from) differs from the target's
  (TV > 0: NOT lossless) except with two rows (row 1 starts after row 0 is done: TV 0); the loop's
  samples follow ZipAR's distribution (chi-square) and not the target's; the per-token ``step_tv``
  equals TV(q_t, p_t) recomputed from the enumeration.
"""
import numpy as np
import pytest
import torch

from coolsd.engine.decoding.rng import PerSampleRNG
from coolsd.engine.drafting import SamplingConfig
from coolsd.engine.loop import speculative_generate
from coolsd.engine.rows import RowParallel, visibility, zipar_schedule
from coolsd.models.llamagen import LlamaGenTarget
from coolsd.theory import chi_square_pvalue
from coolsd.theory.row_parallel import all_images, draw_distributions, target_distributions, zipar_exact
from factories import engine_model, llamagen_cond, llamagen_gpt

CODES, SIDE = 2, 3  # 2 codes on a 3 x 3 grid: 512 images


def _target(cfg_scale=2.0, seed=4):
    """A 3 x 3 grid of 2 codes; weights large enough for context-dependent distributions (the
    target's sequence entropy is 3.5 nats of 6.2; ZipAR's exact TV 0.21 at window 1, 0.25 at 2)."""
    model = llamagen_gpt(seed, init_std=0.2, norm_noise=0, dim=32, n_layer=2, vocab_size=CODES, block_size=SIDE * SIDE)
    return LlamaGenTarget(model, cfg_scale=cfg_scale)


def _cond(B):
    c = llamagen_cond([5], seed=4)
    return {k: v.expand(B, *v.shape[1:]).clone() for k, v in c.items()}


@pytest.mark.parametrize("H,W,w", [(3, 4, 1), (4, 4, 2), (5, 6, 3), (3, 3, 2), (2, 5, 1)])
def test_schedule_draws_every_token_once_from_drawn_inputs(H, W, w):
    steps = zipar_schedule(H, W, w)
    drawn = {0}
    for s in steps:
        assert all(f in drawn for f in s.fed)  # feeds only tokens drawn in earlier forwards (or the prefill)
        new = [j for j in s.sample if j >= 0]
        assert not drawn & set(new)
        drawn |= set(new)
    assert drawn == set(range(H * W))
    assert len(steps) + 1 <= H * W if H > 2 else len(steps) + 1 == H * W  # AR: one forward per token


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="window must be in"):
        zipar_schedule(3, 4, 4)


def _run_schedule(target, steps, tokens, by_position=True):
    """The loop's forwards with fixed tokens: logits (B, E, V) of every fed entry in feed order."""
    B = tokens.shape[0]
    target.begin(_cond(B), B)
    outs = []
    for s in steps:
        m = len(s.fed)
        pos = torch.tensor(s.positions).expand(B, m)
        attend = torch.tensor([[b <= a for b in s.positions] for a in s.positions])
        if by_position:
            out = target.forward(tokens[:, list(s.fed)], pos, attend, by_position=True)
        else:
            out = target.forward(tokens[:, list(s.fed)], pos, attend)
        target.commit(torch.arange(m).expand(B, m), torch.full((B,), m))
        outs.append(out.logits)
    return torch.cat(outs, 1)


def _one_forward(target, steps, tokens):
    """The same entries' logits from ONE forward, all entries pending, masked by ``visibility``."""
    B = tokens.shape[0]
    fed = [f for s in steps for f in s.fed]
    pos = torch.tensor([p for s in steps for p in s.positions]).expand(B, -1)
    target.begin(_cond(B), B)
    out = target.forward(tokens[:, fed], pos, visibility(steps)).logits
    target.commit(None, torch.zeros(B, dtype=torch.long))
    return out


@pytest.mark.parametrize("w", [1, 2])
def test_cache_visibility_equals_one_masked_forward(w):
    H = W = 4
    target = LlamaGenTarget(engine_model(5, dim=32), cfg_scale=3.0)
    steps = zipar_schedule(H, W, w)
    tokens = torch.randint(0, 64, (2, H * W), generator=torch.Generator().manual_seed(0))
    ref = _one_forward(target, steps, tokens)
    got = _run_schedule(target, steps, tokens)
    assert (got - ref).abs().max() < 1e-10
    plain = _run_schedule(target, steps, tokens, by_position=False)  # every committed entry seen: differs
    assert (plain - ref).abs().max() > 1e-3


def _zipar_and_target(target, steps, n, sampling):
    """(ZipAR's log-probability of each image, the target's, q (I, n, V) and p (I, n, V), the images)
    over all images of n tokens, enumerated (``coolsd.theory.row_parallel``)."""
    imgs = all_images(CODES, n)
    q = draw_distributions(target, _cond(len(imgs)), steps, imgs, sampling)
    p = target_distributions(target, _cond(len(imgs)), imgs, sampling)
    idx = imgs.unsqueeze(-1)
    return q.gather(2, idx)[..., 0].log().sum(1), p.gather(2, idx)[..., 0].log().sum(1), q, p, imgs


@pytest.mark.parametrize("w", [1, 2])
def test_zipar_is_not_lossless_and_the_loop_samples_its_distribution(w):
    sampling = SamplingConfig()
    target = _target()
    steps = zipar_schedule(SIDE, SIDE, w)
    log_z, log_p, q, p, imgs = _zipar_and_target(target, steps, SIDE * SIDE, sampling)
    assert abs(log_z.exp().sum() - 1) < 1e-9 and abs(log_p.exp().sum() - 1) < 1e-9
    tv = 0.5 * (log_z.exp() - log_p.exp()).abs().sum()
    assert tv > 0.1  # lossy: the lab's exact TV sees it
    n = 6000
    res = speculative_generate(target, SIDE * SIDE, PerSampleRNG(list(range(n))), drafter=RowParallel(w, SIDE),
                               sampling=sampling, cond=_cond(n), batch_size=n)
    code = (res.tokens * (CODES ** torch.arange(SIDE * SIDE - 1, -1, -1))).sum(1)
    counts = np.bincount(code.numpy(), minlength=CODES ** (SIDE * SIDE))
    assert chi_square_pvalue(counts, log_z.exp().numpy()) > 1e-3
    assert chi_square_pvalue(counts, log_p.exp().numpy()) < 1e-6
    # step_tv: TV(q_t, p_t) of the image each sample made, recomputed from the enumeration
    want = 0.5 * (q[code] - p[code]).abs().sum(-1)
    assert torch.allclose(res.step_tv, want, atol=1e-9)
    assert (res.step_tv[:, : 2 * SIDE] < 1e-9).all()  # rows 0 and 1 see the whole raster prefix
    assert res.target_forwards[0] == len(steps) + 1


def test_two_rows_are_lossless():
    sampling = SamplingConfig()
    target = _target()
    n = 2 * SIDE
    steps = RowParallel(1, SIDE).schedule(n)
    log_z, log_p, *_ = _zipar_and_target(target, steps, n, sampling)
    assert torch.allclose(log_z, log_p, atol=1e-9)


def test_the_signal_bounds_the_sequence_tv():
    """E[sum_t step TV] >= TV(P_zip, P) (coolsd.theory.row_parallel), and both > 0 at every window."""
    target = _target()
    for w in (1, 2):
        x = zipar_exact(target, _cond, CODES, SIDE, SIDE, w, SamplingConfig(), chunk=200)  # chunks too
        assert abs(x["mass_zipar"] - 1) < 1e-9 and abs(x["mass_target"] - 1) < 1e-9
        assert 0.1 < x["tv"] <= x["expected_step_tv"] + 1e-12
        assert x["tokens_per_forward"] == 9 / (2 * SIDE + (SIDE - 2) * w)


def test_signals_in_chunks_of_positions_are_the_whole_image_s(monkeypatch):
    """The signals are formed a few positions at a time (``rows.SIGNAL_CHUNK``): chunks of 2 give every
    token's signals as one chunk does, for ZipAR (q known: TV, KL, expected NLL) and PJD (target only)."""
    import coolsd.engine.rows as rows

    target = _target()

    def run(chunk, method):
        monkeypatch.setattr(rows, "SIGNAL_CHUNK", chunk)
        drafter = RowParallel(1, SIDE) if method == "zipar" else rows.PJDRows(3, 1, SIDE, CODES)
        res = speculative_generate(target, SIDE * SIDE, PerSampleRNG([1, 2]), drafter=drafter, sampling=SamplingConfig(),
                                   cond=_cond(2), batch_size=2)
        return torch.stack([res.step_tv, res.step_kl, res.token_nll, res.token_nll_expected, res.token_off_support])

    for method in ("zipar", "pjd"):
        whole, parts = run(64, method), run(2, method)
        assert torch.equal(whole.isnan(), parts.isnan()) and not whole[2].isnan().any()
        assert (whole.nan_to_num() - parts.nan_to_num()).abs().max() < 1e-12, method
    assert run(64, "zipar")[0].max() > 0  # ZipAR's step TV: a signal, not zeros


@pytest.mark.parametrize("H,W,w", [(16, 16, 8), (48, 48, 8), (3, 4, 1), (5, 7, 3)])
def test_forward_count_is_the_documented_one(H, W, w):
    """docs/methods.md section 8.1: 2 W + (H - 2) w target forwards, the prefill included."""
    assert len(zipar_schedule(H, W, w)) + 1 == 2 * W + (H - 2) * w


# ------------------------------------------------------------------------------------------- PJD
def _pjd_counts(target, n, **params):
    """Histogram over the 512 images of n PJD samples through the loop, and the result."""
    from coolsd.engine.rows import PJDRows

    p = {"window": 3, "start": 1, "keep_above": 0.5, **params}
    res = speculative_generate(target, SIDE * SIDE, PerSampleRNG(list(range(n))),
                               drafter=PJDRows(p["window"], p["start"], SIDE, CODES, keep_above=p["keep_above"]),
                               sampling=SamplingConfig(), cond=_cond(n), batch_size=n)
    code = (res.tokens * (CODES ** torch.arange(SIDE * SIDE - 1, -1, -1))).sum(1)
    return np.bincount(code.numpy(), minlength=CODES ** (SIDE * SIDE)), res


def _target_distribution(target):
    imgs = all_images(CODES, SIDE * SIDE)
    p = target_distributions(target, _cond(len(imgs)), imgs, SamplingConfig())
    return p.gather(2, imgs.unsqueeze(-1))[..., 0].prod(1).numpy()


def test_pjd_one_row_at_a_time_without_kept_drafts_is_lossless():
    """start = W (a row starts when the one above is complete) and keep_above = null: every row is
    the top row, verified as SJD with fresh samples as drafts, so the loop samples the target."""
    target = _target()
    counts, res = _pjd_counts(target, 2000, window=3, start=SIDE, keep_above=None)
    assert chi_square_pvalue(counts, _target_distribution(target)) > 1e-3  # measured 0.98
    assert (res.step_tv.isnan()).all() and not res.token_nll.isnan().any()  # no closed form; NLL under p_t
    # a start past the row's width starts each row when the one above is complete: the same run
    ref = _pjd_counts(target, 50, window=3, start=SIDE, keep_above=None)[1]
    again = _pjd_counts(target, 50, window=3, start=SIDE + 5, keep_above=None)[1]
    assert torch.equal(again.tokens, ref.tokens) and again.target_forwards == ref.target_forwards


def test_pjd_is_not_lossless():
    """Rows that start early (start 1) commit drafts accepted without the row above: lossy."""
    target = _target()
    counts, res = _pjd_counts(target, 3000)
    assert chi_square_pvalue(counts, _target_distribution(target)) < 1e-6  # measured 1.6e-22
    assert np.mean(res.target_forwards) < SIDE * SIDE  # fewer forwards than AR's 9


class _Recorder:
    """A target that records every forward's inputs and outputs and every commit."""

    row_parallel = True

    def __init__(self, target):
        self.t, self.forwards, self.commits = target, [], []
        self.vocab_size, self.device = target.vocab_size, target.device

    def begin(self, cond, B, context=None):
        return self.t.begin(cond, B)

    def forward(self, tokens, positions, attend, features=None, by_position=False):
        out = self.t.forward(tokens, positions, attend, by_position=by_position)
        self.forwards.append((tokens.clone(), positions.clone(), attend.clone(), out.logits.clone()))
        return out

    def commit(self, keep, n_keep):
        self.commits.append((None if keep is None else keep.clone(), n_keep.clone()))
        self.t.commit(keep, n_keep)


def test_pjd_forwards_equal_one_masked_forward_over_their_entries():
    """Every PJD forward's logits (several rows, auxiliary anchors, re-fed last tokens, kept and
    dropped drafts) equal ONE cache-free forward over all entries ever fed, where an entry sees the
    same forward's entries its recorded mask allows and an earlier forward's entry iff that entry was
    kept, sits at an earlier position, and no entry kept later or fed in its own forward replaced it:
    the KV cache's visibility by position and the commits' bookkeeping, restated independently."""
    from coolsd.engine.rows import PJDRows

    B = 3
    target = _Recorder(_target())
    res = speculative_generate(target, SIDE * SIDE, PerSampleRNG([5, 6, 7]), drafter=PJDRows(3, 1, SIDE, CODES),
                               sampling=SamplingConfig(), cond=_cond(B), batch_size=B, distortion=False)
    assert len(target.forwards) >= 3
    for b in range(B):
        ent = []  # (forward k, index i, token, position, kept)
        for k, ((tok, pos, att, _), (keep, n_keep)) in enumerate(zip(target.forwards, target.commits)):
            kept = set(keep[b, : int(n_keep[b])].tolist())
            for i in range(tok.shape[1]):
                if pos[b, i] <= SIDE * SIDE:  # not padding
                    ent.append((k, i, int(tok[b, i]), int(pos[b, i]), i in kept))
        # what the cache holds at the end: one entry per position but the last, the image's own token
        final = {}
        for k, i, tok, p, kept in ent:
            if kept:
                final[p] = tok
        assert final == {j: int(res.tokens[b, j]) for j in range(SIDE * SIDE - 1)}, b
        E = len(ent)
        vis = torch.zeros(E, E, dtype=torch.bool)
        for a, (k, i, _, p, _) in enumerate(ent):
            for c, (k2, i2, _, p2, kept2) in enumerate(ent):
                if k2 == k:
                    vis[a, c] = bool(target.forwards[k][2][b, i, i2])
                elif k2 < k and kept2 and p2 < p:
                    later = any(kk2 and pp == p2 and k2 < kk < k for kk, _, _, pp, kk2 in ent)
                    now = any(pp == p2 and kk == k for kk, _, _, pp, _ in ent)
                    vis[a, c] = not (later or now)
        t = target.t
        t.begin(_cond(1), 1)
        tokens = torch.tensor([[e[2] for e in ent]])
        logits = t.forward(tokens, torch.tensor([[e[3] for e in ent]]), vis).logits  # all pending: no positions
        t.commit(None, torch.zeros(1, dtype=torch.long))
        got = torch.stack([target.forwards[k][3][b, i] for k, i, *_ in ent])
        assert (got - logits[0]).abs().max() < 1e-10, b
