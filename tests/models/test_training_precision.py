"""Mixed precision of drafter training (coolsd.models.eagle.precision): with a bf16 target the head
keeps fp32 master weights and AdamW state and runs its forwards under bf16 autocast; a bf16 run's
loss tracks the fp32 run's; AdamW updates below bf16's resolution are kept; the saved fp32
weights load into a bf16 target (tiny random LlamaGen / Chameleon models, CPU)."""
from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from coolsd.models.eagle import EagleBatch, EagleHead, llamagen_batch, train_eagle
from coolsd.models.eagle.model import load_eagle_head
from coolsd.models.eagle.lumina import LuminaEagleHead
from coolsd.models.eagle.precision import TrainPrecision
from coolsd.models.eagle.training import eagle_loss, save_drafter
from coolsd.models.eagle.training_lumina import SeqBatch, lumina_loss
from coolsd.models.llamagen import LlamaGenGPT, tiny
from factories import make_lm

CFG = tiny()  # dim 64, 4 heads, vocab 64, 8 text slots, 4x4 grid
T, N, V = CFG.cls_token_num, CFG.block_size, CFG.vocab_size


def make_target() -> LlamaGenGPT:
    torch.manual_seed(0)
    return LlamaGenGPT(CFG, init_std=0.15).eval()


def make_batches(model, n: int = 2, B: int = 4) -> list[EagleBatch]:
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(n):
        gc = torch.Generator().manual_seed(100 + i)
        cond = {"caption_embs": torch.randn(B, T, CFG.caption_dim, generator=gc),
                "emb_mask": torch.ones(B, T, dtype=torch.bool)}
        out.append(llamagen_batch(model, cond, torch.randint(0, V, (B, N), generator=g), generator=g))
    return out


def as_bf16(batches):
    """The batches as a bf16 target hands them over: features rounded to bf16."""
    return [EagleBatch(b.tokens, b.features.bfloat16()) for b in batches]


class RecordingAdamW(torch.optim.AdamW):
    made: list = []

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        RecordingAdamW.made.append(self)


def autocast_probe(module: torch.nn.Module) -> list:
    """Forward hook recording (autocast on, autocast dtype, output dtype) per call."""
    seen = []

    def hook(mod, args, out):
        dev = mod.weight.device.type
        seen.append((torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev), out.dtype))

    module.register_forward_hook(hook)
    return seen


def test_bf16_target_trains_fp32_master_weights_and_optimiser_state_under_bf16_autocast(monkeypatch):
    """LlamaGen and Lumina heads of a bf16 target: parameters and AdamW state fp32 after training,
    every training forward under bf16 autocast (the projection's output bf16), the loss fp32."""
    monkeypatch.setattr(torch.optim, "AdamW", RecordingAdamW)
    model = make_target()
    W16 = model.output.weight.detach().bfloat16()
    head = EagleHead.from_target(copy.deepcopy(model).bfloat16(), seed=3)
    assert head.dtype == torch.bfloat16  # as the target: the trainer owns the master copy
    seen = autocast_probe(head.fc)
    RecordingAdamW.made.clear()
    train_eagle(head, W16, as_bf16(make_batches(model, n=1)), steps=2, lr=1e-3, seed=0)
    assert {p.dtype for p in head.parameters()} == {torch.float32}
    (opt,) = RecordingAdamW.made
    state = [t for s in opt.state.values() for t in s.values() if t.is_floating_point() and t.dim() > 0]
    assert state and {t.dtype for t in state} == {torch.float32}  # exp_avg, exp_avg_sq
    assert all(p.dtype == torch.float32 for grp in opt.param_groups for p in grp["params"])
    assert len(seen) == 2 and set(seen) == {(True, torch.bfloat16, torch.bfloat16)}
    loss, _ = eagle_loss(head, W16, as_bf16(make_batches(model, n=1))[0])
    assert loss.dtype == torch.float32
    assert TrainPrecision.for_head(head, W16).describe() == {"master_dtype": "float32", "autocast_dtype": "bfloat16"}

    # Lumina-mGPT's head through the same policy (lumina_loss)
    lm = make_lm().bfloat16()
    lhead = LuminaEagleHead.from_target(lm, seed=3)
    lseen = autocast_probe(lhead.fc)
    H, B, L = lm.config.hidden_size, 2, 6
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(B, L + 1, H, generator=g).bfloat16()
    batch = SeqBatch(torch.randint(0, lm.config.vocab_size, (B, L), generator=g), feats[:, :-1],
                     torch.arange(L).expand(B, L), feats[:, 1:], torch.ones(B, L, dtype=torch.bool),
                     torch.ones(B, L, dtype=torch.bool))
    RecordingAdamW.made.clear()
    train_eagle(lhead, lm.lm_head.weight, [batch], steps=2, lr=1e-3, noise_std=0.0, loss_fn=lumina_loss)
    assert {p.dtype for p in lhead.parameters()} == {torch.float32}
    (lopt,) = RecordingAdamW.made
    assert {t.dtype for s in lopt.state.values() for t in s.values() if t.dim() > 0} == {torch.float32}
    assert len(lseen) == 2 and set(lseen) == {(True, torch.bfloat16, torch.bfloat16)}
    assert lumina_loss(lhead, lm.lm_head.weight, batch)[0].dtype == torch.float32


def test_fp32_and_fp64_targets_train_without_autocast():
    """The policy leaves full-precision training as it was: no autocast, the head's own dtype."""
    model = make_target()
    head = EagleHead.from_target(model, seed=3)
    seen = autocast_probe(head.fc)
    train_eagle(head, model.output.weight, make_batches(model, n=1), steps=1, lr=1e-3, seed=0)
    assert head.dtype == torch.float32 and seen[0][0] is False and seen[0][2] == torch.float32
    assert TrainPrecision.of(torch.float64, torch.float64, "cpu") == TrainPrecision(torch.float64, None, "cpu")
    assert TrainPrecision.of(torch.float16, torch.float16, "cpu").compute is None  # fp16: fp32 compute


def test_bf16_run_loss_tracks_the_fp32_run():
    """The same head (bf16-rounded init), data and noise stream, trained 30 steps at lr 3e-4 with
    the target in fp32 and in bf16. lr 3e-4 on this head's fan-in-64..128 init (|w| ~ 0.1) is the
    lr / |w| of LANTERN's lr 1e-4 on a 1280-wide head (|w| ~ 0.03), the regime where pure-bf16
    AdamW updates round away (measured before mixed precision: the bf16 run's loss did not fall,
    drop ratio -0.02, and strayed 0.019 from the fp32 curve).

    Tolerance: bf16 autocast rounds activations to 8 significand bits (relative 2^-9 per op), which
    moved the curve by <= 6e-4 (abs) here against an fp32 loss drop of 0.020; the bounds (drop ratio
    within [0.8, 1.25], every step within 25% of the fp32 drop) leave > 8x room for other CPUs' bf16
    kernels (accumulation order, native or emulated bf16) while failing the pure-bf16 trainer."""
    model = make_target()
    batches = make_batches(model)
    head16 = EagleHead.from_target(copy.deepcopy(model).bfloat16(), seed=3)
    head32 = copy.deepcopy(head16).float()
    l32 = train_eagle(head32, model.output.weight.detach(), batches, 30, lr=3e-4, seed=0).loss
    l16 = train_eagle(head16, model.output.weight.detach().bfloat16(), as_bf16(batches), 30, lr=3e-4, seed=0).loss
    k = 6  # final loss: the mean of the last 6 steps (both batches, 3 times)
    drop32 = l32[0] - sum(l32[-k:]) / k
    drop16 = l16[0] - sum(l16[-k:]) / k
    assert drop32 > 0.01, l32  # the fp32 run learns: the yardstick is not noise
    assert 0.8 < drop16 / drop32 < 1.25, (drop16, drop32)
    dev = max(abs(a - b) for a, b in zip(l16, l32))
    assert dev < 0.25 * drop32, (dev, drop32)


def test_adamw_updates_below_bf16_resolution_are_kept():
    """One AdamW step at lr 3e-5 with a bf16 target: the first step moves every weight by
    lr * sign(grad) (bias-corrected m / sqrt(v) = +-1), far below the bf16 half-spacing of most
    weights (|w| 2^-9 .. |w| 2^-8, at least 2^-15 = 3.05e-5 > lr for |w| >= 2^-7). fp32 master
    weights keep every one of them; bf16 weights kept only those with |w| < 2^-7 (measured: 8.8% of
    fc, whose init is U(+-1/sqrt(128)))."""
    model = make_target()
    head = EagleHead.from_target(copy.deepcopy(model).bfloat16(), seed=3)
    before = head.fc.weight.detach().float().clone()
    lr = 3e-5
    train_eagle(head, model.output.weight.detach().bfloat16(), as_bf16(make_batches(model, n=1)), 1, lr=lr, seed=0)
    delta = head.fc.weight.detach().float() - before
    changed = (delta != 0).double().mean().item()
    assert changed > 0.99, changed
    # |delta| = lr (1 + weight decay 0.01 * lr * |w| / lr, negligible) up to fp32 rounding of w + delta
    ratio = (delta.abs() / lr)[delta != 0]
    assert ratio.median().item() == pytest.approx(1.0, abs=0.02)


def test_saved_drafter_holds_fp32_master_weights_and_loads_into_a_bf16_target(tmp_path):
    """``save_drafter`` writes the fp32 master weights; ``load_eagle_head`` casts them to the bf16
    target's dtype (one round-to-nearest per weight)."""
    model = make_target()
    target16 = copy.deepcopy(model).bfloat16()
    head = EagleHead.from_target(target16, seed=3)
    train_eagle(head, target16.output.weight, as_bf16(make_batches(model, n=1)), 2, lr=1e-3, seed=0)
    out = save_drafter(head, tmp_path / "d", {})
    saved = load_file(str(out / "model.safetensors"))
    assert {v.dtype for v in saved.values()} == {torch.float32}
    loaded = load_eagle_head(out, target16)
    assert loaded.dtype == torch.bfloat16
    assert all(torch.equal(saved[k].bfloat16(), v) for k, v in loaded.state_dict().items())
    assert torch.equal(loaded.embed_tokens.weight, target16.tok_embeddings.weight)  # frozen, exact
