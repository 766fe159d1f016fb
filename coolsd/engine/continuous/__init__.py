"""Continuous speculative decoding (CSpD, continuous_sd.md section 2; docs/methods.md#5-continuous-speculative-decoding) for
diffusion-head AR models: the head's per-step Gaussians with aligned noise (``diffusion``) and
the per-token accept / resample rules in log space (``cspd``)."""
