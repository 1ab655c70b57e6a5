"""A diffusion stage for the CFG-parallel tests, imported by 'module:Class' in its workers (a
module of its own: the null stages' helpers must not import torch)."""

from __future__ import annotations

from vllm_omni_like.parallel.cfg_parallel import LOOP_CALL
from vllm_omni_like.stages.diffusion.stage import DiffusionStage


class BranchFaultStage(DiffusionStage):
    """A diffusion stage whose CFG-parallel rank 1 fails its branch, as a device would:
    out of memory on the first call for 96x96 images (24x24 latents), and a plain error on
    the third of four calls for 128x128 ones (32x32 latents): our own loop's unconditional
    forwards (tiny-image), or a pipeline call's branches."""

    def load(self, device: str) -> None:
        super().load(device)
        ranks = self.runtime.cfg_ranks
        assert ranks is not None  # (the CFG-parallel tests' replicas only)
        model, calls = ranks.branch_model, {"n": 0}

        def branch(*args, **kwargs):
            call = kwargs.get(LOOP_CALL)  # (our own loop's forward, or a pipeline call's)
            latents = call["latents"] if call is not None else (args or [kwargs["sample"]])[0]
            side = latents.shape[-1]
            if side == 24:
                raise MemoryError("simulated out of memory on rank 1")
            calls["n"] = (calls["n"] + 1) if side == 32 else 0
            if calls["n"] % 4 == 3:
                raise RuntimeError("simulated failure on rank 1")
            return model(*args, **kwargs)

        ranks.branch_model = branch
