"""LLM stage: a transformers causal LM from a local directory, batched generate, left padding."""

from __future__ import annotations

from typing import Any

import torch

from vllm_omni_like.errors import InvalidRequestError
from vllm_omni_like.messages import StageRequest
from vllm_omni_like.outputs import StageOutput
from vllm_omni_like.stage_options import LLMOptions
from vllm_omni_like.stages.base import Deferred, Stage, StageControl
from vllm_omni_like.stages.tiny_models import TINY_NAMES, ensure_tiny_model
from vllm_omni_like.stages.torch_utils import (
    BatchDimProbe,
    check_model_dir,
    quiet_loading,
    resolve_device,
    resolve_dtype,
)


class RowSampler:
    """A logits processor that samples each row with its own generator and temperature.

    Greedy rows (temperature 0) are left alone; sampled rows get every logit but the drawn
    token set to -inf, so `generate`'s greedy pick returns the draw. A request's tokens thus
    depend on its own seed only, never on its batch peers.
    """

    def __init__(
        self,
        temperatures: list[float],
        top_ps: list[float],
        generators: list[torch.Generator | None],
    ) -> None:
        self.temperatures = temperatures
        self.top_ps = top_ps
        self.generators = generators

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for row, (temp, top_p, gen) in enumerate(
            zip(self.temperatures, self.top_ps, self.generators, strict=True)
        ):
            if temp <= 0 or gen is None:
                continue
            probs = torch.softmax(scores[row].float() / temp, dim=-1)
            if top_p < 1.0:
                sorted_p, order = probs.sort(descending=True)
                drop = sorted_p.cumsum(0) - sorted_p > top_p
                probs[order[drop]] = 0.0
                probs = probs / probs.sum()
            token = torch.multinomial(probs.cpu(), 1, generator=gen).item()
            scores[row].fill_(float("-inf"))
            scores[row, token] = 0.0
        return scores


class _StepHook:
    """A stopping criterion that only reports each decoding step (and sees aborts)."""

    def __init__(self, batch: list[StageRequest], control: StageControl, total: int) -> None:
        self.batch, self.control, self.total, self.step = batch, control, total, 0

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        self.step += 1
        self.control.step(self.batch, self.step, self.total)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class LLMStage(Stage):
    options_type = LLMOptions

    def load(self, device: str) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        path = self.config.model or "tiny-llm"
        quiet_loading()
        if path in TINY_NAMES:
            path = ensure_tiny_model(path)
        check_model_dir(path, "config.json")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(self.config.dtype, self.device, torch.bfloat16)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.config.load_format == "dummy":
            config = AutoConfig.from_pretrained(path, local_files_only=True)
            with torch.device(self.device):
                self.model = AutoModelForCausalLM.from_config(config, dtype=self.dtype)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(
                path, local_files_only=True, dtype=self.dtype
            ).to(self.device)
        self.model.eval()
        self.probe = BatchDimProbe()
        self.probe.attach(self.model)
        opts = self.options
        self.template = opts.prompt_template
        self.default_max_new = opts.max_new_tokens
        self.context = int(getattr(self.model.config, "max_position_embeddings", 0) or 4096)

    def _text(self, request: StageRequest) -> str:
        return self.template.format(prompt=request.prompt)

    def validate(self, request: StageRequest) -> None:
        count = len(self.tokenizer(self._text(request)).input_ids)
        new = request.params.max_new_tokens or self.default_max_new
        if count + new > self.context:
            raise InvalidRequestError(
                f"prompt is {count} tokens long; with {new} new tokens that exceeds the "
                f"model's context of {self.context}",
                stage=self.name,
                param="prompt",
                code="prompt_too_long",
            )

    def begin(self, batch: list[StageRequest], control: StageControl) -> Deferred:
        """Generation runs whole here: nothing is left to defer."""
        return Deferred.done(batch, self._generate(batch, control))

    def _generate(self, batch: list[StageRequest], control: StageControl) -> list[StageOutput]:
        from transformers import LogitsProcessorList, StoppingCriteriaList

        max_new = batch[0].params.max_new_tokens or self.default_max_new
        enc = self.tokenizer([self._text(r) for r in batch], return_tensors="pt", padding=True)
        enc = {k: v.to(self.device) for k, v in enc.items()}
        sampler = RowSampler(
            [r.params.temperature for r in batch],
            [r.params.top_p for r in batch],
            [
                torch.Generator().manual_seed(r.params.seed or 0)
                if r.params.temperature > 0
                else None
                for r in batch
            ],
        )
        self.probe.reset()
        with torch.inference_mode():
            out = self.model.generate(
                **enc,
                max_new_tokens=max_new,
                do_sample=False,
                logits_processor=LogitsProcessorList([sampler]),
                stopping_criteria=StoppingCriteriaList([_StepHook(batch, control, max_new)]),
                pad_token_id=self.tokenizer.pad_token_id,
            )
        control.saw_model_batch(self.probe.max_seen)
        new_tokens = out[:, enc["input_ids"].shape[1] :].tolist()
        outputs = []
        for r, ids in zip(batch, new_tokens, strict=True):
            ids = [t for t in ids if t != self.tokenizer.pad_token_id]
            if self.tokenizer.eos_token_id in ids:
                ids = ids[: ids.index(self.tokenizer.eos_token_id)]
            text = self.tokenizer.decode(ids, skip_special_tokens=True).strip()
            if self.options.outside_answer is not None and text == self.options.outside_answer:
                outputs.append(StageOutput.from_error(r.request_id, self._outside(), self.name))
                continue
            outputs.append(
                StageOutput(request_id=r.request_id, stage=self.name, text=text, token_ids=ids)
            )
        return outputs

    def _outside(self) -> InvalidRequestError:
        return InvalidRequestError(
            self.options.outside_message or "the prompt names nothing this model draws",
            stage=self.name,
            param="prompt",
            code="prompt_outside_model_domain",
        )
