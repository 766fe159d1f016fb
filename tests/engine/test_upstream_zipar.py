"""Parity of our ZipAR (``coolsd.engine.rows``: ``zipar_schedule``, ``row_parallel_generate``) with
the UPSTREAM LlamaGen ZipAR code, on a recorded fixture.

``tests/fixtures/upstream/zipar_llamagen.safetensors`` was made by ``tools/make_upstream_fixtures.py
--zipar`` with ThisisBillhe/ZipAR's ``LlamaGen-ZipAR`` ``generate_zipar.generate`` on its own ``gpt.py``
``Transformer`` (t2i, tiny random fp32 weights, a 5 x 5 grid, window 2, two left-padded captions; case
``cfg2``: CFG 2.0, temperature 1; case ``cfg1``: unguided, temperature 0.9, top-k 12). Upstream's
``torch.multinomial`` was replaced, while it ran, by an inverse-CDF draw from a recorded uniform (the
same law). Per query (one entry each, in feed order; entry 0 is the prefill's last text slot) it
holds the forward, the fed token and its grid index, the position, the cell the output drew, the
CFG-combined logits, the image slots at positions <= the query's that were still all zero in every
layer's static cache, the uniform and the token drawn. No upstream code runs here.

1. Schedule: ``zipar_schedule(5, 5, 2)`` feeds, forward by forward, the same grid indices at the same
   positions and draws the same cells as upstream (row 0 AR, row 1's first query at row 0's last
   slot, the auxiliary copy of row r-1's latest token at the slot of row r's last token, the re-fed
   last token of a completed row, its output unused). Exact.
2. Logits: our ``LlamaGenTarget`` (upstream's weights, strict load) run through that schedule with
   ``by_position=True`` gives upstream's logits within ``tol`` at every query that no zero slot
   reaches. Upstream's zero-initialised static cache puts keys and values of zeros at the undecoded
   slots <= a query's position and they take softmax mass; ours masks them (docs/methods.md section
   8.1). 6 queries of 28 a case see such slots (each row's first query from row 2 on, and the query
   after it); with 2 layers the difference also reaches every query that attends their entries (its
   keys and values from layer 1 on), i.e. every query of rows 2-4: all of these DIFFER. A
   static-cache replay in this test (our model's modules, undecoded slots as zero keys and values)
   is upstream at EVERY query within ``tol``, and with those slots masked it should be ours
   everywhere. (That check found a bug of ours, since fixed: ``KVCache`` clamped its bound of the
   committed length to cls_token_num + block_size, which row-parallel decoding exceeds, since a
   replaced auxiliary entry stays committed, hidden; the last forwards then stopped attending the
   newest entries.)
3. Draws: with the recorded uniforms, ``sample_inverse_cdf`` on OUR warped probabilities draws
   upstream's token at every query whose logits agree (and on upstream's own p, every query; our
   warper on upstream's logits is upstream's p); our whole loop (``row_parallel_generate`` fed the
   same uniforms) gives upstream's image exactly when the queries that differ draw the same tokens.
4. Negative controls: an auxiliary token taken from row r (not r-1) fails check 1; positions
   shifted by one fail check 2.

Measured (fp32, ``tol`` 1e-4; logit scales 12.3 / 4.8): the agreeing queries 9.3e-6 / 3.5e-6, the
zero-slot queries differ by 0.032-0.26 / 0.023-0.12, the queries they reach by 2e-4-0.034 /
3.8e-4-0.005, the replay with zero slots vs upstream 8.6e-6 / 3.3e-6; the
tests print them (``pytest -s``).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_upstream_parity import gpt_from_fixture, load_fixture, max_abs

from coolsd.engine.decoding.sampling import cfg_combine, sample_inverse_cdf, warp_probs
from coolsd.engine.drafting import SamplingConfig
from coolsd.engine.rows import RowParallel, RowStep, row_parallel_generate, zipar_schedule
from coolsd.models.llamagen import LlamaGenTarget, apply_rope, rope_2d, rotation, text_slot_mask

CASES = ("cfg2", "cfg1")


@pytest.fixture(scope="module")
def fx():
    return load_fixture("zipar_llamagen")


def _case(fx, name: str) -> dict:
    c = {k.split(".", 1)[1]: v for k, v in {**fx.inp, **fx.out}.items() if k.startswith(name + ".")}
    c.update(fx.config["cases"][name])
    return c


def _cond(fx) -> dict:
    return {"caption_embs": fx.inp["caption"], "emb_mask": fx.inp["emb_mask"].bool()}


def _grid(fx) -> tuple[int, int, int]:
    return fx.config["height"], fx.config["width"], fx.config["window"]


def upstream_steps(c: dict) -> list[RowStep]:
    """Upstream's forwards after the prefill as ``RowStep``s: the grid index each query fed (the
    probe row), its position (input_pos - cls_token_num) and the cell it drew (-1: unused)."""
    fwd = c["fwd"]
    return [RowStep(tuple(c["fed_index"][fwd == k].tolist()), tuple(c["pos"][fwd == k].tolist()),
                    tuple(c["sample"][fwd == k].tolist())) for k in range(1, int(fwd.max()) + 1)]


def schedule_mismatches(ours: list[RowStep], theirs: list[RowStep]) -> list[str]:
    out = [f"forward {k + 1}: ours {a} upstream {b}" for k, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    if len(ours) != len(theirs):
        out.append(f"{len(ours)} forwards, upstream {len(theirs)}")
    return out


def run_ours(target, cond, steps: list[RowStep], tokens: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """(B, 1 + E, V): the prefill's logits, then every fed entry's in feed order, the schedule's
    forwards with ``tokens`` (the final image), visibility by position (as ``row_parallel_generate``)."""
    B = tokens.shape[0]
    outs = [target.begin(cond, B).logits[:, -1:]]
    for s in steps:
        m = len(s.fed)
        pos = (torch.tensor(s.positions) + shift).expand(B, m)
        attend = torch.tensor([[b <= a for b in s.positions] for a in s.positions])
        outs.append(target.forward(tokens[:, list(s.fed)], pos, attend, by_position=True).logits)
        target.commit(torch.arange(m).expand(B, m), torch.full((B,), m))
    return torch.cat(outs, 1)


def static_cache_replay(model, cond, cfg_scale: float, steps: list[RowStep], tokens: torch.Tensor,
                        zero_slots: bool) -> torch.Tensor:
    """(B, 1 + E, V) like ``run_ours``, computed with a STATIC cache of the whole sequence (text
    slots, then one slot per image position; our model's own modules): every forward writes its keys
    and values at its positions, and a query at position p attends every written slot <= p (and the
    valid text slots). ``zero_slots``: also every slot <= p NOT written yet, as keys and values of
    zeros (upstream's zero-initialised cache); otherwise those are masked (ours)."""
    cfg = model.config
    T, N, nh, hd = cfg.cls_token_num, cfg.block_size, cfg.n_head, cfg.head_dim
    caption, mask = cond["caption_embs"], cond["emb_mask"]
    B = caption.shape[0]
    x = caption * mask.unsqueeze(-1)
    if cfg_scale > 1.0:
        x = torch.cat([x, model.cls_embedding.uncond_embedding.expand(B, -1, -1)])
        mask = torch.cat([mask, mask])
    n = x.shape[0]
    K = torch.zeros(cfg.n_layer, n, nh, T + N, hd)
    Vc = torch.zeros_like(K)
    written = torch.zeros(T + N, dtype=torch.bool)
    text_ok = torch.cat([mask, torch.ones(n, N, dtype=torch.bool)], 1)  # (n, T + N) keys ever visible

    def run(h, slots, rot, allowed):  # h (n, m, dim), slots (m,), allowed (n, m, T + N)
        for i, layer in enumerate(model.layers):
            att = layer.attention
            q, k, v = (t.view(n, -1, nh, hd) for t in att.wqkv(layer.attention_norm(h)).split(cfg.dim, -1))
            q, k = apply_rope(q, rot).transpose(1, 2), apply_rope(k, rot).transpose(1, 2)
            K[i][:, :, slots], Vc[i][:, :, slots] = k, v.transpose(1, 2)
            o = F.scaled_dot_product_attention(q, K[i], Vc[i], attn_mask=allowed.unsqueeze(1))
            h = h + att.wo(o.transpose(1, 2).reshape(n, -1, cfg.dim))
            h = h + layer.feed_forward(layer.ffn_norm(h))
        written[slots] = True
        logits = model.logits(model.norm(h))
        return cfg_combine(logits[:B], logits[B:], cfg_scale) if cfg_scale > 1.0 else logits

    zeros = torch.zeros(n, T, hd // 2)
    allowed = torch.zeros(n, T, T + N, dtype=torch.bool)
    allowed[:, :, :T] = text_slot_mask(mask, cfg.variant)
    outs = [run(model.cls_embedding(x), torch.arange(T), rotation(zeros, zeros), allowed)[:, -1:]]
    for s in steps:
        pos = torch.tensor(s.positions)
        slots = T + pos
        cos, sin = rope_2d(pos.expand(n, -1), cfg, torch.float32)
        causal = torch.arange(T + N).unsqueeze(0) <= slots.unsqueeze(1)  # (m, T + N)
        seen = written.clone()
        seen[slots] = True  # this forward's entries are written before its attention
        allowed = causal & text_ok.unsqueeze(1) & (torch.ones_like(seen) if zero_slots else seen)
        outs.append(run(model.tok_embeddings(tokens[:, list(s.fed)].repeat(n // B, 1)), slots, rotation(cos, sin),
                        allowed))
    return torch.cat(outs, 1)


# ------------------------------------------------------------------------------------ 1. schedule
def test_schedule_matches_upstream(fx):
    H, W, w = _grid(fx)
    ours = zipar_schedule(H, W, w)
    for name in CASES:
        c = _case(fx, name)
        assert not schedule_mismatches(ours, upstream_steps(c)), schedule_mismatches(ours, upstream_steps(c))
        assert c["forwards"] == 1 + len(ours) == 2 * W + (H - 2) * w  # docs/methods.md section 8.1's count
        # upstream fed the tokens its probe row says: each is the final image's token at that index
        fed = c["fwd"] > 0
        assert torch.equal(c["fed_tokens"][:, fed], c["tokens"][:, c["fed_index"][fed]])
    aux = [(k, f, p) for k, s in enumerate(ours) for f, p, j in zip(s.fed, s.positions, s.sample) if f != p]
    assert aux == [(6, 4, 9), (8, 8, 14), (10, 13, 19)]  # (forward - 1, fed index, position): row r-1's latest
    # token (row 1 unfinished at (1, 3) when row 3 starts) at the slot of row r's last token


# ------------------------------------------------------------------------------------ 2. logits
def zero_slot_reach(c: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(direct, reached), each (E,) bool, from the fixture alone: ``direct``, the query saw a zero
    slot itself; ``reached``, it did or it attends an entry that was reached (its keys and values
    from layer 1 on come from a forward that saw zero slots). A query at position p sees, at every
    slot <= p written so far, the latest entry written there (this forward's entries included)."""
    fwd, pos = c["fwd"].tolist(), c["pos"].tolist()
    direct = c["zero_slots"].any(-1)
    reached = direct.clone()
    for e in sorted(range(len(pos)), key=lambda e: (fwd[e], pos[e])):
        latest = {}
        for f in range(len(pos)):
            if fwd[f] <= fwd[e] and pos[f] <= pos[e] and fwd[f] > 0 and (pos[f] not in latest or fwd[f] > fwd[latest[pos[f]]]):
                latest[pos[f]] = f
        reached[e] |= any(bool(reached[f]) for f in latest.values() if f != e)
    return direct, reached


@pytest.mark.parametrize("name", CASES)
def test_logits_match_upstream_except_where_zero_slots_reach(fx, name):
    c = _case(fx, name)
    H, W, w = _grid(fx)
    steps = zipar_schedule(H, W, w)
    model = gpt_from_fixture(fx)
    ours = run_ours(LlamaGenTarget(model, cfg_scale=c["cfg_scale"]), _cond(fx), steps, c["tokens"])
    up = c["logits"]
    direct, reached = zero_slot_reach(c)
    assert int(direct.sum()) == c["entries_with_zero_slots"] == 6
    clean = ~reached
    assert int(clean.sum()) == 1 + 2 * W  # the prefill, rows 0 and 1 (every row from 2 on is reached)
    err = max_abs(ours[:, clean], up[:, clean])
    assert err <= fx.tol, f"{name}: queries no zero slot reaches differ by {err:.3g} > {fx.tol:g}"
    # upstream's zero keys and values take softmax mass (ours masks them): every query that saw one
    # differs, and so does every query that attends such a query's entry (2 layers: its keys and values
    # from layer 1 on carry the difference)
    diff = (ours - up).abs().amax(-1).amax(0)  # (E,) max abs per query
    assert diff[direct].min() > 1e2 * fx.tol, f"{name}: a zero-slot query agrees with upstream"
    inherited = reached & ~direct
    assert diff[inherited].min() > fx.tol, f"{name}: a query reached by zero slots agrees with upstream"
    # ... and that is the whole difference: a static-cache replay with zero slots is upstream everywhere
    with torch.no_grad():
        replay_up = static_cache_replay(model, _cond(fx), c["cfg_scale"], steps, c["tokens"], zero_slots=True)
    err_replay = max_abs(replay_up, up)
    assert err_replay <= fx.tol, f"{name}: static-cache replay with zero slots vs upstream {err_replay:.3g}"
    print(f"\n{name}: logit scale {up.abs().max():.3g}; {int(clean.sum())} queries no zero slot reaches: max abs "
          f"error {err:.2g}; {int(direct.sum())} that see zero slots differ by {diff[direct].min():.3g} .. "
          f"{diff[direct].max():.3g}, {int(inherited.sum())} that attend their entries by {diff[inherited].min():.3g} .. "
          f"{diff[inherited].max():.3g}; static-cache replay with zero slots vs upstream {err_replay:.2g}")


@pytest.mark.parametrize("name", CASES)
def test_ours_is_the_static_cache_replay_with_zero_slots_masked(fx, name):
    """Ours at EVERY query (rows reached by zero slots included) is the static-cache replay with the
    undecoded slots masked: with ``test_logits_match_upstream_except_where_zero_slots_reach`` (the same
    replay with them attended is upstream), our logits are upstream's but for the zero slots."""
    c = _case(fx, name)
    H, W, w = _grid(fx)
    steps = zipar_schedule(H, W, w)
    model = gpt_from_fixture(fx)
    ours = run_ours(LlamaGenTarget(model, cfg_scale=c["cfg_scale"]), _cond(fx), steps, c["tokens"])
    with torch.no_grad():
        replay = static_cache_replay(model, _cond(fx), c["cfg_scale"], steps, c["tokens"], zero_slots=False)
    err = (replay - ours).abs().amax(-1).amax(0)
    bad = [(int(c["fwd"][e]), int(c["pos"][e]), f"{err[e]:.3g}") for e in torch.nonzero(err > fx.tol).flatten()]
    assert not bad, f"{name}: (forward, position, max abs) where ours is not the masked replay: {bad}"


# ------------------------------------------------------------------------------------ 3. draws
@pytest.mark.parametrize("name", CASES)
def test_draws_match_upstream_where_logits_agree(fx, name):
    c = _case(fx, name)
    H, W, w = _grid(fx)
    steps = zipar_schedule(H, W, w)
    model = gpt_from_fixture(fx)
    cond = _cond(fx)
    ours = run_ours(LlamaGenTarget(model, cfg_scale=c["cfg_scale"]), cond, steps, c["tokens"])
    warp = {"temperature": c["temperature"], "top_k": c["top_k"], "top_p": c["top_p"]}
    drawn = c["sample"] >= 0
    agree = drawn & ~zero_slot_reach(c)[1]
    u = c["u"]
    # the uniform convention: our inverse-CDF sampler on upstream's own p draws upstream's token, every query
    assert torch.equal(sample_inverse_cdf(c["probs"][:, drawn].double(), u[:, drawn]), c["drawn"][:, drawn])
    # our warper is upstream's (temperature, top-k) on upstream's logits
    assert max_abs(warp_probs(c["logits"][:, drawn], **warp), c["probs"][:, drawn]) < 1e-6
    # our p from OUR logits, the same uniforms: upstream's token wherever the logits agree
    p = warp_probs(ours, **warp).double()
    assert torch.equal(sample_inverse_cdf(p[:, agree], u[:, agree]), c["drawn"][:, agree])
    # the whole loop, fed the recorded uniforms: upstream's image if no zero-slot query drew otherwise
    same = torch.equal(sample_inverse_cdf(p[:, drawn], u[:, drawn]), c["drawn"][:, drawn])
    res = row_parallel_generate(LlamaGenTarget(model, cfg_scale=c["cfg_scale"]), H * W, _Replay(c, steps),
                                RowParallel(w, W), SamplingConfig(**warp), cond, batch_size=u.shape[0],
                                sync=lambda: None, distortion=False)
    assert same  # measured in both cases: the zero slots move no draw across a CDF step here
    assert torch.equal(res.tokens, c["tokens"])  # so our whole loop makes upstream's image
    print(f"\n{name}: {int(agree.sum())} draws where the logits agree, all upstream's; zero-slot draws the same "
          f"token too: {same}; the loop's image == upstream's: {torch.equal(res.tokens, c['tokens'])}")


class _Replay:
    """The loop's rng (``row_parallel_generate`` asks one uniform per query per forward, the prefill
    first): upstream's recorded uniform where a query drew, 0.5 where its output is unused."""

    def __init__(self, c: dict, steps: list[RowStep]):
        u = torch.nan_to_num(c["u"], nan=0.5)
        sizes = [1] + [len(s.fed) for s in steps]
        self.blocks = list(torch.split(u, sizes, dim=1))

    def uniform(self, n: int) -> torch.Tensor:
        u = self.blocks.pop(0)
        assert u.shape[1] == n
        return u


# ------------------------------------------------------------------------------------ 4. mutations
def test_aux_from_row_r_fails_the_schedule_check(fx):
    """Negative control for check 1: the auxiliary first query of row r+1 fed row r's latest token
    (its window-th) instead of row r-1's."""
    H, W, w = _grid(fx)
    mutant = []
    for s in zipar_schedule(H, W, w):
        fed = tuple((p // W) * W + w - 1 if f != p else f for f, p in zip(s.fed, s.positions))
        mutant.append(RowStep(fed, s.positions, s.sample))
    bad = schedule_mismatches(mutant, upstream_steps(_case(fx, "cfg2")))
    assert len(bad) == 3, bad  # every forward with an auxiliary token


def test_positions_shifted_by_one_fail_the_logit_check(fx):
    """Negative control for check 2: the same forwards with every image position one later."""
    c = _case(fx, "cfg2")
    H, W, w = _grid(fx)
    ours = run_ours(LlamaGenTarget(gpt_from_fixture(fx), cfg_scale=c["cfg_scale"]), _cond(fx),
                    zipar_schedule(H, W, w), c["tokens"], shift=1)
    agree = ~zero_slot_reach(c)[1]
    agree[0] = False  # the prefill has no image position
    assert max_abs(ours[:, agree], c["logits"][:, agree]) > 1e3 * fx.tol
    assert not math.isnan(ours.sum().item())
