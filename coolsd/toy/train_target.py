"""Train the toy target (LlamaGen GPT + caption encoder) on VQ tokens of rendered scenes.

Teacher-forced next-token cross-entropy over the 64 image tokens; the caption is replaced by
the GPT's null caption with probability ``cfg_dropout`` (LlamaGen's CFG training). AdamW with
linear warm-up and cosine decay; deterministic given the seed (single-process CPU).
"""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from coolsd.models.llamagen import LlamaGenConfig, LlamaGenGPT
from coolsd.toy.target import CaptionEncoder


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def sequence_loss(gpt: LlamaGenGPT, enc: CaptionEncoder, ids, tokens, drop=None) -> torch.Tensor:
    c = enc(ids)
    caption = c["caption_embs"]
    if drop is not None:
        null = gpt.cls_embedding.uncond_embedding.to(caption.dtype).expand_as(caption)
        caption = torch.where(drop[:, None, None], null, caption)
    T = c["emb_mask"].shape[1]
    hidden = gpt(caption, c["emb_mask"], tokens)
    logits = gpt.logits(hidden[:, T - 1 :])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1))


def train_target(
    cfg: LlamaGenConfig,
    caption_ids: torch.Tensor,
    tokens: torch.Tensor,
    *,
    steps: int,
    batch_size: int = 32,
    lr: float = 2e-3,
    cfg_dropout: float = 0.1,
    seed: int = 0,
    val: tuple[torch.Tensor, torch.Tensor] | None = None,
    log=print,
):
    """caption_ids (n, T) left-padded word ids; tokens (n, N) VQ tokens. Returns
    (gpt, caption_encoder, metrics)."""
    torch.manual_seed(seed)
    gpt, enc = LlamaGenGPT(cfg), CaptionEncoder(cfg.caption_dim, cfg.cls_token_num)
    params = list(gpt.parameters()) + list(enc.parameters())
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.05)
    g = torch.Generator().manual_seed(seed)
    n = tokens.shape[0]
    t0 = time.perf_counter()
    warmup = max(1, steps // 30)
    ema = None
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        idx = torch.randint(0, n, (batch_size,), generator=g)
        drop = torch.rand(batch_size, generator=g) < cfg_dropout
        loss = sequence_loss(gpt, enc, caption_ids[idx], tokens[idx], drop)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 100 == 0 or step == steps - 1:
            log(f"target step {step:5d}/{steps}  loss {ema:.4f}  {time.perf_counter() - t0:6.0f}s")
    gpt.eval(), enc.eval()
    metrics = {"target_train_loss": ema, "target_train_seconds": time.perf_counter() - t0}
    if val is not None:
        with torch.no_grad():
            vids, vtok = val
            losses = [sequence_loss(gpt, enc, vids[i : i + 256], vtok[i : i + 256]).item() for i in range(0, len(vtok), 256)]
        metrics["target_val_loss"] = sum(losses) / len(losses)
        log(f"target held-out loss {metrics['target_val_loss']:.4f} nats/token")
    return gpt, enc, metrics
