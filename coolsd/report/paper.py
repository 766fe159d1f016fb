"""The COOL-SD paper's Table 2 (docs/methods.md#7-reference-numbers; A100 40GB), transcribed as data."""
from __future__ import annotations

# (target, method row label, our method spec, CLIP, FID, ImageReward, accepted length, latency s, speed-up)
TABLE2_COLUMNS = ("clip_score", "fid", "image_reward", "accepted_length", "latency_s", "speedup")
TABLE2 = [
    ("lumina_mgpt", "AR", ("ar", {}), 0.3330, 28.99, 0.6855, 1.00, 170.14, 1.00),
    ("lumina_mgpt", "Eagle-1", ("eagle", {}), 0.3330, 29.05, 0.6883, 2.76, 71.66, 2.37),
    ("lumina_mgpt", "LANTERN++ (lam=2, k=10)", ("lantern_pp", {"lam": 2.0, "k": 10}), 0.3328, 30.31, 0.6697, 2.99, 68.64, 2.48),
    ("lumina_mgpt", "COOL-SD delta=1.1", ("coolsd", {"delta": 1.1}), 0.3325, 30.30, 0.6699, 3.11, 63.24, 2.69),
    # not a row of the paper's Table 2: its text gives SJD on Lumina-mGPT about 2.06x (docs/methods.md#7-reference-numbers)
    ("lumina_mgpt", "SJD", ("sjd", {}), None, None, None, None, None, 2.06),
    ("llamagen_xl", "AR", ("ar", {}), None, None, None, 1.00, None, 1.00),
    ("llamagen_xl", "Eagle-1", ("eagle", {}), 0.3157, 20.97, -0.0859, 2.42, 4.99, 2.03),
    ("llamagen_xl", "LANTERN++ (lam=2, k=10)", ("lantern_pp", {"lam": 2.0, "k": 10}), 0.3157, 21.17, -0.1155, 2.67, 4.70, 2.15),
    ("llamagen_xl", "COOL-SD delta=1.1", ("coolsd", {"delta": 1.1}), 0.3167, 21.02, -0.0997, 2.73, 4.46, 2.27),
    ("llamagen_xl", "COOL-SD delta=2", ("coolsd", {"delta": 2.0}), 0.3154, 21.20, -0.1353, 3.34, 3.72, 2.72),
]


def table2_rows(target: str) -> list[dict]:
    """The paper's rows for a target (the toy world has none: its rows are LlamaGen's methods
    without reference numbers)."""
    src = "llamagen_xl" if target not in {t for t, *_ in TABLE2} else target
    rows = []
    for t, label, (method, params), *values in TABLE2:
        if t != src:
            continue
        paper = dict(zip(TABLE2_COLUMNS, values)) if t == target else {c: None for c in TABLE2_COLUMNS}
        rows.append({"label": label, "method": method, "params": params, "paper": paper})
    return rows


def tag_of(method: str, params: dict) -> str:
    return "_".join([method] + [f"{v:g}" if isinstance(v, float) else str(v) for v in params.values()])
