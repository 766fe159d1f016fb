"""EAGLE-1 drafter head: architecture against an independent reference, tree-masked cached
forwards against plain full forwards per root-to-node path, batch independence, the inference /
training feature alignment, lossless greedy speculative decoding with a tiny LlamaGen target,
LANTERN state-dict layout, and the training recipe (float64, tiny random models)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from coolsd.engine.decoding.rng import PerSampleRNG
from coolsd.engine.decoding.trees import make_tree
from coolsd.models.eagle import (
    LLAMAGEN_T2I_DRAFTER,
    EagleBatch,
    EagleConfig,
    EagleDrafter,
    EagleHead,
    evaluate_eagle,
    llamagen_batch,
    llamagen_features,
    train_eagle,
)
from coolsd.engine.drafting import ModelDrafter, SamplingConfig
from coolsd.engine.loop import speculative_generate
from coolsd.engine.methods import build_method
from coolsd.models.llamagen import LlamaGenGPT, LlamaGenTarget, tiny
from coolsd.engine.model_protocol import ARModel

TOL = 1e-9
CFG = tiny()  # dim 64, 4 heads, vocab 64, 8 text slots, 4x4 grid
T, N, H, V = CFG.cls_token_num, CFG.block_size, CFG.dim, CFG.vocab_size
TREE = make_tree("mc_sim_7b_63")


def make_model(seed: int = 0) -> LlamaGenGPT:
    torch.manual_seed(seed)
    model = LlamaGenGPT(CFG, init_std=0.15).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model.eval()


def make_head(model=None, seed: int = 3, **overrides) -> EagleHead:
    model = model or make_model()
    head = EagleHead.from_target(model, seed=seed, **overrides)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return head.eval()


def make_cond(valid: list[int], seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    B = len(valid)
    caption = torch.randn(B, T, CFG.caption_dim, generator=g, dtype=torch.float64)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(valid):
        mask[b, T - n :] = True
    return {"caption_embs": caption, "emb_mask": mask}


def close(a, b, tol=TOL):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max().item()
    assert err < tol, err


# ------------------------------------------------------------------------------ reference
def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope_table(positions, cfg: EagleConfig):
    """(L, D/2, 2) (cos, sin) as upstream's precompute_freqs_cis_2d row for each position
    (negative = text slot = zeros)."""
    half = cfg.head_dim // 2
    freqs = 1.0 / (cfg.rope_base ** (torch.arange(0, half, 2)[: half // 2].double() / half))
    g = cfg.grid_size
    p = positions.clamp(min=0)
    ang = torch.cat([torch.outer((p // g).double(), freqs), torch.outer((p % g).double(), freqs)], -1)
    table = torch.stack([ang.cos(), ang.sin()], -1)
    return table * (positions >= 0).double()[:, None, None]


def _rope(x, table):
    xs = x.reshape(*x.shape[:-1], -1, 2)
    c, s = table[:, None, :, 0], table[:, None, :, 1]
    return torch.stack([xs[..., 0] * c - xs[..., 1] * s, xs[..., 1] * c + xs[..., 0] * s], -1).flatten(2)


@torch.no_grad()
def reference_head(head: EagleHead, tokens, feats, positions):
    """Independent single-sequence, causal forward from the state dict: (L,) (L, H) (L,) -> (L, H)."""
    sd, cfg = head.state_dict(), head.config
    nh, D, L = cfg.num_attention_heads, cfg.head_dim, tokens.shape[0]
    x = torch.cat([sd["embed_tokens.weight"][tokens], feats], -1) @ sd["fc.weight"].T + sd["fc.bias"]
    table = _rope_table(positions, cfg)
    p = "layers.0."
    q = _rope((x @ sd[p + "self_attn.q_proj.weight"].T).view(L, nh, D), table)
    k = _rope((x @ sd[p + "self_attn.k_proj.weight"].T).view(L, nh, D), table)
    v = (x @ sd[p + "self_attn.v_proj.weight"].T).view(L, nh, D)
    att = (torch.einsum("ihd,jhd->hij", q, k) / D**0.5)
    att = att.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    x = x + torch.einsum("hij,jhd->ihd", att, v).reshape(L, -1) @ sd[p + "self_attn.o_proj.weight"].T
    h = _rms(x, sd[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
    ff = F.silu(h @ sd[p + "mlp.gate_proj.weight"].T) * (h @ sd[p + "mlp.up_proj.weight"].T)
    return x + ff @ sd[p + "mlp.down_proj.weight"].T


def test_head_matches_reference():
    head = make_head()
    g = torch.Generator().manual_seed(0)
    L = 9
    tokens = torch.randint(0, V, (2, L), generator=g)
    feats = torch.randn(2, L, H, generator=g, dtype=torch.float64)
    positions = torch.stack([torch.arange(L), torch.arange(L) - 3])  # row 1: 3 text slots first
    out = head(tokens, feats, positions)
    for b in range(2):
        close(out[b], reference_head(head, tokens[b], feats[b], positions[b]))


# ------------------------------------------------------------------------------ tree / cache
def run_rounds(drafter: EagleDrafter, tokens, feats, n_keep, guided: bool):
    """Two ModelDrafter-style rounds: context forward (causal) + commit n_keep[r], then the
    tree levels under the tree mask; the pending tree is dropped at the end of the round.
    tokens[r]: (B, C + n_nodes + 1) with context then tree nodes 1..n; feats likewise.
    Returns per round the tree-node outputs {node: (logits (B, V), hidden)}."""
    B = tokens[0].shape[0]
    drafter.begin(None, B)
    length = torch.zeros(B, dtype=torch.long)
    results = []
    for r in range(len(tokens)):
        C = tokens[r].shape[1] - TREE.n_nodes
        pos = length.unsqueeze(1) + torch.arange(C)
        drafter.forward(tokens[r][:, :C], pos, torch.ones(C, C, dtype=torch.bool).tril(), feats[r][:, :C])
        drafter.commit(torch.arange(C).expand(B, C), n_keep[r])
        length = length + n_keep[r]
        forwarded, out = [], {}
        for d in range(TREE.max_depth):
            nxt = [int(c) for c in TREE.level(d + 1)]
            attend = TREE.ancestors[nxt][:, forwarded + nxt]
            pos = (length - 1).unsqueeze(1) + TREE.depth[nxt].unsqueeze(0)
            cols = [C - 1 + c for c in nxt]
            step = drafter.forward(tokens[r][:, cols], pos, attend, feats[r][:, cols])
            for j, c in enumerate(nxt):
                out[c] = (step.logits[:, j], step.hidden[:, j])
            forwarded.extend(nxt)
        drafter.commit(torch.zeros(B, 0, dtype=torch.long), torch.zeros(B, dtype=torch.long))
        results.append(out)
    return results


def random_rounds(B, guided, seed=0, C=(4, 3)):
    g = torch.Generator().manual_seed(seed)
    tokens, feats = [], []
    for c in C:
        L = c + TREE.n_nodes
        tokens.append(torch.randint(0, V, (B, L), generator=g))
        shape = (B, L, 2, H) if guided else (B, L, H)
        feats.append(torch.randn(shape, generator=g, dtype=torch.float64))
    return tokens, feats


@pytest.mark.parametrize("guided", [True, False])
def test_tree_forward_equals_path_forward(guided):
    """Every tree node's output equals a plain causal forward over the committed context and
    the root-to-node path (both CFG halves; logits CFG-combined)."""
    head, model = make_head(), make_model()
    scale = 3.0
    drafter = EagleDrafter(head, model.output.weight, scale)
    B = 2
    tokens, feats = random_rounds(B, guided)
    n_keep = [torch.tensor([4, 2]), torch.tensor([1, 3])]
    res = run_rounds(drafter, tokens, feats, n_keep, guided)
    W = model.output.weight.detach()
    for b in range(B):
        ctx_t, ctx_f = [], []
        for r in range(2):
            C = tokens[r].shape[1] - TREE.n_nodes
            k = int(n_keep[r][b])
            ctx_t.append(tokens[r][b, :k])
            ctx_f.append(feats[r][b, :k])
            for node in range(1, TREE.n_nodes + 1):
                path = [node]
                while int(TREE.parent[path[0]]) > 0:
                    path.insert(0, int(TREE.parent[path[0]]))
                cols = [C - 1 + c for c in path]
                seq_t = torch.cat(ctx_t + [tokens[r][b, cols]])
                seq_f = torch.cat(ctx_f + [feats[r][b, cols]])
                L = seq_t.shape[0]
                halves = [seq_f[:, 0], seq_f[:, 1]] if guided else [seq_f]
                outs = [reference_head(head, seq_t, f, torch.arange(L))[-1] for f in halves]
                logit, hid = res[r][node]
                lg = [o @ W.T for o in outs]
                if guided:
                    close(hid[b], torch.stack(outs))
                    close(logit[b], lg[1] + scale * (lg[0] - lg[1]))
                else:
                    close(hid[b], outs[0])
                    close(logit[b], lg[0])


def test_batch_equals_single():
    head, model = make_head(), make_model()
    drafter = EagleDrafter(head, model.output.weight, 2.0)
    tokens, feats = random_rounds(2, True, seed=4)
    n_keep = [torch.tensor([3, 1]), torch.tensor([2, 3])]
    both = run_rounds(drafter, tokens, feats, n_keep, True)
    for b in range(2):
        one = run_rounds(drafter, [t[b : b + 1] for t in tokens], [f[b : b + 1] for f in feats],
                         [k[b : b + 1] for k in n_keep], True)
        for r in range(2):
            for node, (lg, hd) in one[r].items():
                close(both[r][node][0][b : b + 1], lg, 1e-12)
                close(both[r][node][1][b : b + 1], hd, 1e-12)


def test_text_prefix_prefill():
    """With ``text_prefix`` the context's slot features become zero-rotation entries (token 0)
    before the first image entry, LANTERN's drafter layout."""
    head, model = make_head(), make_model()
    drafter = EagleDrafter(head, model.output.weight, 1.0, text_prefix=True)
    assert isinstance(drafter, ARModel)
    g = torch.Generator().manual_seed(5)
    slots = torch.randn(1, T, H, generator=g, dtype=torch.float64)
    from coolsd.engine.model_protocol import StepOut

    drafter.begin(None, 1, StepOut(logits=torch.zeros(1, T, V), hidden=slots))
    toks = torch.randint(0, V, (1, 3), generator=g)
    feats = torch.cat([slots[:, -1:], torch.randn(1, 2, H, generator=g, dtype=torch.float64)], 1)
    out = drafter.forward(toks, torch.arange(3).unsqueeze(0), torch.ones(3, 3, dtype=torch.bool).tril(), feats)
    seq_t = torch.cat([torch.zeros(T - 1, dtype=torch.long), toks[0]])
    seq_f = torch.cat([slots[0, :-1], feats[0]])
    pos = torch.cat([torch.full((T - 1,), -1), torch.arange(3)])
    close(out.hidden[0], reference_head(head, seq_t, seq_f, pos)[T - 1 :])


# ------------------------------------------------------------------------------ generation
class SpyDrafter(EagleDrafter):
    """Records the (token, position, feature) of every committed drafter entry."""

    def begin(self, cond, batch_size, context=None):
        self.entries = [[] for _ in range(batch_size)]
        return super().begin(cond, batch_size, context)

    def forward(self, tokens, positions, attend, features=None):
        self._last = (tokens, positions, features)
        return super().forward(tokens, positions, attend, features)

    def commit(self, keep, n_keep):
        tokens, positions, features = self._last
        for b in range(tokens.shape[0]):
            kept = range(int(n_keep[b])) if keep is None else keep[b, : int(n_keep[b])].tolist()  # None: in order
            for j in kept:
                self.entries[b].append((int(tokens[b, j]), int(positions[b, j]), features[b, j]))
        super().commit(keep, n_keep)


def test_speculative_greedy_equals_ar_and_alignment():
    """Greedy speculative decoding with the EAGLE drafter (tree mc_sim_7b_63, CFG 3) equals
    greedy AR; the drafter's committed entries are exactly the training entries that
    ``llamagen_features`` builds from the generated tokens (entry j = (x_j, f before x_j) at j)."""
    model = make_model()
    cond = make_cond([3, T])
    sampling = SamplingConfig(temperature=0.0)
    target = LlamaGenTarget(model, cfg_scale=3.0)
    plain = speculative_generate(target, N, PerSampleRNG([0, 1]), cond=cond, batch_size=2, sampling=sampling)
    method = build_method("eagle", tree="mc_sim_7b_63")
    assert method.drafter == "model" and method.tree.n_nodes == 25
    spy = SpyDrafter.for_target(make_head(model), target)
    spec = speculative_generate(
        target, N, PerSampleRNG([0, 1]), rule=method.rule, drafter=ModelDrafter(spy, sampling),
        tree=method.tree, cond=cond, batch_size=2, sampling=sampling,
    )
    assert torch.equal(plain.tokens, spec.tokens)
    feats, _ = llamagen_features(model, cond, spec.tokens, both_halves=True)
    for b in range(2):
        entries = spy.entries[b]
        assert [p for _, p, _ in entries] == list(range(len(entries)))
        assert len(entries) >= N - TREE.max_depth - 1
        for tok, pos, f in entries:
            assert tok == int(spec.tokens[b, pos])
            close(f, feats[b, pos], 1e-8)


# ------------------------------------------------------------------------------ layout
UPSTREAM_KEYS = {
    "embed_tokens.weight": (16384, 1280),
    "fc.weight": (1280, 2560),
    "fc.bias": (1280,),
    "layers.0.self_attn.q_proj.weight": (1280, 1280),
    "layers.0.self_attn.k_proj.weight": (1280, 1280),
    "layers.0.self_attn.v_proj.weight": (1280, 1280),
    "layers.0.self_attn.o_proj.weight": (1280, 1280),
    "layers.0.mlp.gate_proj.weight": (3584, 1280),
    "layers.0.mlp.up_proj.weight": (3584, 1280),
    "layers.0.mlp.down_proj.weight": (1280, 3584),
    "layers.0.post_attention_layernorm.weight": (1280,),
}


def test_lantern_layout():
    lantern_json = {  # data/configs/llamagen_t2i_config.json (fields used)
        "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3584, "num_attention_heads": 20,
        "num_hidden_layers": 1, "num_key_value_heads": 20, "rms_norm_eps": 1e-06, "vocab_size": 16384,
        "input_type": "t2i",
    }
    assert EagleConfig.from_lantern(lantern_json) == LLAMAGEN_T2I_DRAFTER
    assert EagleConfig.from_lantern({**lantern_json, "input_type": "t2i2"}).block_size == 1024
    head = EagleHead(LLAMAGEN_T2I_DRAFTER)  # 45M parameters, ~1 s (meta tensors are slower here)
    assert {k: tuple(v.shape) for k, v in head.state_dict().items()} == UPSTREAM_KEYS
    assert not head.embed_tokens.weight.requires_grad
    # round trip on a tiny head, tolerating the rotary buffer some transformers versions saved
    a, b = make_head(seed=3), make_head(seed=4)
    sd = {**a.state_dict(), "layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(4)}
    b.load_lantern(sd)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k])
    assert not b.embed_tokens.weight.requires_grad


# ------------------------------------------------------------------------------ training
def small_batches(model, n_batches=2, B=3, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_batches):
        cond = make_cond([T - (i + b) % 4 for b in range(B)], seed=100 + i)
        tokens = torch.randint(0, V, (B, N), generator=g)
        out.append(llamagen_batch(model, cond, tokens, generator=g, **kw))
    return out


def test_llamagen_batch_matches_target_hidden():
    """Builder features == the guided target's hidden during an AR pass over the same tokens;
    per-sample uncond replacement picks the uncond half."""
    model = make_model()
    cond = make_cond([2, T])
    tokens = torch.randint(0, V, (2, N), generator=torch.Generator().manual_seed(9))
    target = LlamaGenTarget(model, cfg_scale=2.0)
    pre = target.begin(cond, 2)
    out = target.forward(tokens, torch.arange(N).expand(2, N), torch.ones(N, N, dtype=torch.bool).tril())
    expect = torch.cat([pre.hidden, out.hidden], 1)  # (B, N+1, 2, H)
    both, slots = llamagen_features(model, cond, tokens, both_halves=True)
    close(both, expect, 1e-9)
    close(slots[:, -1], pre.hidden[:, 0], 1e-9)
    mixed, _ = llamagen_features(model, cond, tokens, uncond=torch.tensor([True, False]))
    close(mixed[0], expect[0, :, 1], 1e-9)
    close(mixed[1], expect[1, :, 0], 1e-9)


def test_training_reduces_loss_and_is_deterministic():
    model = make_model()
    batches = small_batches(model, n_batches=1)
    W = model.output.weight
    before = evaluate_eagle(make_head(model), W, batches)
    runs = []
    for _ in range(2):
        head = make_head(model)
        log = train_eagle(head, W, batches, steps=30, lr=3e-3, seed=7)
        runs.append((log, head.state_dict()))
    (log, sd), (log2, sd2) = runs
    assert log.loss == log2.loss
    for k in sd:
        assert torch.equal(sd[k], sd2[k]), k
    after = evaluate_eagle(_loaded(model, sd), W, batches)
    assert after["loss"] < 0.7 * before["loss"], (before, after)
    assert log.lr[0] == pytest.approx(3e-3) and log.lr[-1] < 3e-3 / 10
    assert sd["embed_tokens.weight"].equal(model.tok_embeddings.weight)  # frozen
    # a different seed changes the noise, hence the trajectory
    log3 = train_eagle(make_head(model), W, batches, steps=3, lr=3e-3, seed=8)
    assert log3.loss[1:] != log.loss[1:3]


def _loaded(model, sd):
    head = make_head(model)
    head.load_state_dict(sd)
    return head


def test_training_guided_batches_and_prefix():
    """Both-halves batches (top1_cfg reported) and LANTERN's text-prefix layout train too."""
    model = make_model()
    W = model.output.weight
    for kw in ({"both_halves": True}, {"text_prefix": True}):
        batches = small_batches(model, n_batches=1, B=2, **kw)
        head = make_head(model)
        before = evaluate_eagle(head, W, batches, cfg_scale=3.0)
        train_eagle(head, W, batches, steps=15, lr=3e-3, seed=0)
        after = evaluate_eagle(head, W, batches, cfg_scale=3.0)
        assert after["loss"] < before["loss"]
        assert ("top1_cfg" in after) == ("both_halves" in kw)
        assert 0.0 <= after["top1"] <= 1.0


def test_training_entries_alignment():
    """Entry t = (x_t, features[:, t]) at position t, regression target features[:, t+1]; the
    text prefix comes first as (token 0, slot feature, position -1)."""
    from coolsd.models.eagle.training import assemble

    B, n, P = 2, 5, 3
    tokens = torch.arange(B * n).view(B, n)
    feats = torch.arange(B * (n + 1), dtype=torch.float64).view(B, n + 1, 1).expand(B, n + 1, 4)
    toks, inp, pos, tgt, p = assemble(EagleBatch(tokens, feats))
    assert p == 0 and torch.equal(toks, tokens) and torch.equal(pos, torch.arange(n).expand(B, n))
    assert torch.equal(inp, feats[:, :n]) and torch.equal(tgt, feats[:, 1:])
    prefix = -torch.ones(B, P, 4, dtype=torch.float64)
    guided = torch.stack([feats, feats + 100], dim=2)
    toks, inp, pos, tgt, p = assemble(EagleBatch(tokens, guided, torch.stack([prefix, prefix], 2)))
    assert p == P and toks.shape == (2 * B, P + n) and torch.equal(toks[:B, P:], tokens)
    assert (toks[:, :P] == 0).all() and (pos[:, :P] == -1).all() and torch.equal(pos[0, P:], torch.arange(n))
    assert torch.equal(inp[B:, P:], feats[:, :n] + 100) and torch.equal(tgt[B:], feats[:, 1:] + 100)
    # features without the last image token's feature: one entry fewer
    assert EagleBatch(tokens, feats[:, :n]).n_entries == n - 1
