"""LLM stage: a transformers causal LM from a local directory, decoded by our own loop (each row
of a batch with its own sampling: stages/decode_loop.py)."""

from __future__ import annotations

import torch

from vllm_omni_like.errors import InvalidRequestError
from vllm_omni_like.messages import StageRequest
from vllm_omni_like.outputs import StageOutput
from vllm_omni_like.stage_options import LLMOptions
from vllm_omni_like.stages.base import Deferred, Stage, StageControl
from vllm_omni_like.stages.decode_loop import DecodeLoop, RowResult, RowSampling
from vllm_omni_like.stages.isolation import is_fatal_device_error
from vllm_omni_like.stages.tiny_models import TINY_NAMES, ensure_tiny_model
from vllm_omni_like.stages.torch_utils import (
    BatchDimProbe,
    check_model_dir,
    quiet_loading,
    resolve_device,
    resolve_dtype,
)


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
        self.loop = DecodeLoop(self.model, self.tokenizer, self.device)
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

    def _tokenize(self, request: StageRequest, control: StageControl) -> list[int]:
        control.faults.fire("tokenize", [request])
        return self.tokenizer(self._text(request)).input_ids

    def _generate(self, batch: list[StageRequest], control: StageControl) -> list[StageOutput]:
        """Each row's tokenization, detokenization and result are its own: a row that fails
        there ends alone with its error (400 if the request caused it, 500 otherwise)."""
        failed: dict[str, StageOutput] = {}
        live, prompts = [], []
        for r in batch:
            try:
                prompts.append(self._tokenize(r, control))
                live.append(r)
            except Exception as exc:
                if is_fatal_device_error(exc):
                    raise
                failed[r.request_id] = StageOutput.from_error(r.request_id, exc, self.name)
        results: list[RowResult] = []
        if live:
            self.probe.reset()
            results = self.loop.run(
                prompts,
                [self._sampling(r) for r in live],
                lambda step, total: control.step(live, step, total),
                lambda i: control.faults.fire("detokenize", [live[i]]),
            )
            control.saw_model_batch(self.probe.max_seen)
        done = {r.request_id: self._output(r, res) for r, res in zip(live, results, strict=True)}
        return [failed.get(r.request_id) or done[r.request_id] for r in batch]

    def _output(self, r: StageRequest, res: RowResult) -> StageOutput:
        if res.error is not None:
            if is_fatal_device_error(res.error):
                raise res.error
            return StageOutput.from_error(r.request_id, res.error, self.name)
        text = res.text.strip()
        if self.options.outside_answer is not None and text == self.options.outside_answer:
            return StageOutput.from_error(r.request_id, self._outside(), self.name)
        return StageOutput(
            request_id=r.request_id, stage=self.name, text=text, token_ids=res.token_ids
        )

    def _sampling(self, request: StageRequest) -> RowSampling:
        p = request.params
        return RowSampling(
            max_new_tokens=p.max_new_tokens or self.default_max_new,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            seed=p.seed,
            stop=tuple(p.stop),
            repetition_penalty=p.repetition_penalty,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
        )

    def _outside(self) -> InvalidRequestError:
        return InvalidRequestError(
            self.options.outside_message or "the prompt names nothing this model draws",
            stage=self.name,
            param="prompt",
            code="prompt_outside_model_domain",
        )
