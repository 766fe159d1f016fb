"""The exact distribution of a row-parallel decoder (ZipAR, docs/methods.md section 8.1) on a tiny grid.

ZipAR's schedule does not depend on the tokens, so the distribution it samples is the product, over
the image's tokens, of the distribution each token is drawn from given what its query sees:
P_zip(x) = prod_t q_t(x_t | x_{S_t}). With few codes and a small grid every image can be enumerated:
one forward per image of every entry the schedule feeds, all pending, under ``visibility`` (which
states what each query sees independently of the KV cache's visibility by position the loop uses),
gives every q_t; one teacher-forced forward gives the target's p_t(. | x_<t). Then

* ``tv`` = TV(P_zip, P) over all images (0 for a lossless decoder);
* ``expected_step_tv`` = E_{x ~ P_zip}[sum_t TV(q_t, p_t)], the mean of the loop's per-image
  ``step_tv`` sum, which bounds ``tv`` from above (a coupling argument: draw each token from q_t and
  p_t maximally coupled; the sequences differ only if some step's draws differ);
* ``tokens_per_forward`` = image tokens / target forwards (the prefill included).
"""
from __future__ import annotations

import itertools

import torch

from coolsd.engine.rows import RowParallel, teacher_forced_logits, visibility


def all_images(codes: int, n: int) -> torch.Tensor:
    """(codes^n, n): every sequence of n tokens over ``codes`` codes, in lexicographic order."""
    return torch.tensor(list(itertools.product(range(codes), repeat=n)), dtype=torch.long)


def draw_distributions(target, cond, steps, images: torch.Tensor, sampling) -> torch.Tensor:
    """(I, n, V) float64: for each image, the distribution ZipAR draws each token from (token 0
    from the prefill), from one forward of every fed entry under ``visibility(steps)``."""
    I, n = images.shape
    fed = [f for s in steps for f in s.fed]
    pos = torch.tensor([p for s in steps for p in s.positions]).expand(I, -1)
    with torch.no_grad():
        first = target.begin(cond, I).logits[:, -1]
        logits = target.forward(images[:, fed], pos, visibility(steps)).logits
        target.commit(None, torch.zeros(I, dtype=torch.long))
    q = torch.zeros(I, n, first.shape[-1], dtype=torch.float64)
    q[:, 0] = sampling.probs(first).double()
    e = 0
    for s in steps:
        for j in s.sample:
            if j >= 0:
                q[:, j] = sampling.probs(logits[:, e]).double()
            e += 1
    return q


def target_distributions(target, cond, images: torch.Tensor, sampling) -> torch.Tensor:
    """(I, n, V) float64: the target's p_t(. | x_<t) for every token of every image."""
    with torch.no_grad():
        return sampling.probs(teacher_forced_logits(target, cond, images)).double()


def zipar_exact(target, cond_for, codes: int, height: int, width: int, window, sampling, chunk: int = 4096) -> dict:
    """The module docstring's quantities for ZipAR with ``window`` on a ``height`` x ``width`` grid
    of ``codes`` codes; ``cond_for(B)``: the condition of a batch of B images. Images go through in
    chunks of ``chunk`` (memory: the KV cache of a chunk)."""
    n = height * width
    rows = RowParallel(window, width)
    steps = rows.schedule(n)
    images = all_images(codes, n)
    p_zip, p_tgt, step_tv = [], [], []
    for part in images.split(chunk):
        q = draw_distributions(target, cond_for(len(part)), steps, part, sampling)
        p = target_distributions(target, cond_for(len(part)), part, sampling)
        idx = part.unsqueeze(-1)
        p_zip.append(q.gather(2, idx)[..., 0].prod(1))
        p_tgt.append(p.gather(2, idx)[..., 0].prod(1))
        step_tv.append(0.5 * (q - p).abs().sum(-1).sum(1))
    p_zip, p_tgt, step_tv = torch.cat(p_zip), torch.cat(p_tgt), torch.cat(step_tv)
    return {"height": height, "width": width, "codes": codes, "window": rows.window,
            "images": int(images.shape[0]), "target_forwards": len(steps) + 1, "tokens_per_forward": n / (len(steps) + 1),
            "tv": float(0.5 * (p_zip - p_tgt).abs().sum()), "expected_step_tv": float((p_zip * step_tv).sum()),
            "mass_zipar": float(p_zip.sum()), "mass_target": float(p_tgt.sum())}
