"""The toy target: LlamaGen's GPT class in a tiny config, with a small caption encoder in place
of FLAN-T5 (same interface: a left-padded caption feature sequence and its mask)."""
from __future__ import annotations

import torch
import torch.nn as nn

from coolsd.models.llamagen import LlamaGenConfig
from coolsd.toy.scenes import MAX_CAPTION_TOKENS, WORDS, tokenize

TOY_GPT = LlamaGenConfig(
    dim=128, n_layer=12, n_head=4, vocab_size=512, cls_token_num=MAX_CAPTION_TOKENS,
    caption_dim=64, block_size=64, multiple_of=32,
)


class CaptionEncoder(nn.Module):
    """Word embeddings + learned word positions + one pre-norm transformer layer.

    LlamaGen's text slots get zero RoPE, so the GPT sees caption slots without order: word
    order ("top left" vs "left") must be encoded here, as T5 does for the real targets.
    """

    def __init__(self, dim: int = TOY_GPT.caption_dim, max_len: int = MAX_CAPTION_TOKENS, heads: int = 4):
        super().__init__()
        self.max_len = max_len
        self.embed = nn.Embedding(len(WORDS), dim)
        self.pos = nn.Parameter(torch.zeros(max_len, dim))
        self.layer = nn.TransformerEncoderLayer(
            dim, heads, dim_feedforward=2 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.norm = nn.LayerNorm(dim)
        nn.init.normal_(self.pos, std=0.02)

    def ids(self, captions: list[str]) -> torch.Tensor:
        """(B, max_len) word ids, LEFT padded with 0 (valid words at the end, as LlamaGen)."""
        out = torch.zeros(len(captions), self.max_len, dtype=torch.long, device="cpu")  # host-side; encode moves it
        for b, c in enumerate(captions):
            w = tokenize(c)
            out[b, self.max_len - len(w) :] = torch.tensor(w, dtype=torch.long, device="cpu")
        return out

    def forward(self, ids: torch.Tensor) -> dict:
        mask = ids != 0
        # word position k counts from the first valid word
        first = (~mask).sum(1, keepdim=True)
        pos = (torch.arange(self.max_len, device=ids.device).unsqueeze(0) - first).clamp(min=0)
        x = self.embed(ids) + self.pos[pos]
        x = self.layer(x, src_key_padding_mask=~mask)
        x = self.norm(x) * mask.unsqueeze(-1)
        return {"caption_embs": x, "emb_mask": mask}

    def encode(self, captions: list[str]) -> dict:
        return self(self.ids(captions).to(self.pos.device))
