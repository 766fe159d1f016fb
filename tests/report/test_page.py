"""The comparison page (coolsd.report.page): its inputs (run folders, a sweep's folder), and the
page itself in a real headless browser (Debian's chromium and chromedriver; the browser test skips,
with its reason, only where they are absent)."""
import json
import re
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from selenium.webdriver.common.by import By

from coolsd.report.page import build_page, chromium, headless_browser, load_runs, main, screenshot, write_page

ROOT = Path(__file__).resolve().parents[2]
# the three-method sweep the README's page command reads (results/toy/sweep_page.png is its page)
COMMITTED_SWEEP = ROOT / "results" / "toy" / "sweep"

# tag -> (mean accepted length, step TV per token): the table's order under a sort is known
METHODS = {"ar": (1.0, 0.0), "eagle": (2.0, 0.0), "coolsd_2": (3.0, 0.2), "uniform_rsd_2": (2.5, 0.3)}
PROMPTS = ["a red circle", "a blue square", "a green triangle"]
# tag -> its label on the page: the method's name (write_run's records name no other parameter)
LABELS = {t: t.split("_")[0] for t in METHODS}


def write_run(folder: Path, summary: bool = False) -> Path:
    """A run folder as the generation job writes it: samples.jsonl (one record per method and
    prompt, 4 x 4 token grid), images/<tag>/<index>.png, run.json, and with ``summary`` its
    summary.json."""
    rng = np.random.default_rng(0)
    lines = []
    for i, caption in enumerate(PROMPTS):
        for k, (tag, (acc, tv)) in enumerate(METHODS.items()):
            img = folder / "images" / tag / f"{i:05d}.png"
            img.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(img)
            token_tv = (tv * rng.random(16)).round(4).tolist()
            lines.append({"prompt_index": i, "caption": caption, "seed": 100 + i, "method": tag,
                          "params": {"method": tag.split("_")[0]}, "accepted_length": acc + 0.1 * i,
                          "latency_s": 1.0 / acc + 0.01 * i, "step_tv": float(sum(token_tv)),
                          "token_tv": token_tv, "token_depth": [0] * 16, "image": f"images/{tag}/{i:05d}.png"})
    (folder / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (folder / "run.json").write_text(json.dumps({"target": "toy"}))
    if summary:
        results = {t: {"params": {"method": t}, "accepted_length": {"mean": a, "ci95": [a - 0.1, a + 0.1]},
                       "toy_fid": {"fid": 10.0 * a, "lo": 9.0 * a, "hi": 11.0 * a}} for t, (a, _) in METHODS.items()}
        (folder / "summary.json").write_text(json.dumps({"target": "toy", "results": results}))
    return folder


def test_a_run_folder_without_summary_gets_its_table_from_the_records(tmp_path):
    run, = load_runs([write_run(tmp_path / "run")])
    assert list(run.table) == list(METHODS)
    e = run.table["coolsd_2"]
    assert e["accepted_length"]["mean"] == pytest.approx(3.1) and e["speedup"]["mean"] > 2.5
    assert "prompt_index" not in e and "seed" not in e and run.table["ar"]["speedup"]["mean"] == pytest.approx(1.0)


def test_a_sweep_folder_names_its_run_folder_and_brings_its_table(tmp_path):
    rec = write_run(tmp_path / "rec")
    out = tmp_path / "sweep"
    out.mkdir()
    table = {t: {"params": {"method": t}, "toy_fid": {"fid": 1.0, "lo": 0.5, "hi": 1.5}} for t in METHODS}
    (out / "summary.json").write_text(json.dumps({"env": {"records": str(rec)}, "results": table}))
    run, = load_runs([out])
    assert run.folder == rec and run.table == table and len(run.records) == len(METHODS) * len(PROMPTS)
    (out / "summary.json").write_text(json.dumps({"env": {"records": str(tmp_path / "gone")}, "results": table}))
    with pytest.raises(FileNotFoundError, match="gone.*rerun the sweep"):
        load_runs([out])
    (out / "summary.json").write_text(json.dumps({"results": table}))
    with pytest.raises(FileNotFoundError, match="no run folder"):
        load_runs([out])  # a summary without env.records, no samples.jsonl below


def test_two_runs_with_the_same_tags_are_told_apart_and_images_can_be_linked(tmp_path):
    """Runs that ran the same configurations alike: the AR baselines are one, the others are told
    apart by their run folder (nothing else differs)."""
    from coolsd.report.page import configurations  # deferred: new with the labels by varying keys

    runs = load_runs([write_run(tmp_path / "a"), write_run(tmp_path / "b", summary=True)])
    names = {(c.run.folder.name, c.tag): c.label for c in configurations(runs)}
    assert names[("b", "eagle")] == "eagle @ b" and names[("a", "ar")] == "ar" and ("b", "ar") not in names
    same_name = load_runs([write_run(tmp_path / "x" / "t"), write_run(tmp_path / "y" / "t")])
    assert [c.label for c in configurations(same_name) if c.tag == "eagle"] == ["eagle @ x/t", "eagle @ y/t"]
    page = build_page(runs, tmp_path / "page.html", embed=False)
    assert page.count('<img class="sample"') == (2 * len(METHODS) - 1) * len(PROMPTS)
    assert 'src="a/images/eagle/00000.png"' in page and 'src="b/images/eagle/00000.png"' in page
    assert 'data-key="toy_fid"' in page  # the summary's quality metric has a column


def write_job(folder: Path, method: str, params: dict, *, seed: int = 0, set_keys=("method",)) -> Path:
    """One job folder of a Hydra multirun as run.py writes it: AR and ``method`` (its resolved
    parameters ``params``) on PROMPTS, run.json, .hydra/config.yaml and .hydra/overrides.yaml."""
    rng = np.random.default_rng(seed)
    lines = []
    for tag, p in (("ar", {"method": "ar", "drafter": "none", "tree": "none"}), (method, {"method": method, **params})):
        for i, caption in enumerate(PROMPTS):
            img = folder / "images" / tag / f"{i:05d}.png"
            img.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(img)
            acc = 1.0 if tag == "ar" else 2.0 + float(params.get("delta", 1.0))
            lines.append({"prompt_index": i, "caption": caption, "seed": 1000 * seed + i, "method": tag, "params": p,
                          "accepted_length": acc, "latency_s": 1.0 / acc, "step_tv": 0.0 if tag == "ar" else acc,
                          "image": f"images/{tag}/{i:05d}.png"})
    (folder / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (folder / "run.json").write_text(json.dumps({"target": "toy", "settings": {"cfg_scale": 3.0}, "seed": seed,
                                                 "methods": {"ar": lines[0]["params"], method: lines[-1]["params"]},
                                                 "dataset": {"name": "toy", "n_prompts": len(PROMPTS)}}))
    (folder / ".hydra").mkdir()
    (folder / ".hydra" / "config.yaml").write_text(
        f"target:\n  name: toy\nmethod:\n  name: {method}\nseed: {seed}\ntree:\n  name: chain\n")
    values = {"method": f"method={method}", "seed": f"seed={seed}",
              **{f"method.{k}": f"method.{k}={v}" for k, v in params.items()}}
    (folder / ".hydra" / "overrides.yaml").write_text("".join(f"- {values[k]}\n" for k in set_keys))
    return folder


def page_labels(page: str) -> tuple[list[str], list[str]]:
    """(the table's method cells, the first prompt's card labels) of a page's HTML."""
    rows = re.findall(r'<tr data-method="([^"]*)">', page)
    first = page.split('<section class="prompt"')[1]
    return rows, re.findall(r'<div class="lbl"[^>]*>([^<]*)</div>', first)


def test_a_sweeps_configurations_are_labelled_by_the_keys_that_vary_and_ar_shows_once(tmp_path):
    """``method=coolsd method.delta=1.1,2``: each job ran AR on the same prompts, target and seed;
    the page names the two by their delta (not by their folder) and shows AR once. ARs that ran
    with another seed stay apart, each named by its seed."""
    sweep = tmp_path / "multirun"
    for delta in (1.1, 2.0):
        write_job(sweep / f"coolsd_method.delta={delta},method=coolsd", "coolsd",
                  {"delta": delta, "schedule": "exp", "tree": "chain4"}, set_keys=("method", "method.delta"))
    page = build_page(load_runs([sweep]), tmp_path / "page.html")
    rows, cards = page_labels(page)
    assert rows == cards == ["ar", "coolsd delta=1.1", "coolsd delta=2"]
    assert page.count('<div class="card" data-method="ar"') == len(PROMPTS)  # one AR image a prompt

    write_job(tmp_path / "seed1" / "coolsd_seed=1", "coolsd", {"delta": 2.0, "schedule": "exp", "tree": "chain4"},
              seed=1, set_keys=("method", "seed"))
    rows, cards = page_labels(build_page(load_runs([sweep, tmp_path / "seed1"]), tmp_path / "page.html"))
    assert rows == cards == ["ar seed=0", "coolsd delta=1.1", "coolsd delta=2 seed=0", "ar seed=1",
                             "coolsd delta=2 seed=1"]


def test_a_three_method_sweep_is_labelled_by_method(tmp_path):
    sweep = tmp_path / "multirun"
    for method, params in (("coolsd", {"delta": 2.0}), ("lantern_pp", {"lam": 2.0, "k": 10}), ("sjd", {"window": 16})):
        write_job(sweep / f"{method}_method={method}", method, params)
    rows, cards = page_labels(build_page(load_runs([sweep]), tmp_path / "page.html"))
    assert rows == cards == ["ar", "coolsd", "lantern_pp", "sjd"]


def captured_figures(monkeypatch) -> list:
    """The matplotlib figures saved from now on (``Figure.savefig`` recorded, then run as usual)."""
    import matplotlib.figure

    saved, savefig = [], matplotlib.figure.Figure.savefig

    def record(fig, *args, **kwargs):
        saved.append(fig)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    return saved


@pytest.mark.parametrize("long_labels", [False, True])
def test_pareto_labels_stay_inside_their_plot_and_apart(tmp_path, monkeypatch, long_labels):
    """The toy demo's ten configurations (committed summary: clusters of close points), with their
    tags or with long labels: every point's label lies inside its axes, no two overlap (text
    extents as matplotlib draws them), and the axes keep their width."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    from coolsd.report.plots import pareto_plot
    from coolsd.report.sweep import sweep_frame

    df = sweep_frame(json.loads((ROOT / "results" / "toy" / "summary.json").read_text())["results"])
    if long_labels:
        df["tag"] = [f"{t} @ {t}_dataset.n_prompts=120,method={t}" for t in df["tag"]]
    figures = captured_figures(monkeypatch)
    pareto_plot(df, tmp_path / "pareto.png", ["toy_fid", "toy_clip", "step_tv"], "crowded")
    fig = figures[0]
    FigureCanvasAgg(fig).draw()  # closed after saving: drawn again, as saved
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        frame = ax.get_window_extent(renderer)
        labels = ax.texts  # every text inside the axes is a point's label
        assert len(labels) == len(df)
        boxes = [Text.get_window_extent(t, renderer) for t in labels]  # the text, not its leader line
        outside = [t.get_text() for t, b in zip(labels, boxes)
                   if b.x0 < frame.x0 or b.x1 > frame.x1 or b.y0 < frame.y0 or b.y1 > frame.y1]
        assert outside == []
        overlapping = [(a.get_text(), b.get_text()) for (a, ba), (b, bb) in combinations(zip(labels, boxes), 2)
                       if ba.overlaps(bb)]
        assert overlapping == []
        assert frame.width >= 0.35 * fig.bbox.width  # two plots a row: no label squeezes its axes


def test_the_sweep_grid_has_each_configuration_over_its_column_and_each_prompt_by_its_row(tmp_path):
    from coolsd.util.image_grid import CAPTION_CHARS, captioned_grid  # deferred: new with the grid's captions

    sweep = tmp_path / "multirun"
    for method in ("coolsd", "sjd"):
        write_job(sweep / f"{method}_method={method}", method, {})
    grid = tmp_path / "grid.png"
    main([str(sweep), "-o", str(tmp_path / "page.html"), "--grid", str(grid)])
    assert Image.open(grid).size[0] > 3 * 96  # three columns of images beside the prompts

    long = "a very long prompt " * 10
    columns, rows = ["ar", "coolsd delta=1.1", "sjd"], ["#0 " + long, "#1 a blue square"]
    images = [[np.zeros((8, 8, 3), np.uint8)] * 3, [np.full((8, 8, 3), 200, np.uint8), None, None]]
    img, captions = captioned_grid(columns, rows, images, cell=96)
    assert [t for t, _ in captions] == columns + rows
    boxes = [b for _, b in captions]
    for (text, (x0, y0, x1, y1)) in captions:  # each caption inked inside the image
        assert 0 <= x0 < x1 <= img.shape[1] and 0 <= y0 < y1 <= img.shape[0]
        assert (img[y0:y1, x0:x1] < 128).any(), text
    heads, sides = boxes[:3], boxes[3:]
    assert [b[0] for b in heads] == sorted(b[0] for b in heads) and max(b[3] for b in heads) < min(b[1] for b in sides)
    assert sides[0][3] < sides[1][1] and max(b[2] for b in sides) < min(b[0] for b in heads)
    assert (sides[0][3] - sides[0][1]) < 4 * 16  # the long prompt is cut (at CAPTION_CHARS), not a column of text
    assert len(long) > CAPTION_CHARS


def test_the_readme_page_command_reads_the_committed_sweep(tmp_path):
    """``python -m coolsd.report.page results/toy/sweep`` (README): the committed sweep holds every
    file the page reads, with no path outside itself; its page names the three methods, AR once."""
    for f in COMMITTED_SWEEP.rglob("*"):
        if f.suffix in (".json", ".jsonl", ".yaml"):
            assert "/tmp/" not in f.read_text() and str(ROOT) not in f.read_text(), f
    page = tmp_path / "page.html"
    proc = subprocess.run([sys.executable, "-m", "coolsd.report.page", "results/toy/sweep", "-o", str(page)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows, cards = page_labels(page.read_text())
    assert rows == cards == ["ar", "coolsd", "lantern_pp", "sjd"]


def test_a_page_of_no_runs_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for folder in (tmp_path / "empty", tmp_path / "gone"):
        with pytest.raises(SystemExit) as e:
            main([str(folder), "-o", str(tmp_path / "p.html")])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and str(folder) in err and "\n" not in err and "Traceback" not in err


def test_the_table_shows_both_speedups_labelled_apart(tmp_path):
    """A run that timed compiled AR beside itself (``ar_compiled``, faster here): the table's speed-up
    against same-mode AR stays against ``ar``; the one against the fastest AR is against ``ar_compiled``."""
    folder = write_run(tmp_path / "run")
    recs = [json.loads(x) for x in (folder / "samples.jsonl").read_text().splitlines()]
    fast = [{**r, "method": "ar_compiled", "params": {"method": "ar", "compiled": True}, "latency_s": r["latency_s"] / 3}
            for r in recs if r["method"] == "ar"]
    with open(folder / "samples.jsonl", "a") as f:
        f.writelines(json.dumps({k: v for k, v in r.items() if k != "image"}) + "\n" for r in fast)
    run, = load_runs([folder])
    lat = {t: [r["latency_s"] for r in recs + fast if r["method"] == t] for t in ("ar", "ar_compiled", "eagle")}
    e = run.table["eagle"]
    assert e["speedup"]["mean"] == pytest.approx(sum(lat["ar"]) / sum(lat["eagle"]))
    assert e["speedup_vs_fastest_ar"]["mean"] == pytest.approx(sum(lat["ar_compiled"]) / sum(lat["eagle"]))
    assert e["fastest_ar"] == "ar_compiled"
    page = build_page([run], tmp_path / "page.html")
    assert '<th data-key="speedup" data-type="num" title="speedup">speed-up (same-mode AR)</th>' in page
    assert ('<th data-key="speedup_vs_fastest_ar" data-type="num" title="speedup_vs_fastest_ar">'
            'speed-up (fastest AR)</th>') in page
    assert "timed on the same prompts (here: ar compiled=True)" in page  # its label: what sets it apart


@pytest.fixture
def browser():
    if chromium() is None:
        pytest.skip("no chromium and chromedriver on PATH (Debian: apt-get install chromium chromium-driver; "
                    ".ci/run installs them where it is root)")
    driver = headless_browser()
    yield driver
    driver.quit()


def test_the_page_in_a_headless_browser(tmp_path, browser):
    """The page loads with no console error and no request outside itself, holds one image per
    (method, prompt), sorts its table by a clicked column, hides what the filters exclude, and
    can be screenshotted."""
    page = tmp_path / "page.html"
    main([str(write_run(tmp_path / "run")), "-o", str(page), "--title", "test page"])
    text = page.read_text()
    srcs = re.findall(r'src="([^"]*)"', text)
    assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs)  # self-contained
    assert not re.search(r"<link|<script[^>]+src=|https?://", text)  # nothing fetched from anywhere

    browser.get(page.as_uri())
    assert browser.title == "test page"
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == [], errors

    cards = browser.find_elements(By.CSS_SELECTOR, ".card")
    pairs = sorted((c.get_attribute("data-method"), c.get_attribute("data-prompt")) for c in cards)
    assert pairs == sorted((LABELS[m], str(i)) for m in METHODS for i in range(len(PROMPTS)))
    for c in cards:  # each card: one image, loaded (a broken data URI has no natural size), and its map
        img, = c.find_elements(By.CSS_SELECTOR, "img.sample")
        assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img) == 8
        assert len(c.find_elements(By.CSS_SELECTOR, "img.dmap")) == 1
    assert len(browser.find_elements(By.CSS_SELECTOR, "img.sample")) == len(METHODS) * len(PROMPTS)

    def order():
        return [r.get_attribute("data-method") for r in browser.find_elements(By.CSS_SELECTOR, "#methods tbody tr")]

    heads = {h.get_attribute("data-key"): h.get_attribute("textContent")
             for h in browser.find_elements(By.CSS_SELECTOR, "#methods th")}
    assert heads["speedup"] == "speed-up (same-mode AR)" and heads["speedup_vs_fastest_ar"] == "speed-up (fastest AR)"

    by_acc = [LABELS[t] for t in sorted(METHODS, key=lambda t: METHODS[t][0])]
    assert order() == [LABELS[t] for t in METHODS]
    header = browser.find_element(By.CSS_SELECTOR, '#methods th[data-key="accepted_length"]')
    header.click()
    assert order() == by_acc and header.get_attribute("aria-sort") == "ascending"
    header.click()
    assert order() == by_acc[::-1] and header.get_attribute("aria-sort") == "descending"
    browser.find_element(By.CSS_SELECTOR, '#methods th[data-key="method"]').click()
    assert order() == sorted(LABELS.values())

    browser.find_element(By.CSS_SELECTOR, '#method-filter input[value="eagle"]').click()
    row = browser.find_element(By.CSS_SELECTOR, '#methods tr[data-method="eagle"]')
    assert not row.is_displayed()
    assert not any(c.is_displayed() for c in browser.find_elements(By.CSS_SELECTOR, '.card[data-method="eagle"]'))
    assert all(c.is_displayed() for c in browser.find_elements(By.CSS_SELECTOR, '.card[data-method="ar"]'))
    browser.find_element(By.ID, "prompt-filter").send_keys("blue")
    shown = [s.get_attribute("data-prompt") for s in browser.find_elements(By.CSS_SELECTOR, "section.prompt")
             if s.is_displayed()]
    assert shown == ["1"] and browser.find_element(By.ID, "shown").text == "1"

    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
    shot = screenshot(page, tmp_path / "page.png", width=800, height=600)  # as the committed one is made
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and Image.open(shot).size == (800, 600)


def test_write_page_is_atomic_and_reports_missing_runs(tmp_path):
    with pytest.raises(FileNotFoundError, match="no run folder"):
        write_page([tmp_path], tmp_path / "p.html")
    assert not (tmp_path / "p.html").exists()


@pytest.fixture(scope="module")
def three_method_sweep(tmp_path_factory) -> Path:
    """A real multirun, ``run.py -m method=coolsd,lantern_pp,sjd`` on one toy prompt: three jobs,
    each with its own AR on that prompt."""
    sweep = tmp_path_factory.mktemp("sweep") / "multirun"
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), "-m", "method=coolsd,lantern_pp,sjd",
                           "dataset.n_prompts=1", f"hydra.sweep.dir={sweep}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return sweep


def test_a_three_method_sweeps_page_in_a_headless_browser(tmp_path, browser, three_method_sweep):
    """The page of a real three-method sweep as a browser shows it: each configuration's label is its
    method's name, shown whole (not cut by its card) in the table, the filters and over its image;
    AR is one row and one image a prompt; the Pareto plots are shown at their own width."""
    page = tmp_path / "page.html"
    main([str(three_method_sweep), "-o", str(page)])
    browser.get(page.as_uri())
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
    expected = ["ar", "coolsd", "lantern_pp", "sjd"]
    rows = [r.find_element(By.CSS_SELECTOR, "td").text for r in browser.find_elements(By.CSS_SELECTOR, "#methods tbody tr")]
    assert rows == expected
    boxes = [b.get_attribute("value") for b in browser.find_elements(By.CSS_SELECTOR, "#method-filter input")]
    assert boxes == expected
    section, = browser.find_elements(By.CSS_SELECTOR, "section.prompt")
    labels = section.find_elements(By.CSS_SELECTOR, ".card .lbl")
    assert [lbl.text for lbl in labels] == expected  # the text as rendered: whole, one card each
    for lbl in labels:  # nothing of a label hidden by its card
        assert browser.execute_script("return arguments[0].scrollWidth <= arguments[0].clientWidth", lbl), lbl.text
    assert len(section.find_elements(By.CSS_SELECTOR, '.card[data-method="ar"] img.sample')) == 1
    pareto = browser.find_element(By.ID, "pareto")
    natural, shown = browser.execute_script("return [arguments[0].naturalWidth, arguments[0].clientWidth]", pareto)
    assert shown >= 0.9 * natural and shown >= 1000  # two plots a row at about their own size, not shrunk
