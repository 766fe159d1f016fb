"""Continuous speculative decoding (CSpD, continuous_sd.md section 2; METHODS.md 5) for
diffusion-head AR models: the head's per-step Gaussians with aligned noise (``diffusion``) and
the per-token accept / resample rules in log space (``cspd``)."""
