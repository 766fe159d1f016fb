"""Tiny random-weight models of the real metric classes, shared by the metric tests: a CLIP
(transformers' CLIPModel + a CLIP-format BPE vocabulary) and the FID Inception-v3."""
import json
import string

import torch
import torch.nn as nn

from coolsd.metrics.inception import InceptionV3

WORDS = ["photo", "depicts", "cat", "dog", "red", "sits", "on", "the", "mat"]


def write_tiny_bpe(d):
    """vocab.json / merges.txt in CLIP's format: characters, their word-final ``</w>`` forms,
    merge results building WORDS, then SOT and EOT (EOT the largest id, as in CLIP)."""
    chars = list(string.ascii_lowercase) + [".", ","]
    merges = []
    for w in WORDS:
        syms = list(w[:-1]) + [w[-1] + "</w>"]
        cur = syms[0]
        for s in syms[1:]:
            if (cur, s) not in merges:
                merges.append((cur, s))
            cur += s
    toks = list(dict.fromkeys(chars + [c + "</w>" for c in chars] + [a + b for a, b in merges]))
    toks += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(toks)}
    (d / "vocab.json").write_text(json.dumps(vocab))
    (d / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return vocab


def write_tiny_clip(d):
    """A tiny random CLIPModel + tokenizer files saved in folder ``d`` (from_pretrained layout)."""
    from transformers import CLIPConfig, CLIPModel

    vocab = write_tiny_bpe(d)
    sot, eot = vocab["<|startoftext|>"], vocab["<|endoftext|>"]
    cfg = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=77,
                         bos_token_id=sot, eos_token_id=eot, pad_token_id=eot),
        vision_config=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8),
        projection_dim=16)
    torch.manual_seed(0)
    CLIPModel(cfg).eval().save_pretrained(str(d))
    return d


def random_inception(seed: int = 0) -> InceptionV3:
    """He-normal convs and non-trivial BatchNorm statistics, so activations neither vanish nor
    explode through the 94 layers (PyTorch's default init gives ~1e-8 features)."""
    g = torch.Generator().manual_seed(seed)
    model = InceptionV3()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                m.weight.normal_(0, (2 / m.weight[0].numel()) ** 0.5, generator=g)
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5, generator=g)
                m.bias.uniform_(-0.2, 0.2, generator=g)
                m.running_mean.uniform_(-0.2, 0.2, generator=g)
                m.running_var.uniform_(0.5, 1.5, generator=g)
        model.fc.weight.normal_(0, 0.02, generator=g)
    return model.requires_grad_(False).eval()  # as load_inception returns it


class MomentFeatures:
    """A cheap deterministic feature extractor (the interface evaluate / reference use): per
    channel mean, std and two quantiles of the image, 12 dims, any image size."""

    name, protocol, feature_dim = "moments", "raw", 12

    def __call__(self, images):
        import numpy as np

        out = []
        for img in images:
            x = np.asarray(img, np.float64).reshape(-1, 3) / 255
            out.append(np.concatenate([x.mean(0), x.std(0), *np.quantile(x, [0.25, 0.75], axis=0)]))
        return np.asarray(out).reshape(len(out), 12)
