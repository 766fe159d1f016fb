"""One self-contained HTML page comparing the methods of one or more run folders (or of a sweep's
folder, whose ``summary.json`` names its run folder in ``env.records``):

* a table of every method, each number with its 95% CI, sortable by clicking a column header;
* the Pareto plots (``coolsd.report.plots``) of the table;
* per prompt, every method's image side by side, each with its accepted length, latency, step TV
  and its own distortion map (the image's per-token ``token_tv`` on the token grid,
  ``coolsd.metrics.token_maps``; one colour scale for the whole page);
* filters by method and by prompt.

Each configuration is named by what sets it apart from the others (``configurations``), and an AR
baseline that several runs ran alike (every job of a sweep runs its own) is shown once.

The page needs no server and no network: images are embedded as base64 PNGs (``--link``: paths
relative to the page instead), the script and style are inline.

    python -m coolsd.report.page results/toy/sweep -o page.html --grid grid.png   # a Hydra multirun's folder
    python -m coolsd.report.page results/toy -o results/toy/page.html --screenshot results/toy/page.png
    python -m coolsd.report.page outputs/toy/coolsd/<time>_<hash> outputs/toy/eagle/<time>_<hash> -o page.html
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import html
import io
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from coolsd.cli.runner import one_line_errors
from coolsd.job.summary import AR, fastest_ar, metric_ci
from coolsd.metrics.registry import METRICS
from coolsd.metrics.token_maps import token_grid
from coolsd.report.consolidate import baseline_identity, configuration_labels, find_runs, run_settings
from coolsd.report.plots import pareto_plot
from coolsd.util.image_grid import captioned_grid
from coolsd.report.sweep import sweep_frame
from coolsd.util.errors import InputFileError
from coolsd.util.records import read_records, save_png_atomic
from coolsd.util.stats import ratio_ci

# the table's first columns, in this order; every other number of the summary follows
CORE = ("accepted_length", "latency_s", "speedup", "speedup_vs_fastest_ar", "step_tv", "target_nll_minus_ar")
# headers that must not read alike: the two speed-ups differ in their AR (coolsd.job.summary.FASTEST_AR_REFERENCE)
HEADERS = {"speedup": "speed-up (same-mode AR)", "speedup_vs_fastest_ar": "speed-up (fastest AR)"}
# record fields that are a per-image number but not a metric of the method
NOT_METRICS = {"prompt_index", "seed", "batch_size", "compilations"}
# speed diagnostics shown only with "all columns"
EXTRA = {"speedup_per_accepted_length", "speedup_without_signals", "images_per_s", "peak_memory_gib"}
MAP_CMAP = "magma"


class MissingRunsError(InputFileError, FileNotFoundError):
    """The page was asked for runs that are not there (no folder, no records): one line, exit status 2."""


class Run:
    """A run folder's records (samples.jsonl) and its summary table ({tag: results entry}, as
    ``coolsd.job.summary.results_table``): the run's own summary.json, else the sweep's that
    named it, else computed from the records (means with CIs, speed-up against its ``ar``)."""

    def __init__(self, folder: Path, table: dict | None = None):
        self.folder = Path(folder)
        self.records = read_records(self.folder / "samples.jsonl")
        if not self.records:
            raise MissingRunsError(f"no records in {self.folder / 'samples.jsonl'}")
        if table is None and (self.folder / "summary.json").exists():
            table = json.loads((self.folder / "summary.json").read_text()).get("results")
        self.table = with_evaluated_metrics(table or table_from_records(self.records), self.folder)
        self.settings, self.set_keys = run_settings(self.folder)
        self.target = self.settings.get("target", self.settings.get("target.name", "?"))


def with_evaluated_metrics(table: dict, folder: Path) -> dict:
    """``table`` with the image metrics ``python -m coolsd.cli.evaluate`` wrote into the run folder
    (``metrics.json``: every registered metric of each method tag, its protocol named in its entry)."""
    path = folder / "metrics.json"
    if not path.exists():
        return table
    evaluated = json.loads(path.read_text()).get("per_method", {})
    return {tag: {**e, **{k: v for k, v in evaluated.get(tag, {}).items() if k in METRICS}} for tag, e in table.items()}


def table_from_records(records: list[dict]) -> dict:
    """{tag: {"params", <metric>: metric_ci, "speedup": paired ratio_ci against ``ar``,
    "speedup_vs_fastest_ar": the same against the faster of ``ar`` and ``ar_compiled``, "fastest_ar"}}
    of every numeric per-image field the records share: the table of a run folder without a summary."""
    by_tag: dict[str, list[dict]] = {}
    for r in records:
        if "error" not in r:  # a failed sample (no image, no numbers) is shown on the page, not averaged
            by_tag.setdefault(r["method"], []).append(r)
    fastest = fastest_ar(by_tag)
    refs = {"speedup": AR, **({"speedup_vs_fastest_ar": fastest} if fastest else {})}
    table = {}
    for tag, rows in by_tag.items():
        e = {"params": rows[0].get("params") or {"method": tag}}
        keys = [k for k, v in rows[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                and k not in NOT_METRICS]
        for k in keys:
            vals = [r[k] for r in rows if isinstance(r.get(k), (int, float))]
            if len(vals) == len(rows):
                e[k] = metric_ci(k, vals)
        for key, ref in refs.items():  # paired by prompt, only where every row has its reference's prompt
            lat = {r["prompt_index"]: r.get("latency_s") for r in by_tag.get(ref, [])}
            pairs = [(lat[r["prompt_index"]], r["latency_s"]) for r in rows
                     if lat.get(r["prompt_index"]) and r.get("latency_s")]
            if lat and len(pairs) == len(rows):
                e[key] = ratio_ci([a for a, _ in pairs], [b for _, b in pairs], paired=True)
        if "speedup_vs_fastest_ar" in e:
            e["fastest_ar"] = fastest
        table[tag] = e
    return table


def load_runs(roots) -> list[Run]:
    """The runs under ``roots``: run folders (or folders holding them), or a sweep's folder whose
    summary.json names its run folder (``env.records``) and holds its table."""
    runs: list[Run] = []
    for root in map(Path, roots):
        summary = root / "summary.json"
        env = json.loads(summary.read_text()).get("env", {}) if summary.exists() else {}
        if env.get("records") and not (root / "samples.jsonl").exists():
            records = root / env["records"]  # a relative path starts at the summary's folder
            if not (records / "samples.jsonl").exists():
                raise MissingRunsError(f"{summary} names run folder {records}, which holds no samples.jsonl "
                                        "(rerun the sweep, or pass its run folder)")
            runs.append(Run(records, json.loads(summary.read_text())["results"]))
            continue
        if not root.is_dir():
            raise MissingRunsError(f"{root} is not a folder (pass run folders, folders holding them, or a sweep's folder)")
        found = find_runs([root])
        if not found:
            raise MissingRunsError(f"no run folder (samples.jsonl) under {root}")
        runs.extend(Run(f) for f in found)
    return runs


@dataclass
class Shown:
    """One configuration as the page shows it: ``tag`` of ``run``, named ``label``; ``runs``: every
    run whose own ``tag`` it stands for (an AR baseline that several runs ran alike is shown once)."""
    run: Run
    tag: str
    label: str
    runs: list[Run]


def prompt_set(records: list[dict]) -> str:
    """What identifies the prompts a configuration ran: their count and a digest of their
    (index, caption, seed)."""
    items = sorted({(r["prompt_index"], r.get("caption", ""), r.get("seed")) for r in records})
    return f"{len(items)} ({hashlib.sha1(json.dumps(items).encode()).hexdigest()[:6]})"


def configurations(runs: list[Run]) -> list[Shown]:
    """Every configuration of ``runs`` in their order, labelled by what varies between them
    (``configuration_labels``). AR baselines with the same ``baseline_identity`` (same parameters,
    target, weights, seed, sampling and prompt set) are one configuration, shown from the first run
    that ran it; ARs that ran on anything different stay apart, labelled by what differs."""
    if len(runs) > 1:
        common = Path(os.path.commonpath([str(r.folder.resolve()) for r in runs]))
        where = [r.folder.resolve().relative_to(common).as_posix() or r.folder.name for r in runs]
    else:
        where = [r.folder.name for r in runs]
    entries, configs, seen = [], [], {}
    for run, place in zip(runs, where):
        for tag, e in run.table.items():
            params = e.get("params") or {"method": tag}
            config = {"params": params, "settings": run.settings, "set_keys": run.set_keys, "where": place,
                      "prompts": prompt_set([r for r in run.records if r["method"] == tag])}
            if params.get("method") == AR:
                same = seen.setdefault(baseline_identity(config), len(entries))
                if same < len(entries):
                    entries[same][2].append(run)
                    continue
            entries.append((run, tag, [run]))
            configs.append(config)
    return [Shown(run, tag, label, covered)
            for (run, tag, covered), label in zip(entries, configuration_labels(configs))]


def by_prompt(shown: list[Shown]) -> dict[tuple[int, str], dict[str, tuple[Run, dict]]]:
    """{(prompt index, caption): {label: (run, record)}} of the shown configurations, by prompt index."""
    prompts: dict[tuple[int, str], dict[str, tuple[Run, dict]]] = {}
    for c in shown:
        for r in c.run.records:
            if r["method"] == c.tag:
                prompts.setdefault((r["prompt_index"], r.get("caption", "")), {})[c.label] = (c.run, r)
    return dict(sorted(prompts.items()))


def write_grid(runs: list[Run], out: Path) -> Path:
    """``out``: a PNG of every configuration's image (a column each, its label above) of every
    prompt (a row each, the prompt on its left), as ``coolsd.util.image_grid.captioned_grid`` draws it."""
    shown = configurations(runs)
    prompts = by_prompt(shown)
    if not prompts:
        raise FileNotFoundError(f"no image records in {', '.join(str(r.folder) for r in runs)}")
    rows, images = [], []
    for (idx, caption), cells in prompts.items():
        rows.append(f"#{idx} {caption}")
        images.append([np.asarray(Image.open(cells[c.label][0].folder / cells[c.label][1]["image"]).convert("RGB"))
                       if c.label in cells and cells[c.label][1].get("image") else None for c in shown])
    grid, _ = captioned_grid([c.label for c in shown], rows, images)
    save_png_atomic(grid, Path(out))
    return Path(out)


def _png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def _data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def map_png(token_tv, vmax: float) -> bytes | None:
    """One image's per-token TV on its token grid (raster order), coloured on [0, vmax]; None
    where the image is not a square grid."""
    tv = np.asarray(token_tv, dtype=np.float64)
    grid = token_grid(tv.size)
    if grid is None:
        return None
    import matplotlib

    rgba = matplotlib.colormaps[MAP_CMAP](np.clip(tv.reshape(grid) / vmax, 0.0, 1.0))
    return _png((rgba[..., :3] * 255).round().astype(np.uint8))


def colorbar_png() -> bytes:
    import matplotlib

    rgba = matplotlib.colormaps[MAP_CMAP](np.linspace(0.0, 1.0, 256))[None].repeat(8, axis=0)
    return _png((rgba[..., :3] * 255).round().astype(np.uint8))


def _fmt(v, signed: bool = False) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:+.3g}" if signed else f"{v:.3g}"


def _columns(df, record_keys: set) -> list[tuple[str, bool]]:
    """(metric column of a ``sweep_frame``, shown by default): CORE first, then the rest in the
    frame's order. Shown by default: CORE and the image-quality metrics (those no record holds, and
    their differences to AR); the records' other means and the speed diagnostics (EXTRA) only with
    "all columns"."""
    skip = {"tag", "family", "params", "run"}
    keys = [c for c in df.columns if c not in skip and not c.endswith(("_lo", "_hi")) and df[c].notna().any()]

    def shown(k: str) -> bool:
        base = k.removesuffix("_minus_ar")
        return k in CORE or (base not in record_keys and k not in EXTRA)

    return [(k, True) for k in CORE if k in keys] + [(k, shown(k)) for k in keys if k not in CORE]


def _shown_path(folder: Path) -> str:
    """A run folder as the page names it: relative to the working directory when inside it."""
    folder = Path(folder).resolve()
    return str(folder.relative_to(Path.cwd())) if folder.is_relative_to(Path.cwd()) else str(folder)


def _ref(path: Path, out: Path, embed: bool) -> str:
    if embed:
        return _data_uri(path.read_bytes())
    return Path(os.path.relpath(path.resolve(), out.resolve().parent)).as_posix()


def build_page(runs: list[Run], out: Path, *, title: str = "Method comparison", embed: bool = True) -> str:
    """The page's HTML (see the module's docstring); ``out``: where it will be written (relative
    image paths start there)."""
    import pandas as pd

    out = Path(out)
    shown = configurations(runs)
    # per run, {tag: label} of the configurations shown from it (an AR shown from another run is not)
    names = [{c.tag: c.label for c in shown if c.run is run} for run in runs]
    frames = []
    for run, name in zip(runs, names):
        df = sweep_frame({tag: e for tag, e in run.table.items() if tag in name})
        df["run"] = str(run.folder)
        df["tag"] = df["tag"].map(name)
        frames.append(df)
    df = pd.concat(frames, ignore_index=True)
    methods = list(df["tag"])
    cols = _columns(df, {k for run in runs for r in run.records[:1] for k in r})

    # the table
    head = ['<th data-key="method" data-type="text">method</th>', '<th data-key="family" data-type="text">family</th>']
    extra = {True: "", False: ' class="extra"'}
    head += [f'<th data-key="{html.escape(k)}" data-type="num" title="{html.escape(k)}"{extra[main]}>'
             f'{html.escape(HEADERS.get(k, k.replace("_", " ")))}</th>' for k, main in cols]
    body = []
    for _, r in df.iterrows():
        cells = [f'<td data-v="{html.escape(r["tag"])}" title="{html.escape(r["run"])}">{html.escape(r["tag"])}</td>',
                 f'<td data-v="{html.escape(str(r["family"]))}">{html.escape(str(r["family"]))}</td>']
        for k, main in cols:
            v, signed, cls = r.get(k), k.endswith("_minus_ar"), extra[main]
            if v is None or pd.isna(v):
                cells.append(f'<td data-v=""{cls}>-</td>')
                continue
            lo, hi = r.get(k + "_lo"), r.get(k + "_hi")
            ci = (f'<span class="ci">[{_fmt(lo, signed)}, {_fmt(hi, signed)}]</span>'
                  if lo is not None and hi is not None and not pd.isna(lo) and not pd.isna(hi) else "")
            cells.append(f'<td data-v="{float(v)!r}"{cls}>{_fmt(float(v), signed)}{ci}</td>')
        body.append(f'<tr data-method="{html.escape(r["tag"])}">' + "".join(cells) + "</tr>")

    # the Pareto plots
    with tempfile.TemporaryDirectory() as tmp:
        try:
            files = pareto_plot(df, Path(tmp) / "pareto.png", METRICS.names(pareto=True),
                                "Quality against acceleration (95% CIs)")
            pareto = f'<img id="pareto" alt="Pareto plots" src="{_data_uri(files[0].read_bytes())}">'
        except ValueError as e:  # no quality metric with values: say so on the page
            pareto = f'<p id="pareto">No Pareto plot: {html.escape(str(e))}</p>'

    # per prompt: every method's image, numbers and distortion map
    prompts = by_prompt(shown)
    tvs = [v for cells in prompts.values() for _, r in cells.values() for v in (r.get("token_tv") or [])]
    vmax = max(max(tvs, default=0.0), 1e-12)
    sections = []
    for (idx, caption), cells in sorted(prompts.items()):
        cards = []
        for m in methods:
            if m not in cells:
                cards.append(f'<div class="card missing" data-method="{html.escape(m)}"><div class="lbl">'
                             f'{html.escape(m)}</div><div class="none">no image</div></div>')
                continue
            run, r = cells[m]
            img = (f'<img class="sample" alt="{html.escape(m)}, prompt {idx}" '
                   f'src="{html.escape(_ref(run.folder / r["image"], out, embed))}">' if r.get("image") else
                   f'<div class="none" title="{html.escape(r.get("error", ""))}">'
                   f'{"failed" if "error" in r else "no image"}</div>')
            png = map_png(r["token_tv"], vmax) if r.get("token_tv") else None
            dmap = (f'<img class="dmap" alt="distortion map" title="per-token TV, 0 to {vmax:.3g}" '
                    f'src="{_data_uri(png)}">'
                    if png is not None else '<div class="none">no map</div>')
            nums = " ".join(f'<span title="{k}">{lab} {_fmt(r.get(k))}</span>' for k, lab in
                            (("accepted_length", "acc. length"), ("latency_s", "latency s"), ("step_tv", "step TV")))
            cards.append(f'<div class="card" data-method="{html.escape(m)}" data-prompt="{idx}">'
                         f'<div class="lbl" title="{html.escape(m)}">{html.escape(m)}</div>'
                         f'<div class="pics">{img}{dmap}</div><div class="nums">{nums}</div></div>')
        sections.append(f'<section class="prompt" data-prompt="{idx}" data-caption="{html.escape(caption.lower())}">'
                        f'<h3>#{idx} {html.escape(caption)}</h3><div class="row">{"".join(cards)}</div></section>')

    checks = "".join(f'<label><input type="checkbox" value="{html.escape(m)}" checked> {html.escape(m)}</label>'
                     for m in methods)
    run_lines = "".join(f"<li><code>{html.escape(_shown_path(r.folder))}</code>: target {html.escape(r.target)}, "
                        f"{len({x['prompt_index'] for x in r.records})} prompts, "
                        f"{html.escape(', '.join(c.label for c in shown if r in c.runs))}</li>" for r in runs)
    run_lines += "".join(f'<li class="shared">{html.escape(c.label)}: ran alike in {len(c.runs)} runs (same target, '
                         "weights, seed, sampling and prompts), shown once, from the first; each method's speed-up "
                         "is against the AR of its own run</li>" for c in shown if len(c.runs) > 1)
    label_of = {(id(run), c.tag): c.label for c in shown for run in c.runs}
    fastest = sorted({label_of.get((id(run), e["fastest_ar"]), e["fastest_ar"])
                      for run in runs for e in run.table.values() if e.get("fastest_ar")})
    fastest_note = f" (here: {html.escape(', '.join(fastest))})" if fastest else ""
    return PAGE.format(title=html.escape(title), runs=run_lines, head="".join(head), body="".join(body),
                       fastest=fastest_note,
                       pareto=pareto, checks=checks, sections="".join(sections), n_prompts=len(prompts),
                       vmax=f"{vmax:.3g}", colorbar=_data_uri(colorbar_png()), style=STYLE,
                       script=SCRIPT)


def write_page(roots, out: Path, *, title: str = "Method comparison", embed: bool = True) -> Path:
    """Build the page of the runs under ``roots`` (folders, or runs ``load_runs`` loaded) and write
    it at ``out`` (atomically)."""
    out = Path(out)
    runs = list(roots) if roots and all(isinstance(r, Run) for r in roots) else load_runs(roots)
    text = build_page(runs, out, title=title, embed=embed)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(out)
    return out


def chromium() -> tuple[str, str] | None:
    """(browser, chromedriver) on PATH (Debian's ``chromium`` and ``chromium-driver``), None if either is absent."""
    browser = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def headless_browser(width: int = 1400, height: int = 1000):
    """A headless chromium under selenium (the ``test`` extra), with its console log kept; the
    driver is the one on PATH, so Selenium Manager never downloads anything."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    found = chromium()
    if found is None:
        raise FileNotFoundError("no chromium and chromedriver on PATH "
                                "(Debian: apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--hide-scrollbars"):
        options.add_argument(arg)
    options.set_capability("goog:loggingOptions", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=found[1]), options=options)


def screenshot(page: Path, png: Path, width: int = 1400, height: int = 2000) -> Path:
    """The top ``width`` x ``height`` pixels of ``page`` as it loads, at ``png``."""
    driver = headless_browser(width, height)
    try:
        driver.get(Path(page).resolve().as_uri())
        # the window's frame takes part of --window-size: grow it until the viewport is width x height
        dw, dh = driver.execute_script("return [window.outerWidth - window.innerWidth, "
                                       "window.outerHeight - window.innerHeight]")
        driver.set_window_size(width + dw, height + dh)
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        if errors:
            raise RuntimeError(f"{page}: console errors {errors}")
        png = Path(png)
        png.parent.mkdir(parents=True, exist_ok=True)
        if not driver.save_screenshot(str(png)):
            raise RuntimeError(f"no screenshot of {page}")
    finally:
        driver.quit()
    return png


STYLE = """
body{font-family:system-ui,sans-serif;margin:16px;color:#222}
h1{font-size:20px;margin:0 0 6px} h2{font-size:16px;margin:18px 0 6px}
h3{font-size:13px;margin:10px 0 4px;font-weight:600}
.runs{font-size:12px;color:#555;margin:0 0 8px;padding-left:18px}
.filters{position:sticky;top:0;background:#fff;padding:6px 0;border-bottom:1px solid #ddd;z-index:2;font-size:12px}
.filters label{margin-right:10px;white-space:nowrap} #prompt-filter{width:260px}
.tablewrap{overflow-x:auto}
table{border-collapse:collapse;font-size:12px}
th,td{border:1px solid #ddd;padding:3px 6px;text-align:right;vertical-align:top}
th{background:#f3f3f3;cursor:pointer;user-select:none;position:relative}
th[aria-sort=ascending]::after{content:" \\25B2"} th[aria-sort=descending]::after{content:" \\25BC"}
td:first-child,td:nth-child(2),th:first-child,th:nth-child(2){text-align:left}
.ci{display:block;color:#777;font-size:10px}
#pareto{max-width:100%}
#methods:not(.all) .extra{display:none}
.legend{font-size:12px;color:#555} .legend img{height:10px;width:160px;vertical-align:middle;margin:0 4px}
.row{display:flex;flex-wrap:wrap;gap:6px}
.card{border:1px solid #ddd;border-radius:4px;padding:4px;font-size:11px}
.lbl{font-weight:600;margin-bottom:2px;overflow-wrap:anywhere;min-height:2.6em}
.card{width:120px}
.pics{display:flex;flex-direction:column;gap:3px}
.pics img{width:120px;height:120px;image-rendering:pixelated}
.nums span{display:block;white-space:nowrap}
.none{width:120px;height:120px;display:flex;align-items:center;justify-content:center;background:#f3f3f3;color:#999}
.shared{color:#777}
.hidden{display:none !important}
"""

# Sorting compares data-v (numbers numerically, an empty value always last); filtering hides
# table rows and cards of unchecked methods and prompts whose index or caption lacks the text.
SCRIPT = """
(function(){
  const table=document.getElementById('methods');
  const tbody=table.tBodies[0];
  table.querySelectorAll('th').forEach(function(th,col){
    th.addEventListener('click',function(){
      const asc=th.getAttribute('aria-sort')!=='ascending';
      table.querySelectorAll('th').forEach(function(h){h.removeAttribute('aria-sort');});
      th.setAttribute('aria-sort',asc?'ascending':'descending');
      const num=th.dataset.type==='num';
      const rows=Array.from(tbody.rows);
      rows.sort(function(a,b){
        const x=a.cells[col].dataset.v, y=b.cells[col].dataset.v;
        if(x===''||y===''){return (x==='')-(y==='');}
        const c=num?parseFloat(x)-parseFloat(y):x.localeCompare(y);
        return asc?c:-c;
      });
      rows.forEach(function(r){tbody.appendChild(r);});
    });
  });
  const boxes=Array.from(document.querySelectorAll('#method-filter input'));
  const text=document.getElementById('prompt-filter');
  function apply(){
    const on=new Set(boxes.filter(function(b){return b.checked;}).map(function(b){return b.value;}));
    document.querySelectorAll('[data-method]').forEach(function(el){
      el.classList.toggle('hidden',!on.has(el.dataset.method));
    });
    const q=text.value.trim().toLowerCase();
    let shown=0;
    document.querySelectorAll('section.prompt').forEach(function(s){
      const ok=!q||s.dataset.caption.indexOf(q)>=0||('#'+s.dataset.prompt)===q||s.dataset.prompt===q;
      s.classList.toggle('hidden',!ok); shown+=ok?1:0;
    });
    document.getElementById('shown').textContent=shown;
  }
  boxes.forEach(function(b){b.addEventListener('change',apply);});
  document.getElementById('all-columns').addEventListener('change',function(e){
    table.classList.toggle('all',e.target.checked);
  });
  text.addEventListener('input',apply);
})();
"""

PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title><style>{style}</style></head>
<body>
<h1>{title}</h1>
<ul class="runs">{runs}</ul>
<div class="filters"><span id="method-filter">Methods: {checks}</span><br>
Prompts: <input id="prompt-filter" type="search" placeholder="caption text or prompt index">
showing <span id="shown">{n_prompts}</span> of {n_prompts}</div>
<h2>Methods</h2>
<p class="legend">Mean with its 95% CI below. Speed-up (same-mode AR): against AR of the same run in the
same mode (eager, or compiled under compile=true), paired by prompt. Speed-up (fastest AR): against the faster
of that AR and compiled AR (ar_compiled: static KV cache, CUDA graphs) timed on the same prompts{fastest};
where only one AR ran, the two are equal. Click a header to sort.
<label><input id="all-columns" type="checkbox"> all columns</label></p>
<div class="tablewrap"><table id="methods"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>
<h2>Pareto plots</h2>
{pareto}
<h2>Per prompt</h2>
<p class="legend">Each image with its distortion map: the exact per-token TV(pi_t, p_t) on the token grid
(0<img alt="colour scale" src="{colorbar}">{vmax}, one scale for the page; black everywhere for a lossless method);
under it the image's accepted length, latency (seconds) and step TV (summed over the image).</p>
{sections}
<script>{script}</script>
</body></html>
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="run folders, folders holding runs, or a sweep's folder")
    ap.add_argument("-o", "--out", type=Path, default=Path("page.html"), help="HTML file to write (default page.html)")
    ap.add_argument("--title", default="Method comparison")
    ap.add_argument("--link", action="store_true",
                    help="refer to the images by paths relative to the page instead of embedding them")
    ap.add_argument("--grid", type=Path, default=None,
                    help="also write a PNG of every configuration's image per prompt, captioned (label above "
                         "each column, prompt beside each row)")
    ap.add_argument("--screenshot", type=Path, default=None,
                    help="also write a PNG of the page's top as headless chromium shows it (selenium, chromium-driver)")
    a = ap.parse_args(argv)
    with one_line_errors():
        runs = load_runs(a.runs)
        out = write_page(runs, a.out, title=a.title, embed=not a.link)
        print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")
        if a.grid:
            print(f"wrote {write_grid(runs, a.grid)}")
        if a.screenshot:
            print(f"wrote {screenshot(out, a.screenshot)}")


if __name__ == "__main__":
    main()
