"""coolsd.models.xar against upstream xAR (github.com/OliverRensu/xAR at 121e9c9, ``models/xar.py``,
``models/rope.py``, ``models/sampler.py``). Proven:

* Upstream parity on ``tests/fixtures/upstream/xar.safetensors`` (made by ``tools/make_upstream_fixtures.py
  --xar`` with upstream's code; tiny random weights, fp32): the file's upstream state dict loads with
  ``load_xar`` (strict, upstream's buffers checked against ours); (a) our cache-free network equals
  upstream's ``forward_mae_encoder`` + ``forward_mae_decoder`` with ``self.mask`` (labels 3, 7, null;
  per-cell times); (b) our ``sample`` fed upstream's injected noise reproduces every raw velocity (both
  CFG halves, through our cache), every state and the final tokens of upstream's ``sample_tokens``
  (num_steps 4, cfg 3, cells guided 1, 5/3, 7/3, 3); upstream's mask and RoPE tables equal our
  recomputation. Tolerance: the fixture's (max abs 2e-5 at output scale ~5; measured: 0 for the
  velocities and tokens, 2e-7 for the states, which the file stores rounded to fp32).
* The cache: ``context`` (one multi-cell pass, or cell by cell) + ``velocity`` equals the cache-free
  block-causal ``forward`` on [clean earlier cells at t = 0 | x_t | anything later], for several geometries;
  ``velocity`` does not change the cache; later cells never change earlier outputs.
* The sampler's step: time grid, mean / std in closed form and as upstream writes it (score-based drift,
  CFG on the drift), the per-cell cfg schedule, the strict ``w > 1``, the integer timestep of the fp32 time,
  the null class; ``sample``'s noise enters as ``std * eps`` and the last step adds none.
* ``load_xar``: .pth (flat, or ``model_ema`` of a training checkpoint with its ``args``), .safetensors;
  a missing / unexpected key, a wrong shape, a missing or different upstream buffer: one line naming the
  file and the key.
* The released configs: parameter counts (172.6M, 608.4M, 1186.0M) and upstream's key counts (257, 497, 617).
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch
from factories import TINY_XAR, tiny_xar
from safetensors import safe_open
from safetensors.torch import save_file

from coolsd.models.xar import (
    NULL_LABEL,
    XAR,
    XAR_CONFIGS,
    XAR_SAMPLING,
    XARConfig,
    cell_order,
    cfg_schedule,
    from_cells,
    guide,
    load_xar,
    sample,
    time_grid,
    timestep,
    to_cells,
    transition,
    upstream_buffers,
    upstream_state_dict,
)
from coolsd.util.loading import BadInputFile

FIXTURE = Path(__file__).parents[1] / "fixtures" / "upstream" / "xar.safetensors"
MANIFEST = json.loads((FIXTURE.parent / "MANIFEST.json").read_text())


# ---------------------------------------------------------------- the upstream fixture
def read_fixture():
    """(upstream state dict with its buffers, inputs, outputs, config, tolerance). Weights stored as fp16
    are fp32 values; each RoPE buffer is stored once for the keys config["shared_buffers"] lists."""
    groups = {"w": {}, "in": {}, "out": {}}
    with safe_open(str(FIXTURE), framework="pt") as f:
        meta = f.metadata()
        for key in f.keys():
            prefix, rest = key.split(".", 1)
            groups[prefix][rest] = f.get_tensor(key)
    config = json.loads(meta["config"])
    w = {k: v.float() if v.dtype == torch.float16 else v for k, v in groups["w"].items()}
    for src, others in config["shared_buffers"].items():
        w.update({k: w[src].clone() for k in others})
    tol = float(meta["tolerance"])
    assert MANIFEST["files"][FIXTURE.name]["tolerance_max_abs"] == tol
    return w, groups["in"], groups["out"], config, tol


@pytest.fixture(scope="module")
def upstream():
    return read_fixture()


@pytest.fixture(scope="module")
def fixture_model(upstream, tmp_path_factory):
    """The fixture's weights loaded by ``load_xar`` from a .pth file in upstream's layout."""
    w, _, _, config, _ = upstream
    path = tmp_path_factory.mktemp("xar") / "xAR-tiny.pth"
    torch.save(w, path)
    return load_xar(path, XARConfig(**config["model"]))


def assert_close(ours, theirs, tol, what):
    """Max abs error within ``tol`` times the upstream output's scale (at least 1): fp32 rounding grows
    with the values, and another CPU's GEMM kernels round differently from the machine that made the
    fixture (velocities of scale 3.2: 0.0 on that Intel Xeon, 4.2e-5 on an AMD EPYC)."""
    err = (ours.double() - theirs.double()).abs().max().item()
    scale = theirs.abs().max().item()
    assert err <= tol * max(1.0, scale), f"{what}: max abs {err:.3g} > {tol:g} x scale {scale:.3g}"


def test_network_without_cache_matches_upstream(upstream, fixture_model):
    _, inp, out, _, tol = upstream
    with torch.no_grad():
        v = fixture_model(inp["seq"].float(), inp["t"], inp["labels"])
    assert_close(v, out["v_full"], tol, "cache-free velocities (labels 3, 7, null)")
    with torch.no_grad():  # NULL_LABEL is upstream's class 1000
        v_null = fixture_model(inp["seq"][2:].float(), inp["t"][2:], torch.tensor([NULL_LABEL]))
    assert_close(v_null, v[2:], tol, "NULL_LABEL row alone")  # a batch of 1: other matmul blocking, not bit for bit


def test_sampler_matches_upstream(upstream, fixture_model):
    _, inp, out, config, tol = upstream
    n_steps, cfg = config["sample"]["num_steps"], config["sample"]["cfg"]
    trace = []
    tokens = sample(fixture_model, inp["sample_labels"], n_steps, cfg, latents=inp["latents"].float(),
                    eps=inp["eps"].double(), trace=trace)
    n_cells, _, rows = out["v"].shape[:3]
    assert len(trace) == n_cells * n_steps
    v = torch.stack([r["v"] for r in trace]).reshape(out["v"].shape)
    for s in range(n_cells):
        assert_close(v[s], out["v"][s], tol, f"raw velocities of cell {s} (both CFG halves, via the cache)")
    states = torch.stack([r["x"] for r in trace]).reshape(n_cells, n_steps, rows // 2, *out["v"].shape[3:])
    assert_close(states[:, 1:], out["states"], tol, "states after each stochastic step")
    assert_close(tokens, out["tokens"], tol, "final tokens (B, C, H, W)")
    assert [round(cfg_schedule(cfg, s, n_cells), 6) for s in range(n_cells)] == [1.0, 1.666667, 2.333333, 3.0]


def test_upstream_buffers_equal_ours(upstream):
    """The file's mask and RoPE tables (upstream's own buffers) are what we recompute: the cell order of
    the tables, the row | column halves, the interleaved pairs, the block-causal mask."""
    w, _, _, config, _ = upstream
    ours = upstream_buffers(XARConfig(**config["model"]))
    assert sorted(ours) == sorted(k for k in w if k == "mask" or ".rope." in k)
    for k, v in ours.items():
        assert torch.equal(w[k], v), k  # bit for bit here (load_xar allows ROPE_ATOL across torch builds)


def test_cache_equals_cache_free_on_the_fixture_model(upstream, fixture_model):
    _, inp, _, _, tol = upstream
    m, c = fixture_model, fixture_model.config
    g = torch.Generator().manual_seed(5)
    clean, labels = inp["seq"][:2].float(), torch.tensor([3, NULL_LABEL])
    for s in range(c.n_cells):
        x = torch.randn(2, c.cell_len, c.token_dim, generator=g)
        t = torch.tensor([0.68, 0.04])
        seq = clean.clone()
        seq[:, s * c.cell_len:(s + 1) * c.cell_len] = x
        times = torch.zeros(2, c.n_cells)
        times[:, s] = t
        times[:, s + 1:] = 0.5
        with torch.no_grad():
            want = m(seq, times, labels)[:, s * c.cell_len:(s + 1) * c.cell_len]
            cache = m.context(clean[:, :s * c.cell_len], labels) if s else None
            got = m.velocity(cache, x, t, labels)
        assert_close(got, want, tol, f"cell {s}: cache vs cache-free")


# ---------------------------------------------------------------- cache vs cache-free, tiny models
@pytest.mark.parametrize("geometry", [dict(grid=4, cell=2), dict(grid=6, cell=2), dict(grid=6, cell=3)])
def test_context_and_velocity_equal_the_block_causal_forward(geometry):
    m = tiny_xar(seed=1, **geometry)
    c = m.config
    B, cl = 3, c.cell_len
    g = torch.Generator().manual_seed(2)
    labels = torch.tensor([1, 7, NULL_LABEL])
    clean = torch.randn(B, c.seq_len, c.token_dim, generator=g, dtype=torch.float64)
    incremental = None
    for s in range(c.n_cells):
        x = torch.randn(B, cl, c.token_dim, generator=g, dtype=torch.float64)
        t = torch.rand(B, generator=g, dtype=torch.float64)
        later = torch.randn(B, c.seq_len - (s + 1) * cl, c.token_dim, generator=g, dtype=torch.float64)
        times = torch.cat([torch.zeros(B, s, dtype=torch.float64), t[:, None],
                           torch.rand(B, c.n_cells - s - 1, generator=g, dtype=torch.float64)], 1)
        seq = torch.cat([clean[:, :s * cl], x, later], 1)
        with torch.no_grad():
            full = m(seq, times, labels)
            want = full[:, s * cl:(s + 1) * cl]
            one_pass = m.context(clean[:, :s * cl], labels) if s else None
            keys_before = [k.clone() for k in one_pass.keys] if s else []
            got = m.velocity(one_pass, x, t, labels)
            got_inc = m.velocity(incremental, x, t, labels)
            # block-causal: the later cells' values and times never reach cells <= s
            other = m(torch.cat([clean[:, :s * cl], x, later.flip(0) + 1], 1),
                      torch.cat([times[:, :s + 1], times[:, s + 1:].flip(0)], 1), labels)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        torch.testing.assert_close(got_inc, want, rtol=0, atol=1e-12)
        torch.testing.assert_close(other[:, :(s + 1) * cl], full[:, :(s + 1) * cl], rtol=0, atol=1e-12)
        if s:
            assert one_pass.n_cells == s and all(torch.equal(a, b) for a, b in zip(keys_before, one_pass.keys))
            for a, b in zip(one_pass.keys + one_pass.values, incremental.keys + incremental.values):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        with torch.no_grad():
            incremental = m.context(clean[:, s * cl:(s + 1) * cl], labels, incremental)


def test_the_cache_cells_are_checked():
    m = tiny_xar()
    c = m.config
    with torch.no_grad():
        cache = m.context(torch.zeros(2, 2 * c.cell_len, c.token_dim, dtype=torch.float64), torch.tensor([1, 2]))
        with pytest.raises(ValueError, match="cells 0..0 after a cache of 2 cells"):
            m._run(torch.zeros(2, c.cell_len, c.token_dim, dtype=torch.float64), torch.zeros(2, 1, c.dim,
                   dtype=torch.float64), 0, cache)
        with pytest.raises(ValueError, match="after a cache of 2 cells"):  # past the last cell
            m.context(torch.zeros(2, 3 * c.cell_len, c.token_dim, dtype=torch.float64), torch.tensor([1, 2]), cache)


# ---------------------------------------------------------------- geometry, labels, time
def test_cell_order_is_upstreams_clusterify():
    c = XARConfig(dim=32, encoder_depth=1, decoder_depth=1, heads=2)
    order = cell_order(c).reshape(4, 64)
    assert order[0, :10].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 16, 17]  # cell 0 = the top-left 8x8 quadrant
    assert order[1, 0] == 8 and order[2, 0] == 128 and order[3, 0] == 136 and order[3, -1] == 255
    s, j = torch.arange(4)[:, None], torch.arange(64)[None]
    assert torch.equal(order, (8 * (s // 2) + j // 8) * 16 + 8 * (s % 2) + j % 8)
    x = torch.randn(2, 16, 16, 16)
    cells = to_cells(x, c)
    assert torch.equal(from_cells(cells, c), x)
    # upstream clusterify (xar.py:320-328), written out: (B, C, 2, 8, 2, 8) -> (B, 2, 2, 8, 8, C)
    ref = torch.einsum("nchpwq->nhwpqc", x.reshape(2, 16, 2, 8, 2, 8)).reshape(2, 256, 16)
    assert torch.equal(cells, ref)


def test_timestep_is_the_floor_of_1000_t_in_fp32():
    assert timestep(torch.tensor([0., 0.04, 1.])).tolist() == [0, 40, 1000]
    grid = time_grid(4)
    assert float(grid[1]) == 0.6799999999999999 and int(float(grid[1]) * 1000) == 679  # fp64 would say 679
    assert timestep(grid[1]).item() == 680 == timestep(float(grid[1])).item()  # upstream feeds fp32 t: 680


def test_null_label_is_class_row_n_classes():
    m = tiny_xar()
    t = torch.tensor([0.5, 0.5])
    a = m.condition(torch.tensor([NULL_LABEL, 3]), t)
    b = m.condition(torch.tensor([TINY_XAR["n_classes"], 3]), t)
    assert torch.equal(a, b)
    assert not torch.allclose(a[0], m.condition(torch.tensor([0]), t[:1])[0])


# ---------------------------------------------------------------- the sampler's step
def test_time_grid_and_cfg_schedule():
    grid = time_grid(40)
    assert grid.dtype == torch.float64 and len(grid) == 41 and grid[0] == 1 and grid[-1] == 0
    assert torch.equal(grid[:-1], torch.linspace(1, 0.04, 40, dtype=torch.float64))
    assert math.isclose(float(grid[1] - grid[0]), -0.96 / 39, rel_tol=1e-12)
    for n in (0, 1):
        with pytest.raises(ValueError, match="num_steps"):
            time_grid(n)
    assert [round(cfg_schedule(2.7, s, 4), 3) for s in range(4)] == [1.0, 1.567, 2.133, 2.7]  # xAR-B
    assert cfg_schedule(2.2, 3, 4) == XAR_SAMPLING["xar_huge"]["cfg"]
    assert cfg_schedule(3.0, 0, 1) == 3.0
    vc, vn = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    assert guide(vc, vn, 1.0) is vc and guide(vc, vn, 0.5) is vc  # the strict w > 1 (sampler.py:159)
    torch.testing.assert_close(guide(vc, vn, 2.5), vn + 2.5 * (vc - vn), rtol=0, atol=0)


@pytest.mark.parametrize("i", [0, 17, 38, 39])
def test_transition_is_the_euler_maruyama_step(i):
    """Mean and std in closed form, and as upstream writes the step: score of the linear path, drift
    v - g^2/2 score with g^2 = 2t, CFG on the drifts of the two halves (sampler.py:15-43, 137-163, 201-216)."""
    N = 40
    grid = time_grid(N)
    t, dt = float(grid[i]), float(grid[i + 1] - grid[i])
    last = i == N - 1
    g = torch.Generator().manual_seed(i)
    x, vc, vn = (torch.randn(2, 64, 16, generator=g, dtype=torch.float64) for _ in range(3))
    w = 2.2
    mean, std = transition(x, guide(vc, vn, w), t, dt, last)
    closed = (1 - abs(dt)) * x - abs(dt) * (2 - t) * (vn + w * (vc - vn))
    torch.testing.assert_close(mean, closed, rtol=1e-13, atol=1e-13)
    assert std == (0. if last else math.sqrt(2 * t * abs(dt)))
    if not last:
        assert math.isclose(std, math.sqrt(2 * t * 0.96 / 39), rel_tol=1e-12)
    else:
        assert math.isclose(dt, -0.04, rel_tol=1e-12)

    def drift(v):  # upstream, literally
        score = ((t - 1) * v - x) / t
        return v - 0.5 * (2 * t) * score
    d = drift(vn) + w * (drift(vc) - drift(vn))
    torch.testing.assert_close(mean, x + d * dt, rtol=1e-12, atol=1e-12)


def test_sample_adds_std_times_eps_and_nothing_at_the_last_step():
    m = tiny_xar(seed=3)
    c = m.config
    N, B = 3, 2
    g = torch.Generator().manual_seed(4)
    latents = torch.randn(c.n_cells, B, c.cell_len, c.token_dim, generator=g)
    eps = torch.randn(c.n_cells, N - 1, B, c.cell_len, c.token_dim, generator=g, dtype=torch.float64)
    trace = []
    tokens = sample(m, torch.tensor([1, 2]), N, cfg=2.0, latents=latents, eps=eps, trace=trace)
    grid = time_grid(N)
    for k, r in enumerate(trace):
        s, i = r["cell"], r["step"]
        nxt = trace[k + 1]["x"] if i < N - 1 else to_cells(tokens, c)[:, s * c.cell_len:(s + 1) * c.cell_len].double()
        if i < N - 1:
            assert r["std"] == math.sqrt(2 * float(grid[i]) * abs(float(grid[i + 1] - grid[i])))
            torch.testing.assert_close(nxt, r["mean"] + r["std"] * eps[s, i], rtol=0, atol=1e-12)
        else:
            assert r["std"] == 0.
            torch.testing.assert_close(nxt, r["mean"].float().double(), rtol=0, atol=0)
        assert r["v"].shape[0] == 2 * B  # cfg > 1: both halves run
    # unguided: one half only, and the same labelled rows' chain as cfg 1 would give
    trace1 = []
    sample(m, torch.tensor([1, 2]), N, cfg=1.0, latents=latents, eps=eps, trace=trace1)
    assert trace1[0]["v"].shape[0] == B
    torch.testing.assert_close(trace1[0]["v"], trace[0]["v"][:B], rtol=0, atol=1e-12)  # cell 0 is unguided


# ---------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def tiny_cfg():
    return XARConfig(**TINY_XAR)


@pytest.fixture(scope="module")
def official(tiny_cfg):
    return upstream_state_dict(tiny_xar(seed=6, dtype=torch.float32))


def test_load_xar_formats(tmp_path, tiny_cfg, official):
    ref = tiny_xar(seed=6, dtype=torch.float32)
    torch.save(official, tmp_path / "flat.pth")
    other = {k: v + 1 if v.is_floating_point() and k in ref.state_dict() else v for k, v in official.items()}
    torch.save({"model": other, "model_ema": official, "epoch": 3, "args": argparse.Namespace(model="xar_base")},
               tmp_path / "checkpoint-last.pth")
    save_file({k: v.contiguous() for k, v in official.items()}, str(tmp_path / "x.safetensors"))
    for name in ("flat.pth", "checkpoint-last.pth", "x.safetensors"):
        m = load_xar(tmp_path / name, tiny_cfg, dtype=torch.float64)
        assert m.pred.weight.dtype == torch.float64 and not m.training and not m.pred.weight.requires_grad
        for k, v in ref.state_dict().items():
            assert torch.equal(m.state_dict()[k], v.double()), (name, k)
        x = torch.randn(1, tiny_cfg.seq_len, tiny_cfg.token_dim, dtype=torch.float64)
        torch.testing.assert_close(m(x, torch.full((1, tiny_cfg.n_cells), 0.3), torch.tensor([2])),
                                   ref.double()(x, torch.full((1, tiny_cfg.n_cells), 0.3), torch.tensor([2])))


def one_line_error(path, cfg) -> str:
    with pytest.raises(BadInputFile) as e:
        load_xar(path, cfg)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and "OliverRen/xAR" in msg, msg
    return msg


@pytest.mark.parametrize("case, expect", [
    ("missing", r"missing keys: decoder_blocks\.1\.mlp\.fc2\.weight"),
    ("unexpected", r"unexpected keys: fake_latent"),
    ("shape", r"wrong shapes: class_emb\.weight \(10, 32\) \(expected \(11, 32\)\)"),
    ("missing_buffer", r"missing keys: encoder_blocks\.1\.attn\.rope\.freqs_sin"),
    ("buffer_shape", r"wrong shapes: mask \(1, 1, 8, 8\) \(expected \(1, 1, 16, 16\)\)"),
    ("raster_rope", r"values differ .*: decoder_blocks\.0\.attn\.rope\.freqs_cos"),
    ("causal_mask", r"values differ .*: mask"),
])
def test_bad_checkpoints_are_one_line_errors_naming_the_key(tmp_path, tiny_cfg, official, case, expect):
    import re

    sd = dict(official)
    if case == "missing":
        del sd["decoder_blocks.1.mlp.fc2.weight"]
    elif case == "unexpected":
        sd["fake_latent"] = torch.zeros(1, 32)
    elif case == "shape":
        sd["class_emb.weight"] = sd["class_emb.weight"][:10]
    elif case == "missing_buffer":
        del sd["encoder_blocks.1.attn.rope.freqs_sin"]
    elif case == "buffer_shape":
        sd["mask"] = sd["mask"][..., :8, :8]
    elif case == "raster_rope":  # the table in raster order, not cell order
        inverse = torch.empty_like(cell_order(tiny_cfg))
        inverse[cell_order(tiny_cfg)] = torch.arange(tiny_cfg.seq_len)
        sd["decoder_blocks.0.attn.rope.freqs_cos"] = sd["decoder_blocks.0.attn.rope.freqs_cos"][inverse]
    elif case == "causal_mask":  # token-causal instead of block-causal
        sd["mask"] = torch.triu(torch.full((16, 16), float("-inf")), 1)[None, None]
    path = tmp_path / f"{case}.pth"
    torch.save(sd, path)
    assert re.search(expect, one_line_error(path, tiny_cfg))


def test_a_missing_file_says_where_to_get_it(tmp_path, tiny_cfg):
    with pytest.raises(FileNotFoundError, match="OliverRen/xAR"):
        load_xar(tmp_path / "xAR-B.pth", tiny_cfg)


# ---------------------------------------------------------------- the released configs
@pytest.mark.parametrize("name, params, keys, buffers", [
    ("xar_base", 172_638_224, 257, 49), ("xar_large", 608_397_968, 497, 97), ("xar_huge", 1_186_024_096, 617, 121)])
def test_released_configs(name, params, keys, buffers):
    cfg = XAR_CONFIGS[name]
    with torch.device("meta"):
        m = XAR(cfg)
    assert sum(p.numel() for p in m.parameters()) == params  # the paper's 172M ... 1.1B
    assert len(m.state_dict()) + len(upstream_buffers(cfg)) == keys and len(upstream_buffers(cfg)) == buffers
    assert (cfg.n_cells, cfg.cell_len, cfg.mlp_hidden) == (4, 64, {768: 2048, 1024: 2730, 1280: 3413}[cfg.dim])
    assert m.class_emb.weight.shape[0] == 1001 and m.pred.weight.shape == (16, cfg.dim)
