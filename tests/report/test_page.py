"""The comparison page (coolsd.report.page): its inputs (run folders, a sweep's folder), and the
page itself in a real headless browser (Debian's chromium and chromedriver; the browser test skips,
with its reason, only where they are absent)."""
import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from selenium.webdriver.common.by import By

from coolsd.report.page import build_page, chromium, headless_browser, labels, load_runs, main, screenshot, write_page

# tag -> (mean accepted length, step TV per token): the table's order under a sort is known
METHODS = {"ar": (1.0, 0.0), "eagle": (2.0, 0.0), "coolsd_2": (3.0, 0.2), "uniform_rsd_2": (2.5, 0.3)}
PROMPTS = ["a red circle", "a blue square", "a green triangle"]


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
    runs = load_runs([write_run(tmp_path / "a"), write_run(tmp_path / "b", summary=True)])
    assert labels(runs)[1]["eagle"] == "eagle @ b"
    same_name = load_runs([write_run(tmp_path / "x" / "t"), write_run(tmp_path / "y" / "t")])
    assert [n["ar"] for n in labels(same_name)] == ["ar @ x/t", "ar @ y/t"]
    page = build_page(runs, tmp_path / "page.html", embed=False)
    assert page.count('<img class="sample"') == 2 * len(METHODS) * len(PROMPTS)
    assert 'src="a/images/eagle/00000.png"' in page and 'src="b/images/eagle/00000.png"' in page
    assert 'data-key="toy_fid"' in page  # the summary's quality metric has a column


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
    assert "timed on the same prompts (here: ar_compiled)" in page


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
    assert pairs == sorted((m, str(i)) for m in METHODS for i in range(len(PROMPTS)))
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

    by_acc = sorted(METHODS, key=lambda t: METHODS[t][0])
    assert order() == list(METHODS)
    header = browser.find_element(By.CSS_SELECTOR, '#methods th[data-key="accepted_length"]')
    header.click()
    assert order() == by_acc and header.get_attribute("aria-sort") == "ascending"
    header.click()
    assert order() == by_acc[::-1] and header.get_attribute("aria-sort") == "descending"
    browser.find_element(By.CSS_SELECTOR, '#methods th[data-key="method"]').click()
    assert order() == sorted(METHODS)

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
