"""HPSv2 (coolsd.metrics.hps): scored by hpsv2_worker.py in the interpreter that has the ``hpsv2``
package, here a stand-in package of the same API (``hpsv2.src.open_clip``: create_model_and_transforms,
get_tokenizer; the real one needs torchvision, which does not install beside this project's torch):
the worker's scores are the model's image-text dot products pair by pair, the checkpoint is loaded
strictly and the model is never built with ``pretrained`` (no download); ``evaluate --metrics
hpsv2`` writes them, without the checkpoint it is refused before any work naming the hub file and
the download command, and the state-of-the-art table shows the column."""
import json
import sys
import textwrap

import numpy as np
import pytest
import torch
from PIL import Image

from coolsd.cli.evaluate import main as evaluate
from coolsd.metrics.hps import HPSv2Scorer
from coolsd.util.records import RecordWriter

CAPTIONS = ["a red cat", "the dog sits", "a mat"]

FAKE_OPEN_CLIP = '''
import torch


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.visual = torch.nn.Linear(3, 4)
        self.text = torch.nn.Embedding(128, 4)

    def forward(self, image, text):
        img = torch.nn.functional.normalize(self.visual(image.mean((2, 3))), dim=-1)
        txt = torch.nn.functional.normalize(self.text(text).mean(1), dim=-1)
        return {"image_features": img, "text_features": txt}


def preprocess_val(image):
    return torch.from_numpy(__import__("numpy").asarray(image.convert("RGB"), dtype="float32") / 255).permute(2, 0, 1)


def create_model_and_transforms(name, pretrained=None, precision="fp32", device="cpu", **kwargs):
    if pretrained is not None:
        raise RuntimeError(f"would download the {pretrained} weights")
    assert name == "ViT-H-14" and precision == "fp32" and kwargs["output_dict"]
    return Model().to(device), None, preprocess_val


def get_tokenizer(name):
    return lambda texts: torch.tensor([[ord(c) % 128 for c in t[:8].ljust(8)] for t in texts])
'''


@pytest.fixture
def fake_hpsv2(tmp_path):
    site = tmp_path / "fake_site"
    pkg = site / "hpsv2" / "src" / "open_clip"
    pkg.mkdir(parents=True)
    for d in (site / "hpsv2", site / "hpsv2" / "src"):
        (d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text(textwrap.dedent(FAKE_OPEN_CLIP))
    sys.path.insert(0, str(site))
    try:
        from hpsv2.src.open_clip import create_model_and_transforms, get_tokenizer

        torch.manual_seed(0)
        model, _, preprocess = create_model_and_transforms("ViT-H-14", None, output_dict=True)
        ckpt = tmp_path / "HPS_v2.1_compressed.pt"
        torch.save({"state_dict": model.state_dict()}, ckpt)
        yield {"checkpoint": ckpt, "env": {"PYTHONPATH": str(site)}, "model": model.eval(), "preprocess": preprocess,
               "tokenizer": get_tokenizer("ViT-H-14")}
    finally:
        sys.path.remove(str(site))
        for m in [m for m in sys.modules if m == "hpsv2" or m.startswith("hpsv2.")]:
            del sys.modules[m]


def _run(root):
    r = np.random.default_rng(0)
    w = RecordWriter(root)
    for i, c in enumerate(CAPTIONS):
        w.append({"method": "ar", "prompt_index": i, "caption": c, "seed": i},
                 r.integers(0, 256, (16, 20, 3), dtype=np.uint8), f"ar/{i:05d}.png")
    return root


def test_the_worker_scores_each_pair_with_the_packages_model(tmp_path, fake_hpsv2):
    run = _run(tmp_path / "run")
    paths = [run / "images" / "ar" / f"{i:05d}.png" for i in range(3)]
    got = HPSv2Scorer(fake_hpsv2["checkpoint"], sys.executable, env=fake_hpsv2["env"]).score(paths, CAPTIONS)
    with torch.no_grad():
        want = [float(torch.diagonal(o["image_features"] @ o["text_features"].T)[0]) for o in
                (fake_hpsv2["model"](fake_hpsv2["preprocess"](Image.open(p)).unsqueeze(0), fake_hpsv2["tokenizer"]([c]))
                 for p, c in zip(paths, CAPTIONS))]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert len(set(np.round(got, 6))) == 3  # each pair its own caption: not one score repeated

    torch.save({"state_dict": {"visual.weight": torch.zeros(4, 3)}}, tmp_path / "wrong.pt")
    with pytest.raises(RuntimeError, match=r"not an HPSv2 checkpoint: it lacks 2 parameters \(text\.weight, visual\.bias\).*xswu/HPSv2"):
        HPSv2Scorer(tmp_path / "wrong.pt", sys.executable, env=fake_hpsv2["env"]).score(paths, CAPTIONS)
    with pytest.raises(RuntimeError, match=r"cannot import the hpsv2 package .*pip install hpsv2"):
        HPSv2Scorer(fake_hpsv2["checkpoint"], sys.executable, env={"PYTHONPATH": str(tmp_path)})
    with pytest.raises(FileNotFoundError, match=r"HPSv2 checkpoint file .*nope\.pt not found; it comes from .*xswu/HPSv2"):
        HPSv2Scorer(tmp_path / "nope.pt", sys.executable, env=fake_hpsv2["env"])


def test_evaluate_writes_hpsv2_and_refuses_it_without_the_checkpoint(tmp_path, fake_hpsv2, monkeypatch, capsys):
    run = _run(tmp_path / "run")
    monkeypatch.delenv("HPSV2_CKPT", raising=False)
    with pytest.raises(FileNotFoundError, match=r"HPSv2 checkpoint: hf://xswu/HPSv2/HPS_v2\.1_compressed\.pt is not in "
                                                r"the Hugging Face cache .*python -m coolsd\.cli\.download metrics=hpsv2.*"
                                                r"--hps-checkpoint /path or \$HPSV2_CKPT"):
        evaluate([str(run), "--metrics", "hpsv2"])
    assert not (run / "metrics.json").exists()
    monkeypatch.setenv("PYTHONPATH", fake_hpsv2["env"]["PYTHONPATH"])
    out = evaluate([str(run), "--metrics", "hpsv2", "--hps-checkpoint", str(fake_hpsv2["checkpoint"]),
                    "--hps-python", sys.executable])
    e = out["per_method"]["ar"]["hpsv2"]
    assert e["n"] == 3 and len(out["per_sample"]["ar"]["hpsv2"]) == 3 and e["lo"] <= e["mean"] <= e["hi"]
    assert e["mean"] == pytest.approx(np.mean(out["per_sample"]["ar"]["hpsv2"]))
    assert json.loads((run / "metrics.json").read_text())["protocol"]["hps_checkpoint"].endswith("HPS_v2.1_compressed.pt")
    assert "HPSv2 " in capsys.readouterr().out


def test_the_sota_table_has_the_hpsv2_column(tmp_path):
    """Every metric evaluate computes is a quality column of ``make sota-table`` where a row has it."""
    import pandas as pd

    from coolsd.report import sota

    assert "hpsv2" in sota.QUALITY["real"]
    df = pd.DataFrame([{"target": "t", "method": "AR", "tokens_per_forward": 1.0, "tokens_per_forward_lo": 1.0, "tokens_per_forward_hi": 1.0, "hpsv2": 0.25, "hpsv2_lo": 0.2,
                        "hpsv2_hi": 0.3, "reported": "-"}])
    sota.write_tables(df, tmp_path, sota.QUALITY["real"])
    md = (tmp_path / "sota.md").read_text()
    assert "| hpsv2 |" in md and "0.25 [0.20, 0.30]" in md
