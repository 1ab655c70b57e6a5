"""LLM stage: a transformers causal LM from a local directory, decoded by our own loop (each row
of a batch with its own sampling and constraint: token_rules.py, guided.py), as a running set
rows join and leave at step boundaries (running_set.py, token_batch.py).

A row's way in: its chat turns rendered with the model's chat template (or the stage's prompt
template), tokenized, its constraint started; any of them failing ends that row alone (400 when
the request caused it) before the batch's first forward."""

from __future__ import annotations

from typing import Any

import torch

from vllm_omni_like.errors import InvalidRequestError, is_fatal_device_error
from vllm_omni_like.models.tiny import TINY_NAMES, ensure_tiny_model
from vllm_omni_like.outputs import StageOutput
from vllm_omni_like.params import GuideSpec
from vllm_omni_like.stage_options import LLMOptions
from vllm_omni_like.stages.base import Deferred, RowStepper, Stage, StageControl, run_whole
from vllm_omni_like.stages.llm.guided import Guides
from vllm_omni_like.stages.llm.running_set import LLMRows
from vllm_omni_like.stages.llm.sampling import RowSampling
from vllm_omni_like.stages.llm.token_rules import RowDecoder, RowResult
from vllm_omni_like.stages.torch_utils import (
    BatchDimProbe,
    check_model_dir,
    dtype_name,
    quiet_loading,
    resolve_device,
    resolve_dtype,
)
from vllm_omni_like.wire import Mode, StageRequest


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
        # the constraint's vocabulary covers the model's logits and every token the tokenizer
        # knows (a model may pad its vocabulary; a tokenizer may add tokens beyond it)
        vocab = max(self.model.get_output_embeddings().weight.shape[0], len(self.tokenizer))
        self.guides = Guides(self.tokenizer, vocab)
        grammar = self.options.output_grammar
        self.output_guide = GuideSpec("grammar", grammar) if grammar else None
        if self.output_guide is not None:
            self.guides.grammar(self.output_guide)  # a bad one fails the load, not a request
        self.decoder = RowDecoder(self.model, self.tokenizer, self.guides)
        self.steps_rows = self._caches_by_row()
        opts = self.options
        self.template = opts.prompt_template
        self.default_max_new = opts.max_new_tokens
        self.context = int(getattr(self.model.config, "max_position_embeddings", 0) or 4096)

    def _text(self, request: StageRequest) -> str:
        turns = request.params.messages
        if turns is None:
            return self.template.format(prompt=request.prompt)
        if getattr(self.tokenizer, "chat_template", None):
            try:
                return self.tokenizer.apply_chat_template(
                    [{"role": role, "content": content} for role, content in turns],
                    tokenize=False,
                    add_generation_prompt=True,
                )
            except Exception as exc:  # the template refused these turns (a jinja raise)
                raise InvalidRequestError(
                    f"the model's chat template failed on these messages: {exc}",
                    stage=self.name,
                    param="messages",
                    code="chat_template_failed",
                ) from exc
        # no chat template: the stage's prompt template over the user turns
        users = [content for role, content in turns if role == "user"]
        return self.template.format(prompt="\n".join(users))

    def validate(self, request: StageRequest) -> None:
        count = len(self.tokenizer(self._text(request)).input_ids)
        new = request.params.max_new_tokens or (
            1 if request.params.messages is not None else self.default_max_new
        )
        if count + new > self.context:
            raise InvalidRequestError(
                f"prompt is {count} tokens long; with {new} new tokens that exceeds the "
                f"model's context of {self.context}",
                stage=self.name,
                param="messages" if request.params.messages is not None else "prompt",
                code="prompt_too_long",
            )
        if request.params.guide is not None:
            self.guides.grammar(request.params.guide)  # an invalid constraint: 400 here

    def _caches_by_row(self) -> bool:
        """Whether the model's KV cache can be cut into rows (full attention in every layer):
        then its rows run as a running set; else each batch runs whole, as a set nothing joins
        (a cache that cannot be cut fails the request, not the load)."""
        probe = LLMRows(self)
        try:
            probe.set.join([("probe", [self.decoder.pad, self.decoder.pad], RowSampling(1))])
        except TypeError:
            return False
        return True

    def precision(self) -> str | None:
        return dtype_name(self.dtype)

    def stepped_modes(self) -> tuple[Mode, ...]:
        return (Mode.TEXT,) if self.steps_rows else ()

    def stepper(self, mode: Mode) -> RowStepper | None:
        return LLMRows(self) if mode in self.stepped_modes() else None

    def begin(self, batch: list[StageRequest], control: StageControl) -> Deferred:
        """The batch as a running set that nothing joins; each row's output goes out as it
        ends."""
        return run_whole(LLMRows(self), batch, control)

    def admit(self, request: StageRequest, control: StageControl) -> tuple[list[int], Any]:
        """The row's prompt tokens and its constraint (None without one)."""
        control.faults.fire("template", [request])
        text = self._text(request)
        control.faults.fire("tokenize", [request])
        ids = self.tokenizer(text).input_ids
        guide = request.params.guide or self.output_guide
        return ids, (self.guides.start(guide) if guide is not None else None)

    def output(self, r: StageRequest, res: RowResult) -> StageOutput:
        if res.error is not None:
            if is_fatal_device_error(res.error):
                raise res.error
            return StageOutput.from_error(r.request_id, res.error, self.name)
        text = res.text if r.params.messages is not None else res.text.strip()
        if self.options.outside_answer is not None and text.strip() == self.options.outside_answer:
            return StageOutput.from_error(r.request_id, self._outside(), self.name)
        return StageOutput(
            request_id=r.request_id,
            stage=self.name,
            text=text,
            token_ids=res.token_ids,
            finish_reason=res.finish_reason,
            prompt_tokens=res.prompt_tokens,
            completion_tokens=res.generated,
            logprobs=res.logprobs,
        )

    def sampling(self, request: StageRequest, guide: Any, prompt_tokens: int) -> RowSampling:
        """The row's settings. A chat row without max_tokens may use the rest of the context
        (as vLLM does); a prompt rewrite, the stage's max_new_tokens."""
        p = request.params
        default = self.default_max_new
        if p.messages is not None:
            default = max(1, self.context - prompt_tokens)
        return RowSampling(
            max_new_tokens=p.max_new_tokens or default,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            seed=p.seed,
            stop=tuple(p.stop),
            repetition_penalty=p.repetition_penalty,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            logprobs=p.logprobs,
            top_logprobs=p.top_logprobs,
            stream=p.stream_text,
            guide=guide,
        )

    def _outside(self) -> InvalidRequestError:
        return InvalidRequestError(
            self.options.outside_message or "the prompt names nothing this model draws",
            stage=self.name,
            param="prompt",
            code="prompt_outside_model_domain",
        )
