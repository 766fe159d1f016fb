"""MAR class-conditional ImageNet 256 from the official local files (``target=mar_h`` /
``mar_l``, ``draft=mar_b`` / ``mar_l``): the MAR target and draft (``coolsd.models.mar``,
``checkpoint-last.pth``, EMA weights) and the KL-16 VAE (``coolsd.models.kl16_vae``,
``kl16.ckpt``), assembled into a ``coolsd.continuous.job.ContinuousWorld``. Every file is
checked before anything is loaded; prompts are class labels (``dataset=imagenet``).
"""
from __future__ import annotations

from coolsd.models.kl16_vae import KL16_SOURCE, KLVAEConfig, decode_tokens, load_kl16
from coolsd.models.mar import MAR_CONFIGS, MAR_SOURCE, MARConfig, load_mar
from coolsd.targets.files import DTYPES, file_identity, missing_paths

SOURCES = {"checkpoint": MAR_SOURCE, "vae": KL16_SOURCE}


def missing_files(target_cfg, draft_cfg) -> list[str]:
    out = missing_paths(dict(target_cfg.files), SOURCES)
    if draft_cfg is not None and draft_cfg.get("kind") == "mar":
        out += missing_paths({"checkpoint": draft_cfg.files.checkpoint}, SOURCES, prefix="draft.files")
    return out


def _arch(arch, where: str) -> MARConfig:
    """A released architecture by name, or a mapping of ``MARConfig`` fields (own variants)."""
    if isinstance(arch, str):
        if arch not in MAR_CONFIGS:
            raise ValueError(f"{where}={arch!r} is not a MAR architecture; valid: {', '.join(MAR_CONFIGS)}, or a mapping "
                             f"of MARConfig fields")
        return MAR_CONFIGS[arch]
    fields = dict(arch)
    unknown = sorted(set(fields) - set(MARConfig.__dataclass_fields__))
    if unknown:
        raise ValueError(f"{where} has unknown MARConfig field(s) {unknown}; valid: {sorted(MARConfig.__dataclass_fields__)}")
    return MARConfig(**fields)


def load_mar_world(cfg, head):
    from coolsd.continuous.job import ContinuousWorld, class_labels

    t, d = cfg.target, cfg.get("draft")
    from omegaconf import OmegaConf

    target_arch = _arch(OmegaConf.to_object(t.arch) if OmegaConf.is_config(t.arch) else t.arch, "target.arch")
    if d is None or d.get("kind") not in ("mar", "self"):
        raise ValueError("a MAR target drafts with a MAR checkpoint (draft=mar_b or draft=mar_l) or itself (draft=self)")
    draft_arch = None
    if d.kind == "mar":
        draft_arch = _arch(OmegaConf.to_object(d.arch) if OmegaConf.is_config(d.arch) else d.arch, "draft.arch")
        if (draft_arch.seq_len, draft_arch.token_dim) != (target_arch.seq_len, target_arch.token_dim):
            raise ValueError("draft and target must share the token grid and dim (the same VAE)")
    missing = missing_files(t, d)
    if missing:
        raise FileNotFoundError(f"target {t.name!r} cannot run: missing files\n  " + "\n  ".join(missing))
    device, dtype = t.get("device", "cuda"), DTYPES[t.get("dtype", "float32")]
    target = load_mar(t.files.checkpoint, target_arch, dtype=dtype, device=device)
    draft = target if draft_arch is None else load_mar(d.files.checkpoint, draft_arch, dtype=dtype, device=device)
    vae_cfg = t.get("vae")  # null = the KL-16 VAE; a mapping of KLVAEConfig fields otherwise (tests: tiny)
    vae = load_kl16(t.files.vae, KLVAEConfig(**{k: tuple(v) if isinstance(v, (list, tuple)) or OmegaConf.is_list(v) else v
                                                for k, v in vae_cfg.items()}) if vae_cfg else KLVAEConfig(), device=device)
    side = target_arch.side
    files = {"checkpoint": file_identity(t.files.checkpoint), "vae": file_identity(t.files.vae),
             **({"draft": file_identity(d.files.checkpoint)} if draft_arch is not None else {})}
    return ContinuousWorld(t.name, target, draft, head, class_labels, lambda tok: decode_tokens(vae, tok, side, side), files)
