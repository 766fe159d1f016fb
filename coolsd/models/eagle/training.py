"""EAGLE-1 / LANTERN drafter training (LANTERN ``entrypoints/train_drafter``), as functions.

Data (``EagleBatch``): image tokens x_0..x_{N-1} and the target's post-final-norm features
``features[:, 0]`` = at the last condition slot, ``features[:, j]`` = at image token x_{j-1}.
Entry t (t = 0..n-1, n = min(N, N0-1)) is (token x_t, feature ``features[:, t]``) at logical
position t, exactly what ``coolsd.engine.drafting.ModelDrafter`` feeds an ``EagleDrafter`` at
inference; its regression target is ``features[:, t+1]`` (whose logits predict x_{t+1}).
An optional ``prefix`` holds features at condition slots 0..T-2: entries (token 0, feature,
zero rotation) before the image entries, LANTERN's layout; no loss on them.

Loss (per entry, averaged): SmoothL1(f_hat, f_next) (mean over H) + p_w * CE(softmax(lm_head(
f_next)), log_softmax(lm_head(f_hat))), p_w = 0.1. Input features get uniform noise
(rand - 0.5) * std * 512 / L with std 0.2, L the feature sequence length (prefix + N0; LANTERN's
LlamaGen-256 data has L = 119 + 257 = 376); targets stay clean. AdamW (betas 0.9, 0.95, default
weight decay 0.01), gradient clipping by value 0.5, linear warm-up over 3% of the steps then linear
decay to 0 (``transformers.get_linear_schedule_with_warmup``).

Precision (``coolsd.models.eagle.precision``): master weights, gradients and AdamW state in fp32 (or
the head's own fp64), forwards under bf16 autocast when the target is bf16, loss reductions in the
master dtype; the trained head is left in the master dtype and saved so.

Features with CFG halves, (B, N0, 2, H) = [cond, uncond], train on both halves (2B sequences);
LANTERN's LlamaGen data instead stores one half per sample, the null condition with probability
0.1 (``llamagen_batch``'s default).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from coolsd.engine.decoding.rng import PerSampleRNG
from coolsd.engine.decoding.sampling import cfg_combine
from coolsd.engine.drafting import SamplingConfig
from coolsd.engine.loop import speculative_generate
from coolsd.models.eagle.model import EagleHead, head_logits
from coolsd.models.eagle.precision import TrainPrecision
from coolsd.models.kv_cache import KVCache
from coolsd.models.llamagen import rope_2d, text_slot_mask
from coolsd.prompts.coco import coco_longest_captions


# ---------------------------------------------------------------------------------------- data
@dataclass
class EagleBatch:
    tokens: torch.Tensor  # (B, N) image tokens
    features: torch.Tensor  # (B, N0, H) or (B, N0, 2, H); [:, 0] last condition slot, [:, j] token j-1
    prefix: Optional[torch.Tensor] = None  # (B, P, H) or (B, P, 2, H): condition slots 0..T-2

    @property
    def guided(self) -> bool:
        return self.features.dim() == 4

    @property
    def n_entries(self) -> int:
        return min(self.tokens.shape[1], self.features.shape[1] - 1)

    def to(self, device=None, dtype=None) -> "EagleBatch":
        pre = None if self.prefix is None else self.prefix.to(device, dtype)
        return EagleBatch(self.tokens.to(device), self.features.to(device, dtype), pre)


def _flat_halves(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """(B, L, 2, H) -> (2B, L, H) = [cond; uncond]; (B, L, H) unchanged."""
    if x is None or x.dim() == 3:
        return x
    return torch.cat([x[:, :, 0], x[:, :, 1]])


def assemble(batch: EagleBatch):
    """The drafter's training sequence. Returns tokens, features, positions (B', P + n), targets
    (B', n, H) and P; B' = 2B for guided batches ([cond; uncond])."""
    n = batch.n_entries
    if n < 1:
        raise ValueError("a batch needs at least one entry with a next feature")
    feats = _flat_halves(batch.features)
    halves = 2 if batch.guided else 1
    toks = torch.cat([batch.tokens] * halves) if halves > 1 else batch.tokens
    Bp = feats.shape[0]
    dev = feats.device
    tokens = toks[:, :n].to(dev)
    inputs = feats[:, :n]
    targets = feats[:, 1 : n + 1]
    positions = torch.arange(n, device=dev).expand(Bp, n)
    pre = _flat_halves(batch.prefix)
    P = 0
    if pre is not None:
        if pre.dim() != inputs.dim() or pre.shape[0] != Bp:
            raise ValueError("prefix must have the layout of features")
        P = pre.shape[1]
        tokens = torch.cat([torch.zeros(Bp, P, dtype=tokens.dtype, device=dev), tokens], 1)
        inputs = torch.cat([pre.to(dev, inputs.dtype), inputs], 1)
        positions = torch.cat([torch.full((Bp, P), -1, dtype=positions.dtype, device=dev), positions], 1)
    return tokens, inputs, positions, targets, P


# ---------------------------------------------------------------------------------------- loss
def eagle_loss(
    head: EagleHead,
    lm_head_weight: torch.Tensor,
    batch: EagleBatch,
    *,
    p_w: float = 0.1,
    noise_std: float = 0.0,
    noise_len: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    cfg_scale: Optional[float] = None,
) -> tuple[torch.Tensor, dict]:
    """The LANTERN loss of one batch and its statistics (vloss, ploss, top1, top3, n; for
    guided batches with ``cfg_scale`` also top1_cfg: CFG-combined drafter vs target argmax, and
    accept_cfg: the expected acceptance rate sum_x min(p, q) of exact verification).
    Precision: ``TrainPrecision.for_head`` (forwards under the target dtype's autocast, the loss in
    the master dtype)."""
    prec = TrainPrecision.for_head(head, lm_head_weight)
    batch = batch.to(head.device, prec.master)  # bf16 features are exact in fp32
    tokens, inputs, positions, targets, P = assemble(batch)
    if noise_std:
        L = noise_len or (P + batch.features.shape[1])
        u = torch.rand(inputs.shape, generator=generator, device=inputs.device, dtype=inputs.dtype)
        inputs = inputs + (u - 0.5) * noise_std * 512 / L
    W = lm_head_weight.detach()
    with prec.autocast():
        pred = head(tokens, inputs, positions)[:, P:]
        out_logits = head_logits(pred, W)  # head_logits: at least fp32
        with torch.no_grad():
            tgt_logits = head_logits(targets, W)
    pred = pred.to(prec.master)
    vloss = F.smooth_l1_loss(pred, targets, reduction="none").mean(-1).mean()
    with torch.no_grad():
        tgt_p = tgt_logits.softmax(-1)
    ploss = -(tgt_p * out_logits.log_softmax(-1)).sum(-1).mean()
    loss = vloss + p_w * ploss
    with torch.no_grad():
        tgt = tgt_logits.argmax(-1)
        top3 = out_logits.topk(min(3, out_logits.shape[-1]), -1).indices
        stats = {
            "loss": loss.item(), "vloss": vloss.item(), "ploss": ploss.item(),
            "top1": (top3[..., 0] == tgt).double().mean().item(),
            "top3": (top3 == tgt.unsqueeze(-1)).any(-1).double().mean().item(),
            "n": tgt.numel(),
        }
        if batch.guided and cfg_scale is not None:
            B = batch.tokens.shape[0]
            d = cfg_combine(out_logits[:B], out_logits[B:], cfg_scale).argmax(-1)
            t = cfg_combine(tgt_logits[:B], tgt_logits[B:], cfg_scale).argmax(-1)
            stats["top1_cfg"] = (d == t).double().mean().item()
            # expected per-token acceptance of exact speculative sampling at temperature 1,
            # sum_x min(p, q) over the CFG-combined distributions (docs/methods.md#13-verification-at-one-tree-depth-d)
            pq = torch.minimum(cfg_combine(out_logits[:B], out_logits[B:], cfg_scale).softmax(-1),
                               cfg_combine(tgt_logits[:B], tgt_logits[B:], cfg_scale).softmax(-1))
            stats["accept_cfg"] = pq.sum(-1).double().mean().item()
    return loss, stats


@torch.no_grad()
def evaluate_eagle(
    head: EagleHead,
    lm_head_weight: torch.Tensor,
    batches: Iterable[EagleBatch],
    *,
    p_w: float = 0.1,
    cfg_scale: Optional[float] = None,
    loss_fn: Optional[Callable] = None,
) -> dict:
    """Held-out metrics, weighted by entries: loss, vloss, ploss, top1 (drafter argmax == target
    argmax at the next position), top3, and top1_cfg where available. No noise. ``loss_fn``:
    ``eagle_loss`` (default) or ``lumina_loss``."""
    loss_fn = loss_fn or eagle_loss
    was_training = head.training
    head.eval()
    totals: dict[str, float] = {}
    n = 0
    for batch in batches:
        _, s = loss_fn(head, lm_head_weight, batch, p_w=p_w, cfg_scale=cfg_scale)
        k = s.pop("n")
        for key, v in s.items():
            totals[key] = totals.get(key, 0.0) + v * k
        n += k
    head.train(was_training)
    return {**{k: v / n for k, v in totals.items()}, "n": n}


# ---------------------------------------------------------------------------------------- training
@dataclass
class TrainLog:
    loss: list[float] = field(default_factory=list)
    vloss: list[float] = field(default_factory=list)
    ploss: list[float] = field(default_factory=list)
    top1: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    evals: list[tuple[int, dict]] = field(default_factory=list)  # (step, evaluate_eagle result)


def linear_warmup_decay(steps: int, warmup_ratio: float) -> Callable[[int], float]:
    """``transformers.get_linear_schedule_with_warmup`` as a LambdaLR factor, with
    int(warmup_ratio * steps) warm-up steps (the first optimizer step of a warm-up runs at lr 0,
    as there)."""
    warm = int(warmup_ratio * steps)

    def factor(s: int) -> float:
        if s < warm:
            return s / max(1.0, warm)
        return max(0.0, (steps - s) / max(1.0, steps - warm))

    return factor


BatchSource = Union[Sequence[EagleBatch], Callable[[int], EagleBatch]]


def train_eagle(
    head: EagleHead,
    lm_head_weight: torch.Tensor,
    batches: BatchSource,
    steps: int,
    lr: float = 1e-4,
    *,
    p_w: float = 0.1,
    noise_std: float = 0.2,
    noise_len: Optional[int] = None,
    betas: tuple[float, float] = (0.9, 0.95),
    weight_decay: float = 0.01,
    grad_clip: float = 0.5,
    warmup_ratio: float = 0.03,
    seed: int = 0,
    eval_batches: Optional[Sequence[EagleBatch]] = None,
    eval_every: int = 0,
    cfg_scale: Optional[float] = None,
    on_step: Optional[Callable[[int, dict], Any]] = None,
    loss_fn: Optional[Callable] = None,
) -> TrainLog:
    """Train ``head`` in place for ``steps`` optimizer steps. ``batches``: a sequence (cycled in
    order) or ``step -> EagleBatch``. Deterministic given ``seed`` (noise generator), the head's
    initial weights and the batches. ``lm_head_weight`` (the target's dtype) stays frozen.
    ``loss_fn``: ``eagle_loss`` (LlamaGen's ``EagleBatch``, default) or ``lumina_loss`` (a
    ``SeqBatch``).

    Mixed precision (``coolsd.models.eagle.precision``): the head's parameters are first cast to the
    master dtype (fp32 for a bf16 head; fp32 / fp64 heads unchanged) and stay there: AdamW and its
    state are fp32, the loss functions run the forward under bf16 autocast when
    ``lm_head_weight`` is bf16."""
    loss_fn = loss_fn or eagle_loss
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    get = batches if callable(batches) else (lambda s: batches[s % len(batches)])
    TrainPrecision.for_head(head, lm_head_weight).master_weights(head)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, linear_warmup_decay(steps, warmup_ratio))
    gen = torch.Generator(device=head.device)
    gen.manual_seed(int(seed))
    W = lm_head_weight.detach().to(head.device)  # the target's dtype: it sets the autocast dtype
    log = TrainLog()
    head.train()
    for step in range(steps):
        batch = get(step)
        opt.zero_grad(set_to_none=True)
        loss, stats = loss_fn(
            head, W, batch, p_w=p_w, noise_std=noise_std, noise_len=noise_len, generator=gen, cfg_scale=cfg_scale
        )
        if not math.isfinite(stats["loss"]):
            raise FloatingPointError(f"non-finite loss at step {step}: {stats}")
        loss.backward()
        if grad_clip:
            torch.nn.utils.clip_grad_value_(params, grad_clip)
        log.lr.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        for k in ("loss", "vloss", "ploss", "top1"):
            getattr(log, k).append(stats[k])
        if eval_batches is not None and eval_every and ((step + 1) % eval_every == 0 or step + 1 == steps):
            log.evals.append((step + 1, evaluate_eagle(head, W, eval_batches, p_w=p_w, cfg_scale=cfg_scale,
                                                       loss_fn=loss_fn)))
            head.train()
        if on_step is not None:
            on_step(step, stats)
    head.eval()
    return log


# ---------------------------------------------------------------------------------------- LlamaGen data
@torch.no_grad()
def target_samples(target, cond: Any, n_tokens: int, seeds: Sequence[int], sampling=None) -> torch.Tensor:
    """(B, n_tokens) image tokens sampled from ``target`` (CFG and warpers as at inference) by
    plain AR through the production loop: LANTERN's drafter data are the target's own samples,
    so the drafter learns the prefixes it will meet when drafting."""

    res = speculative_generate(target, n_tokens, PerSampleRNG(list(seeds)), cond=cond, batch_size=len(seeds),
                               sampling=sampling or SamplingConfig())
    return res.tokens


@torch.no_grad()
def llamagen_features(
    model,
    cond: dict,
    tokens: torch.Tensor,
    *,
    uncond: Optional[torch.Tensor] = None,
    both_halves: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced forward of a ``LlamaGenGPT`` over [condition slots, image tokens].

    ``cond`` as for ``LlamaGenTarget.begin`` (left-padded ``caption_embs``, ``emb_mask``).
    ``uncond`` (B,) bool: samples whose caption is replaced by the null embedding (keeping the
    sample's text mask, as the target's uncond CFG half does at inference). ``both_halves``:
    run cond and uncond and return [cond, uncond] halves on dim 2.

    Returns (features (B, N+1, [2,] H): last condition slot then every image token;
    slot features (B, T, [2,] H): every condition slot), all after the final norm, equal to what
    ``LlamaGenTarget`` hands a drafter during generation of the same tokens.
    """
    cfg = model.config
    dev, dt = model.device, model.dtype
    T = cfg.cls_token_num
    B, N = tokens.shape
    caption = cond["caption_embs"].to(dev, dt)
    mask = cond["emb_mask"].to(dev, torch.bool)
    if caption.shape != (B, T, cfg.caption_dim) or mask.shape != (B, T):
        raise ValueError(f"expected caption_embs {(B, T, cfg.caption_dim)} and emb_mask {(B, T)}")
    x = caption * mask.unsqueeze(-1)
    null = model.cls_embedding.uncond_embedding.to(dev, dt).expand(B, -1, -1)
    toks = tokens.to(dev)
    if both_halves:
        x, mask, toks = torch.cat([x, null]), torch.cat([mask, mask]), torch.cat([toks, toks])
    elif uncond is not None:
        x = torch.where(uncond.to(dev, torch.bool)[:, None, None], null, x)
    n, L = x.shape[0], T + N
    h = torch.cat([model.cls_embedding(x), model.tok_embeddings(toks)], dim=1)
    cd = torch.promote_types(dt, torch.float32)
    cos_i, sin_i = rope_2d(torch.arange(N, device=dev).expand(n, N), cfg, cd)
    zeros = torch.zeros(n, T, cfg.head_dim // 2, dtype=cd, device=dev)
    cos, sin = torch.cat([zeros, cos_i], 1), torch.cat([zeros, sin_i], 1)
    # the target's own text-slot mask for its variant (models.llamagen.text_slot_mask), so trained
    # features are those the target hands over at decoding
    attend = text_slot_mask(torch.cat([mask, torch.ones(n, N, dtype=torch.bool, device=dev)], 1), cfg.variant)
    cache = KVCache(cfg.n_layer, n, cfg.n_head, cfg.head_dim, L, dt, dev)
    hidden = model.run(h, cos, sin, cache, attend)
    feats = torch.cat([hidden[:, T - 1 : T], hidden[:, T:]], dim=1)
    slots = hidden[:, :T]
    if both_halves:
        feats = torch.stack([feats[:B], feats[B:]], dim=2)
        slots = torch.stack([slots[:B], slots[B:]], dim=2)
    return feats, slots


def llamagen_batch(
    model,
    cond: dict,
    tokens: torch.Tensor,
    *,
    uncond_prob: float = 0.1,
    generator: Optional[torch.Generator] = None,
    both_halves: bool = False,
    text_prefix: bool = False,
) -> EagleBatch:
    """Training batch from a ``LlamaGenGPT`` (LANTERN ``generate_train_data.py`` for LlamaGen):
    each sample's caption is replaced by the null embedding with probability ``uncond_prob``
    (drawn from ``generator``), unless ``both_halves`` keeps both. ``text_prefix`` adds the
    features of condition slots 0..T-2 (LANTERN's drafter layout; only useful with an
    ``EagleDrafter(text_prefix=True)`` fed all slot features)."""
    if hasattr(model, "model") and not hasattr(model, "run"):  # a LlamaGenTarget
        model = model.model
    uncond = None
    if not both_halves and uncond_prob > 0:
        uncond = torch.rand(tokens.shape[0], generator=generator) < uncond_prob
    feats, slots = llamagen_features(model, cond, tokens, uncond=uncond, both_halves=both_halves)
    return EagleBatch(tokens.to(feats.device), feats, slots[:, :-1] if text_prefix else None)


# ---------------------------------------------------------------------------------------- a drafter for a target
def target_data(target, gpt, encode: Callable, items: Sequence, seed: int, log=print, chunk: int = 256, tag: str = "drafter"):
    """The target's own samples for ``items`` (captions, or whatever ``encode`` takes) and their
    features (both CFG halves): (tokens (n, N), features (n, N+1, 2, H)). Sample i of chunk c
    uses seed ``seed * 1_000_003 + c*chunk + j``."""
    toks, feats = [], []
    t0 = time.perf_counter()
    for i in range(0, len(items), chunk):
        cond = encode(items[i : i + chunk])
        n = len(cond["emb_mask"])
        t = target_samples(target, cond, gpt.config.block_size, [seed * 1_000_003 + i + j for j in range(n)])
        toks.append(t)
        feats.append(llamagen_features(gpt, cond, t, both_halves=True)[0])
        log(f"[{tag}] target samples {i + len(t)}/{len(items)} ({time.perf_counter() - t0:.0f}s)")
    return torch.cat(toks), torch.cat(feats)


def train_on_target(target, gpt, encode: Callable, train_items, heldout_items, steps: int, log=print, *,
                    batch_size: int = 32, lr: float = 1e-4, seed: int = 0, chunk: int = 256, tag: str = "drafter"):
    """A fresh EAGLE head (the target's embedding, seeded init) trained on the target's samples
    of ``train_items``; held-out metrics on ``heldout_items``. Returns (head in the master dtype,
    metrics incl. the precision used)."""
    t0 = time.perf_counter()
    with torch.no_grad():
        toks, feats = target_data(target, gpt, encode, train_items, seed=1, log=log, chunk=chunk, tag=tag)
        vt, vf = target_data(target, gpt, encode, heldout_items, seed=2, log=log, chunk=chunk, tag=tag)
    data_s = time.perf_counter() - t0
    head = EagleHead.from_target(gpt, seed=seed)
    g = torch.Generator().manual_seed(1)

    def batch_at(step):
        idx = torch.randint(0, len(toks), (batch_size,), generator=g)
        return EagleBatch(toks[idx], feats[idx])

    evals = [EagleBatch(vt[i : i + 64], vf[i : i + 64]) for i in range(0, len(vt), 64)]

    def progress(step, stats):
        if (step + 1) % max(1, steps // 10) == 0:
            log(f"[{tag}] step {step + 1}/{steps} loss {stats['loss']:.4f} top1 {stats['top1']:.3f} "
                f"({time.perf_counter() - t0:.0f}s)")

    t1 = time.perf_counter()
    lm_head = gpt.output.weight.detach()
    train_eagle(head, lm_head, batch_at, steps, lr=lr, seed=seed, on_step=progress)
    ev = evaluate_eagle(head, lm_head, evals, cfg_scale=target.cfg_scale)
    log(f"[{tag}] held-out (target samples): " + ", ".join(f"{k} {float(v):.4f}" for k, v in ev.items()))
    return head, {**{k: float(v) for k, v in ev.items()}, "n_target_samples": len(toks), "batch_size": batch_size,
                  "data_seconds": data_s, "train_seconds": time.perf_counter() - t1,
                  **TrainPrecision.for_head(head, lm_head).describe()}


def save_drafter(head: EagleHead, out: Path, metrics: dict, target_variant: str = "upstream") -> Path:
    """``config.json`` (LANTERN fields + ``block_size`` + ``text_prefix: false``: trained without
    the text-slot prefix, + ``target_variant``: the target variant whose features it was trained
    on, checked at load time by ``coolsd.models.eagle.model.warn_variant_mismatch``) and ``model.safetensors``
    in the head's dtype (fp32 master weights after ``train_eagle``; ``load_eagle_head`` casts them
    to the target's dtype)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**head.config.to_lantern_json(), "text_prefix": False,
                                                 "target_variant": target_variant}, indent=1))
    (out / "train_metrics.json").write_text(json.dumps({**metrics, "target_variant": target_variant}, indent=1))
    return out


def read_captions(path) -> list[str]:
    p = Path(path) if path else None
    if p is None or not p.is_file():
        raise FileNotFoundError(f"training captions {p or '(train.captions not set)'} not found: give a COCO captions "
                                "file (e.g. captions_train2017.json) or a text file with one caption per line")
    if p.suffix == ".json":
        return [c["caption"] for c in coco_longest_captions(p)]
    return [line.strip() for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
