"""LlamaGen adapter: cached / tree-masked / committed forwards against an independent full-sequence
reference (float64, tiny random model), and the upstream state-dict layout."""
from __future__ import annotations

import pytest
import torch

from coolsd.engine.decoding.rng import PerSampleRNG
from coolsd.engine.decoding.rules import ExactRule
from coolsd.engine.decoding.trees import build_tree
from coolsd.engine.drafting import ModelDrafter, SamplingConfig
from coolsd.engine.loop import speculative_generate
from coolsd.models.kv_cache import KVCache
from coolsd.models.llamagen import GPT_XL, LlamaGenGPT, LlamaGenTarget, tiny
from coolsd.engine.model_protocol import ARModel
from factories import llamagen_cond as make_cond, llamagen_gpt as make_model, random_ids
from protocol_checks import path_to, run_tree_round

TOL = 1e-6
CFG = tiny()  # dim 64, 2 layers, 4 heads, vocab 64, 8 text slots, caption dim 16, 4x4 grid
T, N = CFG.cls_token_num, CFG.block_size


# ------------------------------------------------------------------------------ fixtures
def cond_half(hidden: torch.Tensor) -> torch.Tensor:
    """Guided targets return (B, m, 2, H) = [cond, uncond]; unguided (B, m, H)."""
    return hidden[:, :, 0] if hidden.dim() == 4 else hidden


# the model (make_model: float64, norms perturbed) and captions (make_cond) come from factories.py
def random_tokens(*shape: int, seed: int = 2) -> torch.Tensor:
    return random_ids(*shape, high=CFG.vocab_size, seed=seed)


# ------------------------------------------------------------------------------ reference
def upstream_rope_table() -> torch.Tensor:
    """(T + N, head_dim/2, 2) (cos, sin) by sequence index, built as upstream's
    precompute_freqs_cis_2d: zeros for the text slots, then the row-major grid."""
    half = CFG.head_dim // 2
    freqs = 1.0 / (CFG.rope_base ** (torch.arange(0, half, 2)[: half // 2].double() / half))
    g = CFG.grid_size
    f = torch.outer(torch.arange(g).double(), freqs)
    grid = torch.cat([f[:, None, :].expand(g, g, -1), f[None, :, :].expand(g, g, -1)], dim=-1)
    table = torch.stack([grid.cos(), grid.sin()], dim=-1).flatten(0, 1)
    return torch.cat([torch.zeros(T, half, 2, dtype=torch.float64), table])


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + CFG.norm_eps) * w


def _rope(x, table):  # x (L, H, D), table (L, D/2, 2)
    xs = x.reshape(*x.shape[:-1], -1, 2)
    c, s = table[:, None, :, 0], table[:, None, :, 1]
    return torch.stack([xs[..., 0] * c - xs[..., 1] * s, xs[..., 1] * c + xs[..., 0] * s], -1).flatten(2)


@torch.no_grad()
def reference_single(model, caption, mask, tokens):
    """One sequence [text slots, image tokens] in one pass: causal mask, text columns masked
    by the padding mask, diagonal on. Returns (hidden after final norm, logits), (L, .)."""
    sd = model.state_dict()
    H, D = CFG.n_head, CFG.head_dim
    cap = caption @ sd["cls_embedding.cap_proj.fc1.weight"].T
    cap = torch.nn.functional.gelu(cap, approximate="tanh") @ sd["cls_embedding.cap_proj.fc2.weight"].T
    x = torch.cat([cap, sd["tok_embeddings.weight"][tokens]])
    L = x.shape[0]
    allowed = torch.ones(L, L, dtype=torch.bool).tril()
    allowed[:, :T] &= mask.unsqueeze(0)
    allowed |= torch.eye(L, dtype=torch.bool)
    table = upstream_rope_table()[:L]
    for i in range(CFG.n_layer):
        p = f"layers.{i}."
        xn = _rms(x, sd[p + "attention_norm.weight"])
        q, k, v = (xn @ sd[p + "attention.wqkv.weight"].T).split(CFG.dim, -1)
        q, k, v = _rope(q.view(L, H, D), table), _rope(k.view(L, H, D), table), v.view(L, H, D)
        scores = torch.einsum("ihd,jhd->hij", q, k) / D**0.5
        att = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        x = x + torch.einsum("hij,jhd->ihd", att, v).reshape(L, -1) @ sd[p + "attention.wo.weight"].T
        hn = _rms(x, sd[p + "ffn_norm.weight"])
        gate = torch.nn.functional.silu(hn @ sd[p + "feed_forward.w1.weight"].T)
        ff = gate * (hn @ sd[p + "feed_forward.w3.weight"].T)
        x = x + ff @ sd[p + "feed_forward.w2.weight"].T
    hidden = _rms(x, sd["norm.weight"])
    return hidden, hidden @ sd["output.weight"].T


def reference(model, cond, b, tokens, cfg_scale):
    """CFG-combined logits and cond hidden of sample b; row T-1+j predicts image token j."""
    caption = cond["caption_embs"][b] * cond["emb_mask"][b, :, None]
    mask = cond["emb_mask"][b]
    h, lc = reference_single(model, caption, mask, tokens)
    if cfg_scale == 1.0:
        return lc, h
    _, lu = reference_single(model, model.cls_embedding.uncond_embedding, mask, tokens)
    return lu + cfg_scale * (lc - lu), h


def close(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max().item()
    assert err < TOL, err


# ------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_prefill_then_token_by_token_matches_full_forward(cfg_scale):
    model = make_model()
    target = LlamaGenTarget(model, cfg_scale=cfg_scale)
    assert isinstance(target, ARModel) and target.n_image_tokens == N
    cond = make_cond([3, T])
    tokens = random_tokens(2, N)
    out = target.begin(cond, 2)
    refs = [reference(model, cond, b, tokens[b], cfg_scale) for b in range(2)]
    assert out.logits.shape == (2, 1, CFG.vocab_size) and out.logits.dtype == torch.float64
    for b, (lr, hr) in enumerate(refs):
        close(out.logits[b, 0], lr[T - 1])
        close(cond_half(out.hidden)[b, 0], hr[T - 1])
    one = torch.ones(1, 1, dtype=torch.bool)
    for j in range(N):
        step = target.forward(tokens[:, j : j + 1], torch.full((2, 1), j), one)
        for b, (lr, hr) in enumerate(refs):
            close(step.logits[b, 0], lr[T + j])
            close(cond_half(step.hidden)[b, 0], hr[T + j])
        target.commit(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long))


def test_text_padding_changes_output():
    """Guard against a reference that ignores the mask: padded slots must not be seen."""
    model = make_model()
    target = LlamaGenTarget(model, cfg_scale=1.0)
    cond = make_cond([3, 3])
    cond["caption_embs"][1] = cond["caption_embs"][0]
    cond["caption_embs"][1, : T - 3] += 5.0  # only padded slots differ
    out = target.begin(cond, 2)
    close(out.logits[0], out.logits[1])
    cond["emb_mask"][1, :] = True
    out2 = target.begin(cond, 2)
    assert (out2.logits[0] - out2.logits[1]).abs().max() > 1e-3


TREE = build_tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])  # root + 6 nodes, depth 3


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("prefix_len,headroom", [(3, 64), (10, 0)])  # headroom 0 forces growth
def test_tree_forward_matches_path_forward(split, prefix_len, headroom):
    model = make_model()
    target = LlamaGenTarget(model, cfg_scale=2.0, cache_headroom=headroom)
    cond = make_cond([5, 2])
    prefix, tree_tokens = random_tokens(2, prefix_len, seed=3), random_tokens(2, TREE.n_nodes + 1, seed=4)
    logits = run_tree_round(target, cond, prefix, tree_tokens, TREE, split)
    for b in range(2):
        for i in range(TREE.n_nodes + 1):
            seq = torch.cat([prefix[b], tree_tokens[b, path_to(TREE, i)]])
            lr, _ = reference(model, cond, b, seq, 2.0)
            close(logits[b, i], lr[-1])


KEPT = [path_to(TREE, 6), path_to(TREE, 2)]  # sample 0 keeps root->node 6 (4 entries), sample 1 root->node 2


def commit_and_continue(target, cond, rows):
    """For the samples ``rows`` of a fixed batch of 2: a tree round after a 3-token prefix, commit
    of each sample's KEPT path (different lengths), then 2 more tokens at each sample's own
    positions. Returns those logits (len(rows), 2, V) and the full committed token sequences."""
    prefix = random_tokens(2, 3, seed=3)[rows]
    tree_tokens = random_tokens(2, TREE.n_nodes + 1, seed=4)[rows]
    new = random_tokens(2, 2, seed=10)[rows]
    paths = [KEPT[b] for b in rows]
    cond = {k: v[rows] for k, v in cond.items()}
    B = len(rows)
    run_tree_round(target, cond, prefix, tree_tokens, TREE, split=False)
    keep = torch.zeros(B, 4, dtype=torch.long)  # columns past n_keep are ignored
    for i, p in enumerate(paths):
        keep[i, : len(p)] = torch.tensor(p)
    n_keep = torch.tensor([len(p) for p in paths])
    target.commit(keep, n_keep)
    positions = (3 + n_keep).unsqueeze(1) + torch.arange(2)
    logits = target.forward(new, positions, torch.ones(2, 2, dtype=torch.bool).tril()).logits
    seqs = [torch.cat([prefix[i], tree_tokens[i, paths[i]], new[i]]) for i in range(B)]
    return logits, seqs


def test_commit_path_then_continue_matches_full_forward():
    model = make_model()
    cond = make_cond([5, 2])
    logits, seqs = commit_and_continue(LlamaGenTarget(model, cfg_scale=2.0), cond, [0, 1])
    for b in range(2):
        lr, _ = reference(model, cond, b, seqs[b], 2.0)
        close(logits[b], lr[-2:])


def test_batch_equals_single_runs():
    model = make_model()
    cond = make_cond([5, 2])
    batched, _ = commit_and_continue(LlamaGenTarget(model, cfg_scale=2.0), cond, [0, 1])
    for b in range(2):
        single, _ = commit_and_continue(LlamaGenTarget(model, cfg_scale=2.0), cond, [b])
        close(single[0], batched[b])


def test_kv_cache_commit_keeps_given_order_per_sample(monkeypatch):
    cache = KVCache(n_layers=1, batch_size=2, n_heads=1, head_dim=1, max_len=8, dtype=torch.float64)
    vals = torch.arange(4, dtype=torch.float64).view(1, 1, 4, 1).expand(2, 1, 4, 1)
    step = cache.prepare(torch.ones(4, 4, dtype=torch.bool), 4)
    cache.attend(0, vals, vals, vals, step)
    cache.advance(4)
    cache.commit(torch.tensor([[2, 0, 3], [1, 1, 1]]), torch.tensor([3, 1]))
    assert cache.length.tolist() == [3, 1] and cache.n_pending == 0
    assert cache._max_committed >= 3  # the host's bound of the longest committed length (no read)
    assert cache.k[0][0, 0, :3, 0].tolist() == [2.0, 0.0, 3.0]
    assert cache.k[0][1, 0, :1, 0].tolist() == [1.0]
    # next step: sample 1's new entry sits at slot 1 and sees slot 0 only among committed ones
    step = cache.prepare(torch.ones(1, 1, dtype=torch.bool), 1)
    assert step.slots.tolist() == [[3], [1]]
    assert step.mask[1, 0, 0, :4].tolist() == [True, True, False, False] and not step.mask[1, 0, 0, 4:].any()
    with pytest.raises(ValueError):
        cache.prepare(torch.ones(1, 2, dtype=torch.bool), 1)  # no pending yet: attend is (1, 1)
    cache.advance(1)
    monkeypatch.setenv("COOLSD_CHECKS", "1")  # commits trust n_keep unless asked to check (a host read each)
    with pytest.raises(ValueError):
        cache.commit(torch.zeros(2, 2, dtype=torch.long), torch.tensor([2, 0]))  # only 1 pending


@pytest.mark.parametrize("drafter_kind", ["self", "other"])
def test_greedy_speculative_generation_equals_reference_greedy(drafter_kind):
    """End to end through ``speculative_generate`` with a drafted tree: the target itself as
    drafter (every draft accepted: long commits, trees running past the last image token) or
    another tiny LlamaGen (drafts rejected); both give the plain greedy sequence."""
    model = make_model()
    cond = make_cond([4, T])
    sampling = SamplingConfig(temperature=0.0)
    target = LlamaGenTarget(model, cfg_scale=3.0)
    plain = speculative_generate(target, N, PerSampleRNG([0, 1]), cond=cond, batch_size=2, sampling=sampling)
    if drafter_kind == "self":
        draft_model = LlamaGenTarget(model, cfg_scale=3.0)
    else:
        draft_model = LlamaGenTarget(make_model(seed=5), cfg_scale=1.0)
    spec = speculative_generate(
        target, N, PerSampleRNG([0, 1]), rule=ExactRule(), drafter=ModelDrafter(draft_model, sampling),
        tree=TREE, cond=cond, batch_size=2, sampling=sampling,
    )
    assert torch.equal(plain.tokens, spec.tokens)
    if drafter_kind == "self":
        assert min(max(r) for r in spec.round_lengths) == TREE.max_depth + 1
    for b in range(2):
        lr, _ = reference(model, cond, b, plain.tokens[b], 3.0)
        assert torch.equal(lr[T - 1 : T - 1 + N].argmax(-1), plain.tokens[b])


UPSTREAM_KEYS_2_LAYERS = [
    "cls_embedding.uncond_embedding",
    "cls_embedding.cap_proj.fc1.weight",
    "cls_embedding.cap_proj.fc2.weight",
    "tok_embeddings.weight",
    *[
        f"layers.{i}.{name}"
        for i in range(2)
        for name in (
            "attention.wqkv.weight",
            "attention.wo.weight",
            "feed_forward.w1.weight",
            "feed_forward.w3.weight",
            "feed_forward.w2.weight",
            "attention_norm.weight",
            "ffn_norm.weight",
        )
    ],
    "norm.weight",
    "output.weight",
]


def test_state_dict_keys_match_upstream_layout():
    model = make_model()
    sd = model.state_dict()
    assert list(sd) == UPSTREAM_KEYS_2_LAYERS
    d, ffn = CFG.dim, CFG.ffn_hidden
    assert sd["cls_embedding.uncond_embedding"].shape == (T, CFG.caption_dim)
    assert sd["cls_embedding.cap_proj.fc1.weight"].shape == (d, CFG.caption_dim)
    assert sd["layers.0.attention.wqkv.weight"].shape == (3 * d, d)
    assert sd["layers.0.feed_forward.w1.weight"].shape == (ffn, d)
    assert sd["output.weight"].shape == (CFG.vocab_size, d)
    assert GPT_XL.ffn_hidden == 3584 and GPT_XL.head_dim == 64

    fresh = LlamaGenGPT(CFG).double()
    fresh.load_upstream({"model": sd})
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), sd.values()))
    missing = dict(sd)
    del missing["layers.1.ffn_norm.weight"]
    with pytest.raises(RuntimeError, match="Missing key"):
        fresh.load_state_dict(missing, strict=True)
    with pytest.raises(RuntimeError, match="Missing key"):
        fresh.load_upstream({"model": missing})


def test_training_forward_matches_reference():
    """The cache-free teacher-forced forward (used to train toy targets) equals the reference."""
    model = make_model()
    cond = make_cond([3, T])
    tokens = random_tokens(2, N)
    hidden = model(cond["caption_embs"], cond["emb_mask"], tokens)
    for b in range(2):
        lr, hr = reference(model, cond, b, tokens[b], 1.0)
        close(hidden[b, T - 1 :], hr[T - 1 : T + N - 1])
