"""EAGLE-1 drafter training for Lumina-mGPT (LANTERN ``entrypoints/generate_train_data.py`` and
``entrypoints/train_drafter`` for ``lumina_mgpt``), on ``coolsd.models.eagle.training.train_eagle``.

Data: the target's own samples (``target_samples``: CFG and top-k of the protocol), then a
teacher-forced full forward of the Chameleon LM over each half's token sequence
(``lumina_sequences``): conditional = [prompt ids, <racm3:break>, h-grid, w-grid, image BPE ids
with a newline after every row but the last], unconditional = the same from <racm3:break> on
(upstream's ``uncond_input_ids = out_token_ids``). Both halves train (LANTERN draws the uncond
one with probability 0.1 per sample; here both are in every batch, as ``llamagen_batch(both_halves=True)``).

Sequence (``SeqBatch``), EAGLE-1 / ``cnets_lumina_mgpt.Model.topK_generate``'s layout: entry i
= (id s_{i+1}, feature f_i) at position i, regression target f_{i+1}. Loss entries: every entry
from the one whose input id is <racm3:break> on (LANTERN's mask keeps the last 2357 entries of a
conditional sequence: the structural tokens, the image and its newlines; all of an
unconditional one). Loss: ``eagle_loss``'s (SmoothL1 + p_w * CE through the frozen full-vocabulary
``lm_head``, as upstream's ``head(predict)``), input-feature noise (rand - 0.5) * std * 512 / L.

Note: upstream's Lumina data loader builds ``input_ids[:, :-1]`` + a zero (no one-token shift,
``data_utils.py``) while its inference pairs ``input_ids[:, 1:]`` with the features; the
inference layout is used here for both (a drafter trained here drafts as it was trained).

Precision: ``coolsd.models.eagle.precision`` through ``train_eagle`` (fp32 master weights and AdamW
state, the forward under bf16 autocast for the bf16 target, the loss in fp32), as LlamaGen's.

Features are computed per batch (a 7B forward per step) instead of stored: one Lumina sample's
features are ~2400 x 2 x 4096 floats.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from coolsd.engine.decoding.sampling import cfg_combine
from coolsd.models.eagle.lumina import LuminaEagleHead
from coolsd.models.eagle.model import head_logits
from coolsd.models.eagle.precision import TrainPrecision
from coolsd.models.eagle.training import evaluate_eagle, target_samples, train_eagle


@dataclass
class SeqBatch:
    ids: torch.Tensor  # (B, L) drafter input ids s_{i+1}
    features: torch.Tensor  # (B, L, H) f_i
    positions: torch.Tensor  # (B, L)
    targets: torch.Tensor  # (B, L, H) f_{i+1}
    loss_mask: torch.Tensor  # (B, L) bool
    valid: torch.Tensor  # (B, L) bool: real entries (right padding after)
    halves: int = 1  # 2: rows [cond (B/2); uncond (B/2)] of the same samples

    @property
    def guided(self) -> bool:
        return self.halves == 2

    def to(self, device=None, dtype=None) -> "SeqBatch":
        return SeqBatch(self.ids.to(device), self.features.to(device, dtype), self.positions.to(device),
                        self.targets.to(device, dtype), self.loss_mask.to(device), self.valid.to(device), self.halves)


def image_sequence(target, codes: torch.Tensor) -> list[int]:
    """Image BPE ids of one sample's codes with a newline after every row but the last."""
    bpe = target.vocab.to_bpe(codes.cpu()).tolist()
    w, n = target.w_latent, target.n_image_tokens
    out = []
    for j, t in enumerate(bpe):
        out.append(int(t))
        if (j + 1) % w == 0 and j + 1 < n:
            out.append(target.tokens.newline)
    return out


@torch.no_grad()
def lumina_sequences(target, prompts: Sequence, codes: torch.Tensor, both_halves: bool = True) -> SeqBatch:
    """Teacher-forced features of a ``LuminaTarget``'s LM for (prompt ids, image codes) pairs, in
    the drafter's training layout (module docstring). Rows: [cond; uncond] when ``both_halves``."""
    model = target.model
    dev = model.device
    struct = target.structural_prefix
    seqs = [[int(t) for t in torch.as_tensor(p).flatten().tolist()] + struct + image_sequence(target, c)
            for p, c in zip(prompts, codes)]
    starts = [len(s) - len(struct) - (target.n_image_tokens + target.h_latent - 1) for s in seqs]  # index of break
    if both_halves:
        seqs = seqs + [s[st:] for s, st in zip(seqs, starts)]
        starts = starts + [0] * len(starts)
    n, L = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros(n, L, dtype=torch.long, device=dev)
    valid = torch.zeros(n, L, dtype=torch.bool, device=dev)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s, device=dev)
        valid[b, : len(s)] = True
    mask = torch.ones(L, L, dtype=torch.bool, device=dev).tril() & valid.unsqueeze(1)  # right padding never seen
    mask |= torch.eye(L, dtype=torch.bool, device=dev)
    hidden = model(ids, torch.arange(L, device=dev).expand(n, L), mask)  # (n, L, H) after the final norm
    ar = torch.arange(L - 1, device=dev)
    loss = (ar.unsqueeze(0) + 1 >= torch.tensor(starts, device=dev).unsqueeze(1)) & valid[:, 1:]
    return SeqBatch(ids[:, 1:], hidden[:, :-1], ar.expand(n, L - 1), hidden[:, 1:], loss, valid[:, 1:],
                    2 if both_halves else 1)


def lumina_loss(head, lm_head_weight: torch.Tensor, batch: SeqBatch, *, p_w: float = 0.1, noise_std: float = 0.0,
                noise_len: Optional[int] = None, generator: Optional[torch.Generator] = None,
                cfg_scale: Optional[float] = None) -> tuple[torch.Tensor, dict]:
    """``eagle_loss`` for a ``SeqBatch`` (LANTERN ``train_drafter/main.py``: vloss and ploss
    averaged over the loss entries); stats as there (top1_cfg / accept_cfg for guided batches
    with ``cfg_scale``: over the full vocabulary's CFG-combined logits). Precision as ``eagle_loss``'s
    (``TrainPrecision.for_head``)."""
    prec = TrainPrecision.for_head(head, lm_head_weight)
    batch = batch.to(head.device, prec.master)  # bf16 features are exact in fp32
    x = batch.features
    if noise_std:
        L = noise_len or x.shape[1]
        u = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype)
        x = x + (u - 0.5) * noise_std * 512 / L
    L = x.shape[1]
    attend = torch.ones(L, L, dtype=torch.bool, device=x.device).tril() & batch.valid.unsqueeze(1)
    attend |= torch.eye(L, dtype=torch.bool, device=x.device)
    W = lm_head_weight.detach()
    with prec.autocast():
        pred = head(batch.ids, x, batch.positions, attend)
        out_logits = head_logits(pred, W)  # head_logits: at least fp32
        with torch.no_grad():
            tgt_logits = head_logits(batch.targets, W)
    pred = pred.to(prec.master)
    m = batch.loss_mask
    k = m.sum().clamp(min=1)
    vloss = (F.smooth_l1_loss(pred, batch.targets, reduction="none").mean(-1) * m).sum() / k
    with torch.no_grad():
        tgt_p = tgt_logits.softmax(-1)
    ploss = (-(tgt_p * out_logits.log_softmax(-1)).sum(-1) * m).sum() / k
    loss = vloss + p_w * ploss
    with torch.no_grad():
        tgt = tgt_logits.argmax(-1)
        top3 = out_logits.topk(min(3, out_logits.shape[-1]), -1).indices
        mf = m.double()
        stats = {"loss": loss.item(), "vloss": vloss.item(), "ploss": ploss.item(),
                 "top1": ((top3[..., 0] == tgt).double() * mf).sum().item() / k.item(),
                 "top3": ((top3 == tgt.unsqueeze(-1)).any(-1).double() * mf).sum().item() / k.item(),
                 "n": int(m.sum().item())}
        if batch.guided and cfg_scale is not None:
            B = batch.ids.shape[0] // 2
            Lc = min(int(batch.valid[B:].sum(1).min()), L)  # aligned: compare the image region from the end
            def tail(z, rows):  # noqa: E306 -- each row's last Lc valid entries
                ends = batch.valid[rows].sum(1)
                idx = ends.unsqueeze(1) - Lc + torch.arange(Lc, device=z.device)
                return z[rows].gather(1, idx.unsqueeze(-1).expand(-1, -1, z.shape[-1]))
            c, u = slice(0, B), slice(B, 2 * B)
            d = cfg_combine(tail(out_logits, c), tail(out_logits, u), cfg_scale)
            t = cfg_combine(tail(tgt_logits, c), tail(tgt_logits, u), cfg_scale)
            stats["top1_cfg"] = (d.argmax(-1) == t.argmax(-1)).double().mean().item()
            stats["accept_cfg"] = torch.minimum(d.softmax(-1), t.softmax(-1)).sum(-1).double().mean().item()
    return loss, stats


def train_lumina_on_target(target, encode: Callable, train_items, heldout_items, steps: int, log=print, *,
                           batch_size: int = 4, lr: float = 1e-4, seed: int = 0, chunk: int = 16,
                           tag: str = "lumina drafter", dropout: Optional[float] = None):
    """A fresh ``LuminaEagleHead`` (the target's embedding, seeded init) trained on the target's
    samples of ``train_items`` (captions, or whatever ``encode`` turns into prompt ids), features
    computed per batch; held-out metrics on ``heldout_items``. Returns (head in the master dtype:
    fp32 for the bf16 target, metrics incl. the precision used)."""

    t0 = time.perf_counter()

    def samples(items, s):
        prompts, codes = [], []
        for i in range(0, len(items), chunk):
            p = encode(items[i : i + chunk])
            codes.append(target_samples(target, p, target.n_image_tokens,
                                        [s * 1_000_003 + i + j for j in range(len(p))]))
            prompts += list(p)
            log(f"[{tag}] target samples {len(prompts)}/{len(items)} ({time.perf_counter() - t0:.0f}s)")
        return prompts, torch.cat(codes)

    with torch.no_grad():
        prompts, codes = samples(train_items, 1)
        vp, vc = samples(heldout_items, 2)
    data_s = time.perf_counter() - t0
    over = {} if dropout is None else {"dropout": dropout}
    head = LuminaEagleHead.from_target(target.model, seed=seed, **over)
    g = torch.Generator().manual_seed(1)

    def batch_at(step):
        idx = torch.randint(0, len(codes), (batch_size,), generator=g).tolist()
        return lumina_sequences(target, [prompts[i] for i in idx], codes[idx])

    evals = [lumina_sequences(target, vp[i : i + batch_size], vc[i : i + batch_size])
             for i in range(0, len(vc), batch_size)]

    def progress(step, stats):
        if (step + 1) % max(1, steps // 10) == 0:
            log(f"[{tag}] step {step + 1}/{steps} loss {stats['loss']:.4f} top1 {stats['top1']:.3f} "
                f"({time.perf_counter() - t0:.0f}s)")

    t1 = time.perf_counter()
    W = target.model.lm_head.weight.detach()
    train_eagle(head, W, batch_at, steps, lr=lr, seed=seed, on_step=progress, loss_fn=lumina_loss)
    ev = evaluate_eagle(head, W, evals, cfg_scale=target.cfg_scale if target.guided else None, loss_fn=lumina_loss)
    log(f"[{tag}] held-out (target samples): " + ", ".join(f"{k} {float(v):.4f}" for k, v in ev.items()))
    return head.eval(), {**{k: float(v) for k, v in ev.items()}, "n_target_samples": len(codes),
                         "batch_size": batch_size, "data_seconds": data_s, "train_seconds": time.perf_counter() - t1,
                         **TrainPrecision.for_head(head, W).describe()}
