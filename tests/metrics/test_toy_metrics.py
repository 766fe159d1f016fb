"""Toy metrics: Fréchet distance, streaming statistics, feature extraction, toy_clip, improved
precision / recall, toy_quality, the feature network's persistence. Tiny random networks only;
the trained net is not needed."""
import json
import warnings

import numpy as np
import pytest
import torch
from scipy import stats

from coolsd.metrics import (
    FeatureExtractor,
    StreamingStats,
    toy_fid_ci,
    bootstrap_precision_recall_ci,
    caption_attributes,
    feature_statistics,
    fid_from_features,
    frechet_distance,
    frechet_distance_sym,
    mean_ci,
    paired_precision_recall_difference_ci,
    precision_recall,
    precision_recall_indicators,
    sqrt_psd,
    to_float_images,
    toy_clip,
    toy_clip_scores,
    toy_fid,
)
from coolsd.toy.features import (
    ToyFeatureExtractor,
    ToyFeatureNet,
    augment,
    degrade,
    load_feature_net,
    read_feature_net_metadata,
    save_feature_net,
    train_feature_net,
)
from coolsd.toy.scenes import ATTRIBUTES, render_batch, sample_scenes

TINY = {"channels": [4, 8, 8], "feature_dim": 16}


def _tiny_net(seed=0) -> ToyFeatureNet:
    torch.manual_seed(seed)
    net = ToyFeatureNet(**TINY)
    with torch.no_grad():  # non-trivial BatchNorm running statistics
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    return net.eval()


@pytest.fixture(scope="module")
def images():
    return render_batch(sample_scenes(45, seed=3))


def _reference_fid(a, b):
    """Independent reference: np.cov stats; tr sqrt(S1 S2) = sum sqrt(eig(S1^1/2 S2 S1^1/2))."""
    m1, m2 = a.mean(0), b.mean(0)
    s1, s2 = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    w, v = np.linalg.eigh(s1)
    r1 = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    ev = np.linalg.eigvalsh(r1 @ s2 @ r1)
    return float(np.sum((m1 - m2) ** 2) + np.trace(s1) + np.trace(s2) - 2 * np.sum(np.sqrt(np.clip(ev, 0, None))))


# ---- Fréchet distance ---------------------------------------------------------------------
def test_fid_of_a_set_against_itself_is_zero():
    r = np.random.default_rng(0)
    a = r.normal(size=(400, 24)) @ r.normal(size=(24, 24)) + 3.0
    assert abs(fid_from_features(a, a)) < 1e-6
    relu = np.maximum(r.normal(size=(300, 32)), 0)
    relu[:, :5] = 0  # dead units: singular covariance
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scipy: "Matrix is singular" (as in pytorch-fid)
        assert abs(fid_from_features(relu, relu)) < 1e-6


def test_fid_matches_direct_numpy_computation():
    r = np.random.default_rng(1)
    a = r.normal(size=(500, 16)) @ r.normal(size=(16, 16))
    b = r.normal(size=(350, 16)) @ r.normal(size=(16, 16)) * 0.7 + 0.5
    ref = _reference_fid(a, b)
    assert ref > 1
    assert fid_from_features(a, b) == pytest.approx(ref, rel=1e-8)
    assert toy_fid(torch.from_numpy(a).float(), b) == pytest.approx(_reference_fid(a.astype(np.float32).astype(np.float64), b), rel=1e-8)
    mu, sigma = feature_statistics(a)
    np.testing.assert_allclose(mu, a.mean(0), rtol=1e-12)
    np.testing.assert_allclose(sigma, np.cov(a, rowvar=False), rtol=1e-10, atol=1e-12)


def test_symmetric_eigen_route_matches_sqrtm():
    r = np.random.default_rng(5)
    a = np.maximum(r.normal(size=(300, 20)), 0)
    b = np.maximum(r.normal(size=(200, 20)) + 0.2, 0)
    sa, sb = feature_statistics(a), feature_statistics(b)
    assert frechet_distance_sym(*sa, *sb) == pytest.approx(frechet_distance(*sa, *sb), rel=1e-9)
    np.testing.assert_allclose(sqrt_psd(sb[1]) @ sqrt_psd(sb[1]), sb[1], atol=1e-12)


def test_frechet_distance_closed_form_1d_and_checks():
    # 1-D Gaussians: (m1 - m2)^2 + (s1 - s2)^2
    assert frechet_distance([1.0], [[4.0]], [3.0], [[9.0]]) == pytest.approx(4.0 + 1.0, rel=1e-12)
    with pytest.raises(ValueError):
        frechet_distance(np.zeros(2), np.eye(2), np.zeros(3), np.eye(3))
    with pytest.raises(ValueError):
        feature_statistics(np.zeros((1, 4)))


def test_streaming_statistics_equal_one_shot():
    r = np.random.default_rng(2)
    x = r.normal(size=(1000, 12)) * r.uniform(0.1, 10, 12) + 1e3  # large offset: cancellation-prone
    s = StreamingStats()
    for lo, hi in [(0, 1), (1, 130), (130, 131), (131, 600), (600, 1000)]:
        s.update(torch.from_numpy(x[lo:hi]) if lo % 2 else x[lo:hi])
    s.update(np.zeros((0, 12)))
    mu, sigma = s.compute()
    mu1, sigma1 = feature_statistics(x)
    assert s.n == 1000
    np.testing.assert_allclose(mu, mu1, rtol=1e-13, atol=0)
    np.testing.assert_allclose(sigma, sigma1, rtol=1e-10, atol=1e-12 * np.abs(sigma1).max())
    assert np.array_equal(sigma, sigma.T)
    with pytest.raises(ValueError):
        s.update(np.zeros((3, 5)))


# ---- feature extraction -----------------------------------------------------------------------
def test_feature_extraction_batch_size_independent_and_deterministic(images):
    ext = ToyFeatureExtractor(_tiny_net(0), batch_size=64)
    assert isinstance(ext, FeatureExtractor) and ext.feature_dim == 16 and ext.name == "toy_feature_net"
    full = ext(images)
    assert full.shape == (45, 16) and full.dtype == np.float64 and np.abs(full).sum() > 0
    for bs in (1, 7, 32, 1000):
        assert np.array_equal(ext(images, batch_size=bs), full)
    assert np.array_equal(ext(images[5:12]), full[5:12])  # position in the input does not matter
    chw = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255
    assert np.array_equal(ext(chw), full)  # uint8 NHWC == float NCHW in [0, 1]
    assert np.array_equal(ToyFeatureExtractor(_tiny_net(0))(images), full)  # same seed, same net
    assert not np.allclose(ToyFeatureExtractor(_tiny_net(1))(images), full)
    assert ext(images[:0]).shape == (0, 16)


def test_predictions_consistent_with_features(images):
    ext = ToyFeatureExtractor(_tiny_net(0), batch_size=8)
    feats, preds = ext.features_and_predictions(images)
    assert np.array_equal(feats, ext(images))
    assert set(preds) == set(ATTRIBUTES)
    with torch.no_grad():
        logits = ext.model.logits(torch.from_numpy(feats).float())
    for k, names in ATTRIBUTES.items():
        assert preds[k].shape == (45,) and preds[k].dtype == np.int64
        assert preds[k].min() >= 0 and preds[k].max() < len(names)
        agree = (logits[k].argmax(1).numpy() == preds[k]).mean()
        assert agree > 0.95  # float32 re-run of the head; ties aside
    assert all(np.array_equal(preds[k], v) for k, v in ext.predict_attributes(images, batch_size=5).items())


def test_image_input_validation(images):
    x = to_float_images(images)
    assert x.shape == (45, 3, 32, 32) and x.dtype == torch.float32
    with pytest.raises(ValueError):
        to_float_images(images.astype(np.float32) / 255)  # float NHWC
    with pytest.raises(ValueError):
        to_float_images(x * 2 - 1)  # [-1, 1]
    with pytest.raises(ValueError):
        to_float_images(images[0])
    with pytest.raises(ValueError):
        ToyFeatureExtractor(_tiny_net())(torch.zeros(2, 3, 16, 16))


def test_augment_and_degrade(images):
    x = to_float_images(images)
    a1 = augment(x.clone(), torch.Generator().manual_seed(5))
    a2 = augment(x.clone(), torch.Generator().manual_seed(5))
    assert torch.equal(a1, a2) and a1.shape == x.shape and a1.min() >= 0 and a1.max() <= 1
    assert not torch.equal(a1, x)
    for kind in ("clean", "down2_up", "down4_up", "blur1_quant8"):
        d = degrade(x, kind)
        assert d.shape == x.shape and d.min() >= 0 and d.max() <= 1
    assert torch.equal(degrade(x, "clean"), x)
    with pytest.raises(ValueError):
        degrade(x, "jpeg")


# ---- toy_clip and aggregation --------------------------------------------------------------------
def test_toy_clip_on_hand_made_predictions():
    cap = {"shape": [0, 1, 2], "colour": [3, 3, 3], "background": [0, 1, 2], "position": [8, 0, 4], "size": [0, 1, 0]}
    pred = {"shape": [0, 1, 0], "colour": [3, 3, 2], "background": [0, 0, 0], "position": [8, 0, 0], "size": [0, 0, 1],
            "extra": [9, 9, 9]}
    s = toy_clip_scores(pred, cap)
    np.testing.assert_allclose(s, [1.0, 0.6, 0.0])
    assert toy_clip(pred, cap) == pytest.approx(1.6 / 3)
    assert toy_clip_scores(pred, {"shape": cap["shape"]}).tolist() == [1.0, 1.0, 0.0]
    with pytest.raises(KeyError):
        toy_clip_scores({"shape": [0, 1, 2]}, cap)
    with pytest.raises(ValueError):
        toy_clip_scores(pred, {"shape": [0, 1]})
    scenes = sample_scenes(6, seed=0)
    ca = caption_attributes(scenes)
    assert toy_clip(ca, ca) == 1.0
    assert all(ca[k][i] == scenes[i].labels()[k] for k in ATTRIBUTES for i in range(6))


def test_mean_ci_is_a_t_interval_and_bootstrap_is_seeded():
    x = np.random.default_rng(3).uniform(size=50)
    ci = mean_ci(x)
    lo, hi = stats.t.interval(0.95, 49, loc=x.mean(), scale=stats.sem(x))
    assert ci["mean"] == pytest.approx(x.mean()) and ci["lo"] == pytest.approx(lo) and ci["hi"] == pytest.approx(hi)
    assert mean_ci([0.5]) == {"mean": 0.5, "n": 1, "no_ci": "n=1: no CI"}  # no interval from one value
    r = np.random.default_rng(4)
    a, b = r.normal(size=(120, 6)), r.normal(size=(150, 6)) + 0.3
    b1 = toy_fid_ci(a, b, n_resamples=20, seed=7)
    b2 = toy_fid_ci(a, b, n_resamples=20, seed=7)
    assert b1 == b2 and b1["lo"] <= b1["fid"] <= b1["hi"] and b1["fid"] == pytest.approx(fid_from_features(a, b))
    assert b1["boot_lo"] <= b1["boot_hi"] and b1["hi"] - b1["lo"] == pytest.approx(b1["boot_hi"] - b1["boot_lo"])
    assert toy_fid_ci(a, b, n_resamples=20, seed=8)["lo"] != b1["lo"]
    assert toy_fid_ci(a, b, n_resamples=5, seed=7, resample_ref=True)["n_resamples"] == 5


def test_paired_fid_difference_and_paired_speedup():
    from coolsd.metrics import paired_fid_difference_ci
    from coolsd.util.stats import ratio_ci

    r = np.random.default_rng(5)
    ref = r.normal(size=(150, 6))
    a = ref + 0.3 * r.normal(size=(150, 6))
    same = paired_fid_difference_ci(a, a, ref, n_resamples=30, seed=1)
    assert same["diff"] == 0 and same["lo"] == 0 and same["hi"] == 0
    worse = a + 1.0  # a shifted mean: clearly higher FID, the interval excludes 0
    d = paired_fid_difference_ci(worse, a, ref, n_resamples=30, seed=1)
    assert d["diff"] == pytest.approx(fid_from_features(worse, ref) - fid_from_features(a, ref))
    assert 0 < d["lo"] <= d["hi"]
    assert d == paired_fid_difference_ci(worse, a, ref, n_resamples=30, seed=1)
    b = ref + 0.3 * r.normal(size=(150, 6))  # a's distribution, independent draw: within noise
    n = paired_fid_difference_ci(b, a, ref, n_resamples=100, seed=1)
    assert n["lo"] < 0 < n["hi"]
    with pytest.raises(ValueError, match="equal rows"):
        paired_fid_difference_ci(a[:10], a, ref)
    # paired speed-up: latencies that move together give a tighter interval than unpaired
    base = r.uniform(0.5, 2.0, size=60)
    num, den = 2 * base, base * r.uniform(0.95, 1.05, size=60)
    p, u = ratio_ci(num, den, paired=True), ratio_ci(num, den)
    assert p["ci95"][0] < p["mean"] < p["ci95"][1]
    assert p["ci95"][1] - p["ci95"][0] < (u["ci95"][1] - u["ci95"][0]) / 3


# ---- improved precision and recall -------------------------------------------------------------
def _col(*x):
    return np.array(x, dtype=np.float64)[:, None]  # 1-D points as (n, 1) features


def test_precision_recall_hand_computed_1d():
    # k = 1: ref radii 0->1, 1->1, 3->2: manifold [-1, 5]; gen radii -2.5, -2 -> 0.5, 4.5, 6 -> 1.5:
    # manifold [-3, -1.5] u [3, 7.5]
    in_ref, in_gen = precision_recall_indicators(_col(4.5, 6, -2, -2.5), _col(0, 1, 3), k=1)
    assert in_ref.tolist() == [True, False, False, False] and in_gen.tolist() == [False, False, True]
    assert precision_recall(_col(4.5, 6, -2, -2.5), _col(0, 1, 3), k=1) == (0.25, 1 / 3)
    # k = 3: ref radii 0->3, 1, 2, 3->2, 4->3, 20->18 (the outlier's ball is huge): manifold [-3, 38];
    # -3 sits exactly on 0's ball (closed balls), -3.5 just outside, 10 inside the outlier's ball
    ref = _col(0, 1, 2, 3, 4, 20)
    assert precision_recall_indicators(_col(-3, -3.5, 40, 10), ref)[0].tolist() == [True, False, False, True]
    # a tight generated cluster: radii 1.5, 1, 1, 1.5 -> manifold [8.5, 13]: inside ref, covers none of it
    assert precision_recall(_col(10, 10.5, 11, 11.5), ref) == (1.0, 0.0)
    with pytest.raises(ValueError, match="more than k rows"):
        precision_recall(_col(0, 1, 2), ref)  # 3 rows have no 3rd other neighbour
    with pytest.raises(ValueError, match="dims differ"):
        precision_recall(np.zeros((5, 2)), ref)


def test_duplicate_features_give_radius_zero_balls():
    far = np.array([5.0, 0.0])
    # >= k exact duplicates: radius 0, the ball holds only identical features (bit-exact distances)
    ref4 = np.array([[0.0, 0.0]] * 4 + [[10.0, 0.0]] * 4)
    gen = np.array([[0.0, 0.0], [1e-9, 0.0], [10.0, 0.0], far])
    assert precision_recall_indicators(gen, ref4)[0].tolist() == [True, False, True, False]
    # only k - 1 duplicates: the k-th neighbour is the other cluster, radius 10, covering `far`
    ref3 = np.array([[0.0, 0.0]] * 3 + [[10.0, 0.0]] * 3)
    assert precision_recall_indicators(gen, ref3)[0].tolist() == [True, True, True, True]
    # realistic features (|x| ~ 300): identical rows must be exactly 0 apart, not ~1e-5 as with
    # the |a|^2 + |b|^2 - 2ab expansion, or a feature 1e-6 away would land in a radius-0 ball
    x, y = np.random.default_rng(1).normal(0, 30, (2, 128))
    nudge = np.eye(128)[0] * 1e-6
    in_ref = precision_recall_indicators(np.stack([x, x + nudge, y, y]), np.repeat(np.stack([x, y]), 4, axis=0))[0]
    assert in_ref.tolist() == [True, False, True, True]
    # a generator that outputs one feature k + 1 times: its manifold is that point
    r = np.random.default_rng(0).normal(size=(20, 3))
    assert precision_recall(np.repeat(r[:1], 6, axis=0), r) == (1.0, 1 / 20)
    assert precision_recall(np.repeat(r[:1], 6, axis=0), np.repeat(r[:1], 4, axis=0)) == (1.0, 1.0)


def _two_modes(n, d=4, seed=0):
    r = np.random.default_rng(seed)
    return np.concatenate([r.normal(-5, 1, (n // 2, d)), r.normal(5, 1, (n - n // 2, d))])


def test_fidelity_and_diversity_losses_separate():
    ref = _two_modes(200)
    r = np.random.default_rng(1)
    assert precision_recall(ref, ref) == (1.0, 1.0)
    assert precision_recall(torch.from_numpy(ref), ref[::-1]) == (1.0, 1.0)  # order and type do not matter
    p, rc = precision_recall(_two_modes(200, seed=1), ref)
    assert p > 0.8 and rc > 0.8
    p, rc = precision_recall(r.normal(-5, 1, (200, 4)), ref)  # mode collapse: faithful, half the diversity
    assert p > 0.8 and 0.4 < rc < 0.55
    p, rc = precision_recall(r.normal(50, 1, (200, 4)), ref)  # off the manifold
    assert p == 0 and rc == 0


def test_precision_recall_bootstrap_intervals():
    ref = _two_modes(120)
    good = _two_modes(120, seed=2)
    collapsed = np.random.default_rng(3).normal(-5, 1, (120, 4))
    ci = bootstrap_precision_recall_ci(collapsed, ref, n_resamples=50, seed=4)
    assert ci == bootstrap_precision_recall_ci(collapsed, ref, n_resamples=50, seed=4)
    other_seed = bootstrap_precision_recall_ci(collapsed, ref, n_resamples=50, seed=5)
    assert ci["recall"]["ci95"] != other_seed["recall"]["ci95"]
    point = precision_recall(collapsed, ref)
    for j, name in enumerate(("precision", "recall")):
        c = ci[name]
        assert c["mean"] == point[j] and c["ci95"] == [c["lo"], c["hi"]] and c["lo"] <= c["mean"] <= c["hi"]
        assert 0 < c["hi"] - c["lo"] < 0.3 and c["n"] == 120 and c["k"] == 3 and c["n_resamples"] == 50
    assert ci["recall"]["hi"] < 0.6 < ci["precision"]["lo"]
    same = paired_precision_recall_difference_ci(good, good, ref, n_resamples=20)
    assert all(same[m]["mean"] == 0 and same[m]["ci95"] == [0, 0] for m in same)
    d = paired_precision_recall_difference_ci(collapsed, good, ref, n_resamples=50, seed=4)
    assert d["recall"]["mean"] == pytest.approx(point[1] - precision_recall(good, ref)[1])
    assert d["recall"]["hi"] < 0 and d["recall"]["lo"] <= d["recall"]["mean"] <= d["recall"]["hi"]
    assert d["precision"]["lo"] <= d["precision"]["mean"] <= d["precision"]["hi"]
    with pytest.raises(ValueError, match="equal shapes"):
        paired_precision_recall_difference_ci(good[:50], good, ref)
    # each resample draws prompts from default_rng(seed), rebuilds both manifolds from the distinct
    # drawn prompts and weights each prompt's indicators by its multiplicity
    rng, expect = np.random.default_rng(6), []
    for _ in range(3):
        rows, counts = np.unique(rng.integers(0, 40, 40), return_counts=True)
        expect.append([counts @ m / 40 for m in precision_recall_indicators(collapsed[rows], ref[rows])])
    boot = bootstrap_precision_recall_ci(collapsed[:40], ref[:40], n_resamples=3, seed=6)
    assert [boot[m]["boot_mean"] for m in ("precision", "recall")] == pytest.approx(np.mean(expect, 0), abs=1e-12)
    # 4 prompts: resamples with < 4 distinct prompts are redrawn, so every resample is a permutation
    tiny = bootstrap_precision_recall_ci(good[:4], ref[:4], n_resamples=5)
    assert all(tiny[m]["lo"] == tiny[m]["mean"] == tiny[m]["hi"] for m in tiny)


def test_toy_quality_reports_precision_recall_and_paired_differences(images):
    from coolsd.metrics.toy import toy_quality
    from coolsd.job.summary import _cell

    scenes = sample_scenes(45, seed=3)
    ext = ToyFeatureExtractor(_tiny_net(0))
    collapsed = np.repeat(images[:1], 45, axis=0)  # one image for every prompt
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no scipy "Matrix is singular" on the collapsed set's zero covariance
        q = toy_quality(ext, {"ar": images, "collapsed": collapsed}, scenes, n_resamples=20)
    ref = ext(images)
    ar, col = q["ar"], q["collapsed"]
    assert col["toy_fid"]["fid"] > ar["toy_fid"]["fid"]  # a collapsed generator is scored (badly), not refused
    assert ar["toy_precision"]["mean"] == ar["toy_recall"]["mean"] == 1.0
    assert ar["toy_recall_minus_ar"]["ci95"] == [0.0, 0.0]
    assert col["toy_precision"]["mean"] == 1.0  # the one image is a reference render
    assert col["toy_recall"]["mean"] == pytest.approx((ref == ref[0]).all(1).mean())
    assert col["toy_recall_minus_ar"]["mean"] == pytest.approx(col["toy_recall"]["mean"] - 1)
    assert col["toy_recall_minus_ar"]["ci95"][1] < 0
    # the same numbers as the stand-alone functions (same seed, same resamples)
    alone = bootstrap_precision_recall_ci(ext(collapsed), ref, n_resamples=20, seed=0)
    assert col["toy_recall"] == alone["recall"] and col["toy_precision"] == alone["precision"]
    diff = paired_precision_recall_difference_ci(ext(collapsed), ref, ref, n_resamples=20, seed=0)
    assert col["toy_recall_minus_ar"] == diff["recall"]
    c = col["toy_recall"]
    assert _cell(c, 3) == f"{c['mean']:.3f} [{c['lo']:.3f}, {c['hi']:.3f}]"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        few = toy_quality(ext, {"ar": images[:3]}, scenes[:3], n_resamples=5)["ar"]  # 3 < k + 1 prompts
    assert few["toy_fid"] is None and few["toy_fid_null_reason"].startswith("n=3 images")  # rank <= 2 < dims
    assert all(few[k] is None for k in ("toy_precision", "toy_recall", "toy_precision_minus_ar", "toy_recall_minus_ar"))


# ---- training determinism and persistence -------------------------------------------------------
def test_training_is_deterministic_given_seed():
    kw = dict(steps=3, batch_size=16, n_train=48, n_eval=16, log=None, config=TINY)
    m1, met1 = train_feature_net(seed=11, **kw)
    m2, met2 = train_feature_net(seed=11, **kw)
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert met1["heldout"] == met2["heldout"] and set(met1["heldout"]["clean"]) == {*ATTRIBUTES, "all"}
    assert not m1.training


def test_save_load_round_trip(tmp_path, images):
    net = _tiny_net(2)
    path = tmp_path / "sub" / "toy_feature_net.safetensors"
    save_feature_net(net, path, metrics={"heldout": {"clean": {"shape": 0.5}}})
    loaded = load_feature_net(path)
    assert not loaded.training and loaded.config == net.config
    a, b = net.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert np.array_equal(ToyFeatureExtractor(loaded)(images), ToyFeatureExtractor(net)(images))
    assert np.array_equal(ToyFeatureExtractor.from_file(path)(images[:3]), ToyFeatureExtractor(net)(images[:3]))
    meta = read_feature_net_metadata(path)
    assert meta["config"] == net.config and meta["metrics"]["heldout"]["clean"]["shape"] == 0.5


def test_missing_corrupted_and_mismatched_files(tmp_path):
    from safetensors.torch import save_file

    missing = tmp_path / "nope.safetensors"
    with pytest.raises(FileNotFoundError, match="nope.safetensors.*make toy-assets"):
        load_feature_net(missing)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="bad.safetensors.*make toy-assets"):
        load_feature_net(bad)
    good = tmp_path / "good.safetensors"
    save_feature_net(_tiny_net(), good)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated.safetensors.*make toy-assets"):
        load_feature_net(truncated)
    # strict: a state dict missing a key, or with an unexpected one, is refused
    state = {k: v.contiguous() for k, v in _tiny_net().state_dict().items()}
    meta = read_feature_net_metadata(good)
    raw = {"format": meta["format"], "version": meta["version"], "config": json.dumps(meta["config"])}
    partial = tmp_path / "partial.safetensors"
    save_file({k: v for k, v in state.items() if not k.startswith("heads.size")}, partial, metadata=raw)
    with pytest.raises(ValueError, match="partial.safetensors.*heads.size.*make toy-assets"):
        load_feature_net(partial)
    extra = tmp_path / "extra.safetensors"
    save_file({**state, "surplus": torch.zeros(2)}, extra, metadata=raw)
    with pytest.raises(ValueError, match="extra.safetensors.*surplus"):
        load_feature_net(extra)
    wrong_cfg = tmp_path / "wrong_cfg.safetensors"
    save_file(state, wrong_cfg, metadata={**raw, "config": '{"channels": [4, 8, 16], "feature_dim": 16, "image_size": 32}'})
    with pytest.raises(ValueError, match="wrong_cfg.safetensors"):
        load_feature_net(wrong_cfg)
    foreign = tmp_path / "foreign.safetensors"
    save_file(state, foreign)
    with pytest.raises(ValueError, match="not a toy feature network"):
        load_feature_net(foreign)
