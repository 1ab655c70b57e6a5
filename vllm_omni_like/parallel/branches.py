"""A pipeline's denoiser in its place, and classifier-free guidance's two branches in one forward.

The wrappers the family adapters put where a pipeline finds its denoiser (models/): a
`DenoiserWrapper` reads the model's dtype once; `BatchedCFG` turns a pipeline's two guidance
calls a step into one forward over both halves; parallel/cfg_parallel.py's wrappers run the two
branches on two ranks instead.
"""

from __future__ import annotations

from typing import Any

import torch


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape


class DenoiserWrapper(torch.nn.Module):
    """A denoiser in the pipeline's place: what it does not define comes from the model (config,
    cache_context, ...), and its `dtype` is read once (a diffusers model's walks its modules at
    every read, and the pipeline reads it at every call)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.model_dtype: torch.dtype | None = getattr(model, "dtype", None)

    @property
    def dtype(self) -> torch.dtype:
        dtype = self.model.dtype if self.model_dtype is None else self.model_dtype
        assert isinstance(dtype, torch.dtype)
        return dtype

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.model, name)


class BatchedCFG(DenoiserWrapper):
    """Runs a pipeline's two guidance calls of the denoiser (conditional, then unconditional,
    on the same latents) as one forward over both halves.

    diffusers' Wan pipeline calls its transformer twice a step; the UNet pipelines already
    batch the two. `arm(kwargs)` before a call (the negative prompt embeddings in the
    denoiser's dtype, the very tensor passed to the pipeline), `disarm()` after: a conditional
    call then computes both halves and the unconditional call that follows with the same
    latents gets its half without running the model. Any other call runs as it is.
    """

    needs_embeddings = True  # the stage encodes the prompts before the call, for `arm`

    def __init__(self, model: torch.nn.Module, shared_inputs: tuple[str, ...] = ()) -> None:
        """`shared_inputs`: keyword inputs of one row each that both branches take alike (an
        image's features): doubled with the latents."""
        super().__init__(model)
        self.shared_inputs = shared_inputs
        self.negative: torch.Tensor | None = None
        self._pending: tuple[torch.Tensor, tuple] | None = None

    def arm(self, kwargs: dict[str, Any]) -> None:
        self.negative = kwargs["negative_prompt_embeds"]

    def settle(self) -> None:
        """After a call: raise if a branch computed elsewhere failed (CFG-parallel); none here."""

    def disarm(self) -> None:
        self.negative = None
        self._pending = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        pending, self._pending = self._pending, None
        latents = kwargs.get("hidden_states")
        text = kwargs.get("encoder_hidden_states")
        negative = self.negative
        if (
            negative is None
            or args
            or latents is None
            or text is None
            or kwargs.get("return_dict", True)
        ):
            return self.model(*args, **kwargs)
        if _same(text, negative):
            if pending is not None and _same(latents, pending[0]):
                return pending[1]  # computed with the conditional half
            return self.model(**kwargs)
        if text.shape != negative.shape:
            return self.model(**kwargs)
        cond, uncond = self._branches(kwargs, negative)
        self._pending = (latents, uncond)
        return cond

    def _branches(self, kwargs: dict[str, Any], negative: torch.Tensor) -> tuple[tuple, tuple]:
        """The conditional call's outputs and the unconditional one's: here, one forward."""
        latents, text = kwargs["hidden_states"], kwargs["encoder_hidden_states"]
        timestep = kwargs.get("timestep")
        both = dict(
            kwargs,
            hidden_states=torch.cat([latents, latents]),
            encoder_hidden_states=torch.cat([text, negative]),
        )
        if isinstance(timestep, torch.Tensor) and timestep.dim() > 0:
            both["timestep"] = torch.cat([timestep, timestep])
        for name in self.shared_inputs:  # the same rows for both branches
            value = kwargs.get(name)
            if isinstance(value, torch.Tensor):
                both[name] = torch.cat([value, value])
        out = self.model(**both)
        rows = latents.shape[0]
        rest = tuple(out[1:])
        return (out[0][:rows], *rest), (out[0][rows:], *rest)
