"""Training pieces of the toy continuous world: patch tokens round-trip exactly, and the
MAR-style loss (epsilon MSE + the variance's variational bound) trains a ContinuousAR: the loss
falls on a small set of toy scenes and the variance output receives gradient."""
import numpy as np
import torch

from coolsd.continuous.model import ContinuousAR, ContinuousConfig
from coolsd.continuous.train import ar_loss, patchify, unpatchify
from coolsd.toy.job import toy_prompts
from coolsd.toy.world import render_batch


def test_patch_tokens_round_trip():
    imgs = render_batch(toy_prompts(6))
    tok = patchify(imgs, p=8)
    assert tok.shape == (6, 16, 192) and abs(float(tok.std()) - 1.0) < 0.5
    assert np.array_equal(unpatchify(tok, 32, 32, p=8), imgs)


def test_loss_falls_and_the_variance_learns():
    torch.manual_seed(0)
    imgs = render_batch(toy_prompts(8))
    tokens = patchify(imgs, p=8).double()
    labels = torch.arange(8) % 3
    m = ContinuousAR(ContinuousConfig(token_dim=192, seq_len=16, dim=32, n_layer=1, n_head=2, n_classes=3,
                                      head_width=64, head_blocks=2)).double()
    opt = torch.optim.Adam(m.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(0)
    first, last = [], []
    for step in range(60):
        loss, parts = ar_loss(m, tokens, labels, g)
        opt.zero_grad()
        loss.backward()
        if step == 0:
            v_rows = m.head.out.weight.grad[192:]  # the v half of the output layer
            assert float(v_rows.abs().sum()) > 0
        opt.step()
        (first if step < 10 else last if step >= 50 else []).append(float(loss))
    assert np.median(last) < 0.85 * np.median(first), (np.median(first), np.median(last))  # t is random: medians
