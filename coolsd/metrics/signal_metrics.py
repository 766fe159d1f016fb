"""The loop's exact per-token quality signals (docs/signals.md, docs/distortion.md) as reported
metrics: each signal's facts, registered once (``coolsd.metrics.registry``), so the summaries, the
page and its plots read its direction and interval from here. The loop computes them
(``coolsd.engine.signals``); every record of a discrete world carries them."""
from __future__ import annotations

from coolsd.metrics.registry import declare_metric
from coolsd.util.stats import FRACTION, POSITIVE

# how far below 0 a record quantity summed over an image's tokens may come out from float32 rounding
# alone (``coolsd.util.stats.clamp_to_domain`` sets it to 0; further below is an error naming the key):
# step_kl sums T per-token KL(pi || p), each computed in float32 over the V-entry vocabulary
# (``coolsd.engine.decoding.distortion.kl``); a float32 softmax's mass exceeds 1 by up to ~1e-6 at
# V = 65536 (2e-7 at V = 16384), which KL(pi || p) reads as that much below 0 per token. At pi ~ p
# (a relaxed method near its lossless setting) the per-image sum of exact zeros was measured at
# -2.6e-4 (V = 16384, T = 1024), -1.5e-4 (V = 8192, T = 2352), -1.5e-3 (V = 65536, T = 1024),
# linear in T: 1e-2 covers T <= 4096 at V <= 65536 (~ -6e-3). step_tv is a sum of absolute values
# (never below 0 in floating point); it shares the bound as the same kind of per-image sum.
TOKEN_SUM_NOISE = 1e-2

declare_metric("step_tv", higher_is_better=False, computed_by="loop", label="step TV (sum/image)", digits=2,
               domain=(POSITIVE, 0.0), noise=TOKEN_SUM_NOISE, pareto=True,
               doc="exact total variation between each token's emitted distribution and the target's, summed over "
                   "the image (0: lossless)")
declare_metric("step_kl", higher_is_better=False, computed_by="loop", label="step KL (sum/image)", digits=2,
               domain=(POSITIVE, 0.0), noise=TOKEN_SUM_NOISE,
               doc="exact KL(emitted || target) of each token, summed over the image (0: lossless)")
declare_metric("off_support", higher_is_better=False, computed_by="loop", label="off-support", digits=4,
               domain=(FRACTION, 0.0),
               doc="fraction of the image's tokens outside the target's warped support (top-k / top-p)")
