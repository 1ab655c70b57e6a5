"""What a pipeline is: a chain of stages, and how one stage's output feeds the next."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_omni_like.config import PipelineConfig, StageConfig
from vllm_omni_like.inputs import OmniRequest
from vllm_omni_like.outputs import StageOutput
from vllm_omni_like.wire import Mode, StageRequest


def _writes_text(stage: StageConfig) -> bool:
    return stage.kind == "llm" or (stage.kind == "null" and stage.options.output == "text")


@dataclass(frozen=True)
class Pipeline:
    config: PipelineConfig

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def stages(self) -> tuple[StageConfig, ...]:
        return self.config.stages

    def _mode(self, index: int, request: OmniRequest) -> Mode:
        if _writes_text(self.stages[index]):
            return Mode.TEXT
        if self.config.output == "video":
            return Mode.IMAGE2VIDEO if request.images else Mode.TEXT2VIDEO
        return Mode.EDIT if request.images else Mode.TEXT2IMG

    def stage_request(
        self, request: OmniRequest, index: int, previous: StageOutput | None
    ) -> StageRequest:
        """The input of stage `index`: the user's request, or what the stage before wrote."""
        prompt, rewritten = request.prompt, False
        if previous is not None and previous.text:
            prompt, rewritten = previous.text, True  # an LLM's text becomes the next prompt
        return StageRequest(
            request_id=request.request_id,
            prompt=prompt,
            params=request.params,
            mode=self._mode(index, request),
            images=request.images,
            mask=request.mask,
            truncate_prompt=rewritten,
            client_id=request.client_id,
            files_only=request.files_only,
            encodes_png=request.encodes_png,
        )

    @staticmethod
    def revised_prompt(outputs: dict[str, StageOutput]) -> str | None:
        texts = [o.text for o in outputs.values() if o.text]
        return texts[-1] if texts else None
