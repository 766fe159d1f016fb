"""``target=tabular``: the theory lab's world. Prompts are seeded (target, draft) pairs of random
tabular AR models (coolsd.theory); generating a prompt runs ``n_samples`` sequences through the
production loop and sets their statistics beside the exact ones (TV to the target's sequence
distribution, accepted length, a chi-square test of sampled against exact), one record per pair.
No images, no baseline: the exact oracle is the reference."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import List

from omegaconf import MISSING

from coolsd.engine.methods import method_info
from coolsd.theory.lab import _method, exact_stats, has_exact_stats, sample_stats
from coolsd.theory.stats import chi_square_pvalue
from coolsd.theory.tabular import TabularAR
from coolsd.worlds.base import Sample, World
from coolsd.worlds.presentation import Column, Presentation
from coolsd.worlds.schema import TargetSchema


@dataclass(frozen=True)
class LabPair:
    seed: int
    target: TabularAR
    draft: TabularAR

    @property
    def caption(self) -> str:
        return f"tabular pair {self.seed}"


@dataclass(frozen=True)
class LabMethod:
    """A registered discrete method, validated on the lab's models (each pair has its own
    codebook, so the loop's method is built per pair)."""

    name: str
    params: dict
    tree: str
    draft_length: int
    described: dict
    family = "discrete"

    def describe(self) -> dict:
        return self.described


@dataclass
class TabularTargetSchema(TargetSchema):
    vocab: int = MISSING
    length: int = MISSING
    draft_mix: float = MISSING
    concentration: float = MISSING
    pairs: List[int] = field(default_factory=list)
    n_samples: int = MISSING


class TabularWorld(World):

    targets = ("tabular",)  # conf/target/<name>.yaml
    schema = ("tabular_schema", TabularTargetSchema)  # its conf files name it first
    family = "discrete"
    makes_images = False
    runs_baseline = False
    warmup = False  # a pair is 20,000 sequences: no untimed pass
    record_metrics = ("exact_tv", "sampled_tv_to_target", "exact_accepted_length", "sampled_accepted_length",
                      "chi2_p_sampled_vs_exact", "latency_s")
    presentation = Presentation(
        columns=(Column("exact_tv", "exact TV", 4), Column("sampled_tv_to_target", "sampled TV", 4),
                 Column("exact_accepted_length", "exact acc. length", 4),
                 Column("sampled_accepted_length", "sampled acc. length", 4)),
        per_prompt=("pair", "exact_tv", "exact_accepted_length", "sampled_accepted_length", "sampled_tv_to_target",
                          "chi2_p_sampled_vs_exact", "n_samples"))

    @classmethod
    def dataset(cls, cfg) -> dict:
        t = cfg.target
        return {"name": "tabular", "pairs": [int(s) for s in t.pairs], "n_prompts": len(t.pairs), "offset": 0}

    @classmethod
    def prompts(cls, cfg) -> list:
        t = cfg.target
        # deferred: the lab's sweep (pandas, matplotlib) loads only when the lab world runs
        from coolsd.theory.sweep import lab_pairs

        return [LabPair(s, P, Q) for s, P, Q in lab_pairs(t.vocab, t.length, t.draft_mix, list(t.pairs))]

    @classmethod
    def image_tokens(cls, cfg) -> int:
        return int(cfg.target.length)

    @classmethod
    def load(cls, cfg) -> "TabularWorld":
        return cls(cfg)

    def __init__(self, cfg):
        t = cfg.target
        self.name, self.device = str(t.name), "cpu"  # the configured name (a subclass's own, docs/add_target.md)
        self.lab = {k: t[k] for k in ("vocab", "length", "draft_mix", "concentration")}
        self.n_samples = int(t.n_samples)
        self._first = self.prompts(cfg)[0]

    def files(self) -> dict:
        return {}

    def settings(self) -> dict:
        return {"lab": {**self.lab, "n_samples": self.n_samples}}

    def build_method(self, name: str, params: dict, tree="chain", draft_length=None) -> LabMethod:
        m = _method(self._first.target, name, draft_length, tree, params)  # validates everything first
        return LabMethod(name, dict(params), tree, draft_length, m.describe())

    def generate(self, method: LabMethod, prompts: list, seeds: list[int]) -> list[Sample]:
        out = []
        for pair, seed in zip(prompts, seeds):
            t0 = time.perf_counter()
            P, Q, N = pair.target, pair.draft, pair.target.N
            s = sample_stats(P, Q, method.name, method.draft_length, self.n_samples, seed, tree=method.tree,
                             **method.params)
            if has_exact_stats(method.name) and method.tree == "chain":
                e = exact_stats(P, Q, method.name, method.draft_length, **method.params)
                ref, tv, al = e["distribution"], e["tv"], e["accepted_length"]
            elif method_info(method.name).is_lossless(method.params):  # no exact oracle: lossless ones match the target
                ref, tv, al = P.sequence_distribution(), 0.0, math.nan
            else:
                ref, tv, al = None, math.nan, math.nan
            half = 1.96 * s["rounds_std"] / math.sqrt(s["n"])
            out.append(Sample({
                "pair": pair.seed, "accepted_length": s["accepted_length"],
                "exact_tv": tv, "exact_accepted_length": al, "sampled_accepted_length": s["accepted_length"],
                "sampled_accepted_length_ci95": [N / (s["mean_rounds"] + half), N / max(s["mean_rounds"] - half, 1e-9)],
                "sampled_tv_to_target": s["tv_to_target"],
                "chi2_p_sampled_vs_exact": chi_square_pvalue(s["counts"], ref) if ref is not None else math.nan,
                "n_samples": s["n"], "latency_s": time.perf_counter() - t0}, None))
        return out
