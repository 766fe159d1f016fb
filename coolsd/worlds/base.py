"""The world contract: what a target name resolves to (``target=<name>``, conf/target/<name>.yaml,
registered in ``coolsd.worlds``).

A world owns its models (target, drafter options), its prompts' condition encoder, its
token-to-pixel decoder, the files it needs and its quality metrics; the generation job
(``coolsd.job.generation``) drives every world through this interface only:

* before anything loads (class methods): ``needs(cfg)`` (the input files of the target and its
  drafter, ``coolsd.worlds.files.Need``: what the check lists and ``python -m coolsd.cli.download``
  fetches), ``missing_files(cfg)`` (every missing one at once, with where it comes from),
  ``prompts(cfg)`` and ``dataset(cfg)`` (the prompt set and what identifies it),
  ``quality(outputs, prompts, files)`` (per-method quality numbers computed from the records and
  images: toy metrics for the toy worlds, none for real ones, whose image metrics come from
  ``python -m coolsd.cli.evaluate``);
* ``load(cfg)``, then ``build_method``, ``generate`` (a batch of prompts -> one ``Sample``
  per prompt), ``files()`` / ``settings()`` (what binds a run folder to these models and
  sampling settings) and ``reference_images`` (the grid's last row, where the world can draw
  the truth).

``DiscreteWorld`` runs discrete methods through ``coolsd.engine.loop`` (one loop);
``ContinuousWorld`` runs continuous ones through ``coolsd.engine.continuous.generate``.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from abc import ABC, abstractmethod
from typing import Any, ClassVar, NamedTuple, Optional

import numpy as np
import torch

from coolsd.engine.batch_invariant import per_sample
from coolsd.engine.decoding.lantern import CodebookNeighbours
from coolsd.engine.decoding.rng import PerSampleRNG
from coolsd.engine.drafting import SamplingConfig, build_drafter
from coolsd.engine.loop import speculative_generate
from coolsd.engine.continuous.flow import FlowConfig
from coolsd.engine.methods import build_method
from coolsd.engine.timing import device_sync
from coolsd.prompts import load_prompts, prompt_file_dataset
from coolsd.util.errors import ConfigError
from coolsd.util.registry import Registry
from coolsd.util.fingerprint import file_identity
from coolsd.worlds.files import run_missing_inputs
from coolsd.worlds.presentation import (
    CONTINUOUS_COLUMNS,
    DISCRETE_SPEED_COLUMNS,
    SIGNAL_COLUMNS,
    SPEED_COLUMNS,
    Presentation,
)


class Sample(NamedTuple):
    """One generated prompt: the record's measured fields (``accepted_length``, ``latency_s``,
    counters, ...) and its uint8 (H, W, 3) image (None for worlds without images)."""

    fields: dict
    image: Optional[np.ndarray]




# target name -> world class (``coolsd.util.registry``): every subclass with ``targets`` registers
# itself; the package's own worlds (every module of ``coolsd.worlds``) are imported on the first
# lookup; facts: family
TARGETS = Registry("target", classes=True, discover="coolsd.worlds")


class World(ABC):
    """A target: see the module docstring for the contract. A subclass that names ``targets``
    registers itself for them (``coolsd.worlds.world_class``): a new target is its model file,
    its world file (this class's subclass, with its config ``schema``) and its conf file."""

    targets: ClassVar[tuple[str, ...]] = ()  # the target names (conf/target/<name>.yaml) it assembles
    schema: ClassVar[Optional[tuple[str, type]]] = None  # (schema name, dataclass) its conf files name first

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in cls.__dict__.get("targets", ()):
            TARGETS.add(name, cls, family=getattr(cls, "family", None))

    family: ClassVar[str]  # which methods run on it (coolsd.engine.methods.FAMILIES)
    makes_images: ClassVar[bool] = True
    quality_reads_images: ClassVar[bool] = False  # quality() needs every image (else the job keeps a grid's worth)
    runs_baseline: ClassVar[bool] = True  # the job runs each method's baseline (AR) beside it
    warmup: ClassVar[bool] = True  # one untimed batch per method before timing
    # record fields summarised per method as mean [95% CI] over prompts
    record_metrics: ClassVar[tuple[str, ...]] = ("accepted_length", "latency_s", "decode_s", "target_forwards")
    # quality record fields also reported as a paired difference to ``ar`` (``<key>_minus_ar``, by prompt)
    paired_metrics: ClassVar[tuple[str, ...]] = ()
    presentation: ClassVar[Presentation] = Presentation(SPEED_COLUMNS)  # how a run's summary is printed
    # python -m coolsd.cli.train_drafter: a LlamaGen-class world exposes ``target``, ``gpt``,
    # ``encode`` and ``training_captions(n, seed, path)``
    trains_drafters: ClassVar[bool] = False
    # compile=true: the world runs its target and drafter forwards under torch.compile (coolsd.engine.compiled)
    compiles: ClassVar[bool] = False
    # row-parallel methods (``zipar``; coolsd.engine.rows): the target's forward takes by_position=True
    row_parallel: ClassVar[bool] = False
    compiled: bool = False  # this loaded world runs compiled (set by worlds that compile)
    # images a call of ``decode_uint8`` decodes at most (``decode_images``): a VQ decoder's float32
    # activations at full resolution cost ~1.2-1.5 GB an image for Lumina-mGPT at 768 px, so a whole
    # batch at once would grow with the batch; 4 images keep the peak a few GB at any batch size
    decode_chunk: int = 4
    signals: bool = True  # discrete worlds record per-token quality signals (``quality_signals``, set by load_world)

    name: str
    device: torch.device

    # ----------------------------------------------------------------- before anything loads
    @classmethod
    def needs(cls, cfg) -> list:
        """The ``Need`` of every input file of the configured target and drafter (the data set's
        are ``coolsd.worlds.files.dataset_needs``): the one list the check and the download read."""
        return []

    @classmethod
    def missing_files(cls, cfg) -> list[str]:
        """'name: path (why) -- source' for every file the data set, the target and its drafter
        need but lack (``needs``)."""
        return run_missing_inputs(cfg, cls.needs(cfg))

    @classmethod
    def image_tokens(cls, cfg) -> Optional[int]:
        """Tokens per image of the configured target, known before it loads (the longest useful
        ``tree.draft_length``; coolsd.job.config_schema); None where no bound is known."""
        return None

    @classmethod
    def dataset(cls, cfg) -> dict:
        """What identifies the prompt set (part of a run folder's identity)."""

        d = cfg.dataset
        if d.get("name") == "prompts":  # a prompt file (docs/protocols.md, "Prompt files"): its content fingerprint
            return prompt_file_dataset(d, file_identity(d.path))
        return {"name": d.name, "n_prompts": int(d.n_prompts), "offset": int(d.offset),
                **({"captions": file_identity(d.captions)} if d.get("captions") else {})}  # its content fingerprint

    @classmethod
    def prompts(cls, cfg) -> list:
        """The prompts (each with ``.caption``), position i = prompt index ``offset + i``."""

        return load_prompts(cfg.dataset)

    @classmethod
    def prompt_rules(cls) -> str:
        """What a prompt of this target may be, in words (``python run.py --list targets``); '': any
        text its encoder reads."""
        return ""

    @classmethod
    def check_prompts(cls, prompts: list, path) -> None:
        """Refuse, in one line naming the file and line (``p.line``), prompts of a prompt file
        ``path`` (``dataset=prompts``) that this target cannot condition on; run by
        ``coolsd.job.config_schema.check_config`` before anything loads. Default: every text."""

    @classmethod
    def quality(cls, outputs: dict, prompts: list, files: dict) -> dict:
        """{tag: {metric: value}} from ``outputs`` {tag: (records, uint8 images)} on ``prompts``;
        ``files``: the run's ``files()`` (which weights the metrics must use)."""
        return {}

    @classmethod
    @abstractmethod
    def load(cls, cfg) -> "World":
        """The loaded world; called once ``missing_files(cfg)`` is empty (``coolsd.worlds.load_world``
        and the job check it first)."""

    # ----------------------------------------------------------------- a loaded world
    @abstractmethod
    def files(self) -> dict:
        """Identity of the files (or shipped weights) this world loaded, drafter included."""

    @abstractmethod
    def settings(self) -> dict:
        """The sampling settings every method of a run shares (recorded in run.json and summary)."""

    @abstractmethod
    def build_method(self, name: str, params: dict, tree="chain", draft_length=None):
        """A registered method of this world's family (a family mismatch is an error listing the
        methods that run here)."""

    @abstractmethod
    def generate(self, method, prompts: list, seeds: list[int]) -> list[Sample]:
        """One batch of prompts, each with its own seed; equal to generating each alone (in
        distribution; bit for bit under ``coolsd.engine.batch_invariant``)."""

    def reference_images(self, prompts: list) -> Optional[np.ndarray]:
        return None

    def decode_images(self, tokens) -> np.ndarray:
        """``decode_uint8(tokens)`` for a batch, ``decode_chunk`` images a call (bounded decoder
        memory), each chunk through ``per_sample`` (one image a call inside ``batch_invariant()``).
        The decoders are per image (convolutions, GroupNorm and attention within an image), so a
        chunk's images are the whole batch's up to a convolution's choice of algorithm by batch size
        (``coolsd.engine.batch_invariant``; bit for bit on the CPU for the tiny test decoders, and bit for
        bit everywhere inside ``batch_invariant()``, which decodes images alone either way)."""
        n = max(1, int(self.decode_chunk))
        parts = [per_sample(self.decode_uint8, tokens[i : i + n]) for i in range(0, len(tokens), n)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


TARGETS.base = World  # every registered target is a World subclass


def draft_kind(cfg, default: str, valid: tuple[str, ...], target: str, hint: str) -> str:
    """The configured ``draft.kind`` (the target's default without a draft config), validated."""
    kind = (cfg.get("draft") or {}).get("kind", default)
    if kind not in valid:
        raise ValueError(f"target {target} drafts with {hint}, not draft kind {kind!r}")
    return kind


def image_seconds(fn, device) -> tuple[Any, float]:
    """(fn(), wall seconds) with the clock read after the device finished (docs/methods.md#6-evaluation-protocol)."""
    sync = device_sync(device)
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def image_signals(res, b: int) -> dict:
    """Sample b's quality signals from the loop's per-token record:

    * ``step_tv`` / ``step_kl``: sums over its tokens of TV(pi_t, p_t) and KL(pi_t || p_t), the exact
      distortion of the distribution each token was emitted from (docs/distortion.md); None for
      trees with siblings (no closed form);
    * ``target_nll``: mean over tokens of -log p(x_t) under the target's guided distribution (sampling
      temperature, before top-k / top-p); ``off_support``: the fraction of tokens outside the warped
      support (a relaxed rule can accept them);
    * ``target_nll_expected``: mean over tokens of E[-log p(x_t) | prefix, round] = -sum_y pi_t(y) log p(y),
      the exact conditional expectation of each token's NLL given what preceded its draw (the same
      mean as ``target_nll`` by the tower rule, without the draw's own noise: its paired difference
      to AR resolves far smaller NLL shifts); None where a verified token's pi has no closed form
      (trees with siblings);
    * ``token_tv`` (4 significant digits) and ``token_depth`` (the round depth each token was verified
      at, 0 if drawn from p): per-token arrays for the distortion map and the depth curve
      (``coolsd.report.distortion``); absent when the signals were not recorded.
    """
    tv, kl = float(res.step_tv[b].sum()), float(res.step_kl[b].sum())
    nll = float(res.token_nll[b].mean())
    if math.isnan(nll):  # not recorded (speculative_generate(distortion=False))
        return {}
    chain = not math.isnan(tv)
    xnll = float(res.token_nll_expected[b].mean())
    return {"step_tv": tv if chain else None, "step_kl": kl if chain else None, "target_nll": nll,
            "target_nll_expected": None if math.isnan(xnll) else xnll,
            "off_support": float(res.token_off_support[b].mean()),
            "token_tv": [float(f"{x:.4g}") for x in res.step_tv[b].tolist()] if chain else None,
            "token_depth": [int(x) for x in res.token_depth[b].tolist()]}


class DiscreteWorld(World):
    """A token target: ``target`` (an ``ImageTarget``: ``vocab_size``, ``n_image_tokens``),
    ``encode(captions)`` -> its condition, ``decode_uint8(tokens)`` -> (B, H, W, 3) uint8,
    ``drafter()`` (the configured draft model), ``codebook()`` (the VQ codebook LANTERN's latent
    neighbourhoods are measured in, or None) and ``sampling``; every method runs through
    ``coolsd.engine.loop``."""

    family = "discrete"
    record_metrics = World.record_metrics + ("step_tv", "step_kl", "target_nll", "target_nll_expected", "off_support")
    paired_metrics = ("step_tv", "step_kl", "target_nll", "target_nll_expected", "off_support")
    presentation = Presentation(DISCRETE_SPEED_COLUMNS + SIGNAL_COLUMNS)
    target: Any
    sampling: SamplingConfig
    cfg_scale: float

    @abstractmethod
    def encode(self, captions: list[str]) -> Any:
        ...

    @abstractmethod
    def decode_uint8(self, tokens: torch.Tensor) -> np.ndarray:
        ...

    @abstractmethod
    def drafter(self):
        """The draft model (an ``ARModel``) of the configured ``draft``; an error if none."""

    def codebook(self) -> Optional[torch.Tensor]:
        """The (V, D) VQ codebook whose L2 geometry defines LANTERN's neighbourhoods (docs/methods.md#3-lantern-and-lantern);
        None where the tokenizer has none (LANTERN methods are then refused)."""
        return None

    @functools.cached_property
    def neighbours(self) -> Optional[CodebookNeighbours]:
        """LANTERN's latent neighbourhoods, indexed as the (V, V - 1) table of
        ``lantern.neighbours_from_codebook``, or None: nothing is sorted until a method reads its
        columns (``build_method`` of ``lantern`` / ``lantern_pp``: their rules are the only readers),
        and the table is shared by every world over the same codebook (``lantern.neighbour_table``)."""
        cb = self.codebook()
        return None if cb is None else CodebookNeighbours(cb)

    def settings(self) -> dict:
        return {"sampling": dataclasses.asdict(self.sampling), "cfg_scale": float(self.cfg_scale),
                **({"compiled": True} if self.compiled else {}), **({} if self.signals else {"quality_signals": False})}

    def build_method(self, name: str, params: dict, tree="chain", draft_length=None):
        return build_method(name, family=self.family, tree=tree, draft_length=draft_length, neighbours=self.neighbours,
                            **params)

    def generate_tokens(self, method, prompts: list, seeds: list[int], n_tokens: Optional[int] = None
                        ) -> tuple[Any, Any]:
        """(``GenerationResult``, the batch's condition): one batch through the loop, the way every
        run of this world decodes (``generate``; also benchmarks/exactness.py, which rescores the
        tokens under the same condition). ``n_tokens``: the tokens each image's run emits (None:
        the whole image; fewer: the first tokens only, as the device tests run it)."""
        target = self.target
        drafter = build_drafter(method, self.drafter() if method.drafter == "model" else None, self.sampling,
                                target.vocab_size, grid_width=grid_width(target))
        with torch.no_grad():
            cond = per_sample(self.encode, [p.caption for p in prompts])
            res = speculative_generate(
                target, n_tokens or target.n_image_tokens, PerSampleRNG(list(seeds)), rule=method.rule, drafter=drafter,
                tree=method.tree, sampling=self.sampling, cond=cond, batch_size=len(seeds),
                sync=device_sync(self.device), distortion=self.signals)
        return res, cond

    def generate(self, method, prompts: list, seeds: list[int]) -> list[Sample]:
        res, _ = self.generate_tokens(method, prompts, seeds)
        with torch.no_grad():
            imgs, decode_s = image_seconds(lambda: self.decode_images(res.tokens), self.device)
        return [Sample({"round_lengths": res.round_lengths[b], "accepted_length": res.accepted_length(b),
                        "target_forwards": res.target_forwards[b], "draft_forwards": res.draft_forwards,
                        "latency_s": res.seconds, "signal_s": res.extra.get("signal_s"), "decode_s": decode_s,
                        **image_signals(res, b)}, imgs[b])
                for b in range(len(seeds))]


class EncodedPromptWorld(DiscreteWorld):
    """A discrete world of one loaded target, a prompt encoder (``encoder.encode(captions)``) and
    an optional draft model: the shared parts of the transformer-checkpoint worlds (Lumina-mGPT,
    Janus-Pro, Emu3). ``draft_hint`` says how to configure a drafter where none is."""

    draft_hint: ClassVar[str] = "draft=self, or a method without a drafter such as ar or sjd"

    def __init__(self, name: str, target, encoder, sampling: SamplingConfig, files: dict, drafter=None):
        self.name, self.target, self.encoder, self.sampling = name, target, encoder, sampling
        self._files, self._drafter = files, drafter
        self.cfg_scale = target.cfg_scale
        self.device = target.device

    def files(self) -> dict:
        return self._files

    def encode(self, captions):
        return self.encoder.encode(captions)

    def drafter(self):
        if self._drafter is None:
            raise ValueError(f"this method drafts with a model, but target {self.name} has no drafter configured "
                             f"({self.draft_hint})")
        return self._drafter


def grid_width(target) -> Optional[int]:
    """Width in tokens of a target's image grid: ``w_latent`` where the target has one (Lumina-mGPT),
    else the side of a square grid of ``n_image_tokens`` (LlamaGen, the toy world); None if neither."""
    w = getattr(target, "w_latent", None)
    if w:
        return int(w)
    n = getattr(target, "n_image_tokens", None)
    side = math.isqrt(n) if n else 0
    return side if side and side * side == n else None


class ContinuousWorld(World):
    """A continuous-token target (MAR-style): ``target`` and ``draft`` models, the shared
    ``head`` settings (``HeadConfig``), ``labels(prompts)`` -> class labels and
    ``decode_uint8(tokens)``; a continuous method's ``generate(target, draft, labels, seeds,
    head)`` runs its loop (``coolsd.engine.continuous.generate``).

    Records add CSpD's counters (drafted, verified, accepted, acceptance_rate, resample_rounds,
    fallbacks, target and draft forwards); ``accepted_length`` is tokens per target forward
    (seq_len / target_forwards), the continuous analogue of the discrete accepted length."""

    family = "continuous"
    record_metrics = World.record_metrics + ("acceptance_rate", "draft_forwards", "resample_rounds", "fallbacks")
    presentation = Presentation(CONTINUOUS_COLUMNS)
    target: torch.nn.Module
    draft: torch.nn.Module
    head: Any

    @abstractmethod
    def labels(self, prompts: list) -> torch.Tensor:
        ...

    @abstractmethod
    def decode_uint8(self, tokens: torch.Tensor) -> np.ndarray:
        ...

    def settings(self) -> dict:
        """The head settings; a diffusion head's ``sampler`` / ``eta`` only when not DDPM's, and the
        settings added since (DiSA's ``anneal`` / ``lower_steps``, a flow model's ``num_iter``) only
        when set, so that run folders made before each option existed keep their identity."""
        head = dataclasses.asdict(self.head)
        if head.get("sampler") == "ddpm" and head.get("eta") == 0:
            del head["sampler"], head["eta"]
        late = ("anneal", "lower_steps") + (("num_iter",) if isinstance(self.head, FlowConfig) else ())
        return {"head": {k: v for k, v in head.items() if not (k in late and v is None)}}

    def build_method(self, name: str, params: dict, tree="chain", draft_length=None):
        method = build_method(name, family=self.family, **params)
        self.check_sampling(method)
        return method

    def check_sampling(self, method) -> None:
        """The settings ``method`` runs (this world's head with its overrides) checked before any
        work, each refusal one line: a flow target's ``num_iter`` must give a unit that divides its
        cell (``FlowConfig.unit_for``), a method's ``num_iter`` on a diffusion head is at most its token
        count (each of MAR's MaskGIT steps makes a token at least); only the loaded model's geometry
        tells."""
        try:
            head = method.head_config(self.head)
            c = self.target.config
            if isinstance(head, FlowConfig):
                head.unit_for(c.cell_len, c.n_cells)
            elif getattr(method, "num_iter", None) is not None and method.num_iter > c.seq_len:
                # the method's steps (a target's own head.num_iter, upstream's config, may exceed its tokens:
                # the steps that would reveal none are dropped, ``maskgit_iterations``)
                raise ValueError(f"num_iter {method.num_iter} > the target's {c.seq_len} tokens: every AR step "
                                 f"makes at least one token (num_iter <= {c.seq_len})")
        except ValueError as e:
            raise ConfigError(f"method={method.name}: {e}") from None

    def generate(self, method, prompts: list, seeds: list[int]) -> list[Sample]:
        labels = self.labels(prompts)
        with torch.no_grad():  # a continuous method runs its own loop (coolsd.engine.methods.cspd)
            res, latency = image_seconds(lambda: method.generate(self.target, self.draft, labels, seeds, self.head),
                                         self.device)
            imgs, decode_s = image_seconds(lambda: self.decode_images(res.tokens), self.device)
        L = res.tokens.shape[1]
        return [Sample({"accepted_length": L / res.counters[b]["target_forwards"], **res.counters[b],
                        "acceptance_rate": res.acceptance_rate(b), "latency_s": latency, "decode_s": decode_s},
                       imgs[b]) for b in range(len(seeds))]
