"""Sources of uniforms for decoding.

``PerSampleRNG`` gives each sample its own generator seeded from (run seed, sample key), so a
sample's tokens do not depend on which other samples share its batch or in which order prompts
run. ``SharedRNG`` draws a whole batch from one generator: faster, used by the theory lab where
samples are i.i.d. replicates.
"""
from __future__ import annotations

import torch


class PerSampleRNG:
    def __init__(self, seeds, dtype=torch.float64):
        self.gens = []
        for s in seeds:
            g = torch.Generator()
            g.manual_seed(int(s))
            self.gens.append(g)
        self.dtype = dtype

    def uniform(self, *shape: int) -> torch.Tensor:
        """(B, *shape) uniforms in [0, 1); row b comes from sample b's generator only."""
        return torch.stack([torch.rand(shape, generator=g, dtype=self.dtype, device="cpu") for g in self.gens])


class SharedRNG:
    def __init__(self, batch: int, seed: int, dtype=torch.float64):
        self.batch = batch
        self.gen = torch.Generator()
        self.gen.manual_seed(int(seed))
        self.dtype = dtype

    def uniform(self, *shape: int) -> torch.Tensor:
        return torch.rand((self.batch, *shape), generator=self.gen, dtype=self.dtype, device="cpu")
