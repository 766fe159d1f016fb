"""``coolsd.engine.batch_invariant``: inside the context a sample's numbers do not depend on the batch it
shares, bit for bit (float32, shapes where GEMM blocking differs between 1 and 4 rows): linears,
cached attention over samples with different committed lengths (LlamaGen), a prefill of prompts
of different lengths (Lumina-mGPT), MAR's conditions, per-image decoding. Outside the context
nothing changes. The job-level contract (records of batch 4 = batch 1 under
``deterministic.batch_invariant=true``) is tests/worlds/test_worlds.py."""
import numpy as np
import torch
import torch.nn.functional as F

from coolsd.engine.batch_invariant import active, batch_invariant, per_sample
from coolsd.models.llamagen import LlamaGenConfig, LlamaGenGPT, LlamaGenTarget
from coolsd.engine.model_protocol import NULL_LABEL
from factories import VMAP, make_lm

GPT = LlamaGenConfig(dim=256, n_layer=2, n_head=4, vocab_size=512, cls_token_num=8, caption_dim=64, block_size=64,
                     multiple_of=64)


def test_linear_rows_alone_and_the_context_restores_everything():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(7, 5, 300, generator=g), torch.randn(257, 300, generator=g), torch.randn(257, generator=g)
    original = F.linear
    with batch_invariant():
        assert active() and F.linear is not original
        both = F.linear(x, w, b)
        assert all(torch.equal(both[i, j], F.linear(x[i, j][None], w, b)[0]) for i in range(7) for j in range(5))
        with batch_invariant():  # nested: still active inside, still restored once outside
            assert active()
        assert active()
    assert not active() and F.linear is original
    with batch_invariant(False):
        assert not active()
    torch.testing.assert_close(both, F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def _llamagen_rounds(target, cond, rows, keep_lengths):
    """Prefill, a 5-token chain forward, per-sample commits of ``keep_lengths`` (different
    committed lengths), then a 3-token forward: its logits (len(rows), 3, V)."""
    cond = {k: v[rows] for k, v in cond.items()}
    B = len(rows)
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(0, GPT.vocab_size, (4, 8), generator=g)[rows]
    target.begin(cond, B)
    target.forward(toks[:, :5], torch.arange(5).expand(B, 5), torch.ones(5, 5, dtype=torch.bool).tril())
    n_keep = torch.tensor([keep_lengths[r] for r in rows])
    target.commit(torch.arange(5).expand(B, 5), n_keep)
    pos = n_keep.unsqueeze(1) + torch.arange(3)
    return target.forward(toks[:, 5:], pos, torch.ones(3, 3, dtype=torch.bool).tril()).logits


def test_cached_attention_of_samples_with_different_lengths_equals_each_alone():
    torch.manual_seed(0)
    gpt = LlamaGenGPT(GPT, init_std=0.05).eval()
    g = torch.Generator().manual_seed(2)
    mask = torch.zeros(4, 8, dtype=torch.bool)
    for b, n in enumerate((8, 3, 5, 1)):
        mask[b, 8 - n:] = True
    cond = {"caption_embs": torch.randn(4, 8, 64, generator=g), "emb_mask": mask}
    keep = [5, 1, 3, 2]
    with torch.no_grad(), batch_invariant():
        batch = _llamagen_rounds(LlamaGenTarget(gpt, cfg_scale=3.0), cond, [0, 1, 2, 3], keep)
        for b in range(4):
            assert torch.equal(batch[b], _llamagen_rounds(LlamaGenTarget(gpt, cfg_scale=3.0), cond, [b], keep)[0]), b


def test_prefill_of_prompts_of_different_lengths_equals_each_alone():
    from coolsd.models.lumina import ImageVocab, LuminaTarget, LuminaTokens

    model = make_lm().float()
    tokens = LuminaTokens(image_start=21, image_end=20, newline=22, grid_base=23, sep=26)
    prompts = [[0, 30, 31, 32, 26], [0, *range(40, 52), 26], [0, 33, 26], [0, *range(28, 36), 26]]

    def run(rows):
        t = LuminaTarget(model, ImageVocab(VMAP), h_latent=4, w_latent=4, cfg_scale=3.0, tokens=tokens)
        first = t.begin([prompts[r] for r in rows], len(rows)).logits
        codes = torch.arange(3).expand(len(rows), 3)
        second = t.forward(codes, torch.arange(3).expand(len(rows), 3), torch.ones(3, 3, dtype=torch.bool).tril()).logits
        return first, second

    with torch.no_grad(), batch_invariant():
        first, second = run([0, 1, 2, 3])
        for b in range(4):
            f1, s1 = run([b])
            assert torch.equal(first[b], f1[0]) and torch.equal(second[b], s1[0]), b


def test_mar_conditions_of_ragged_batches_equal_each_alone():
    from coolsd.models.mar import MAR, MARConfig

    torch.manual_seed(0)
    mar = MAR(MARConfig(seq_len=16, token_dim=16, encoder_dim=128, encoder_depth=1, encoder_heads=4, decoder_dim=128,
                        decoder_depth=1, decoder_heads=4, buffer_size=2, n_classes=10, head_width=64, head_depth=1)).eval()
    g = torch.Generator().manual_seed(3)
    tokens = torch.randn(4, 16, 16, generator=g)
    known = torch.rand(4, 16, generator=g) < torch.tensor([[0.0], [0.3], [0.6], [1.0]])
    labels = torch.tensor([0, NULL_LABEL, 5, 7])
    with torch.no_grad(), batch_invariant():
        z = mar.conditions(tokens, known, labels)
        for b in range(4):
            assert torch.equal(z[b], mar.conditions(tokens[b:b + 1], known[b:b + 1], labels[b:b + 1])[0]), b


def test_per_sample_runs_one_sample_at_a_time_only_inside_the_context():
    calls = []

    def decode(x):
        calls.append(len(x))
        return x.numpy() * 2

    x = torch.arange(6.0).reshape(3, 2)
    assert np.array_equal(per_sample(decode, x), x.numpy() * 2) and calls == [3]
    with batch_invariant():
        assert np.array_equal(per_sample(decode, x), x.numpy() * 2) and calls == [3, 1, 1, 1]
        assert torch.equal(per_sample(lambda t: t + 1, x), x + 1)
