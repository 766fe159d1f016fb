"""Training pieces of the toy continuous world: the PCA patch codec reconstructs toy scenes
closely and gives unit-variance tokens in raster order, and MAR's masked-token loss (epsilon
MSE + the variance's variational bound) trains a tiny ToyMAR: the loss falls on a small set of
toy scenes and the variance output receives gradient."""
import numpy as np
import torch

from coolsd.toy.continuous import PATCH, SIDE, PatchPCA, ToyMAR, scene_labels
from coolsd.models.mar_loss import mar_loss
from coolsd.models.mar import MARConfig
from coolsd.toy.scenes import render_batch, toy_prompts


def test_patch_codec_round_trip_and_token_layout():
    imgs = render_batch(toy_prompts(200))
    codec = PatchPCA.fit(imgs[:150])
    tok = codec.encode(imgs[150:])
    assert tok.shape == (50, SIDE * SIDE, 16) and abs(float(tok.std()) - 1.0) < 0.2
    err = np.abs(codec.decode(tok).astype(float) - imgs[150:]) / 255
    assert err.mean() < 0.02, err.mean()  # held-out scenes
    # token i * SIDE + j is the patch at row i, column j: changing that patch changes that token only
    changed = imgs[150:151].copy()
    changed[0, 2 * PATCH:3 * PATCH, 5 * PATCH:6 * PATCH] = 255 - changed[0, 2 * PATCH:3 * PATCH, 5 * PATCH:6 * PATCH]
    diff = (codec.encode(changed) - codec.encode(imgs[150:151])).abs().sum(-1)[0]
    assert diff.nonzero().flatten().tolist() == [2 * SIDE + 5]


def test_mar_loss_falls_and_the_variance_learns():
    torch.manual_seed(0)
    scenes = toy_prompts(8)
    codec = PatchPCA.fit(render_batch(toy_prompts(64)))
    tokens, labels = codec.encode(render_batch(scenes)).double(), scene_labels(scenes)
    m = ToyMAR(MARConfig(seq_len=SIDE * SIDE, token_dim=16, encoder_dim=32, encoder_depth=1, encoder_heads=2,
                         decoder_dim=32, decoder_depth=1, decoder_heads=2, buffer_size=2, n_classes=1,
                         head_width=64, head_depth=2)).double()
    opt = torch.optim.Adam(m.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(0)
    first, last = [], []
    for step in range(60):
        loss, parts = mar_loss(m, tokens, labels, g)
        opt.zero_grad()
        loss.backward()
        if step == 1:  # the output layer is zero-initialised (upstream): v gets gradient once it moves
            v_rows = m.head.final_layer.linear.weight.grad[16:]  # the v half of the output layer
            assert float(v_rows.abs().sum()) > 0
        opt.step()
        (first if step < 10 else last if step >= 50 else []).append(float(loss.detach()))
    assert np.median(last) < 0.85 * np.median(first), (np.median(first), np.median(last))  # t is random: medians
