"""Offline generation from Python: the same engine path as the server, no HTTP.

python examples/offline_batch.py
"""

from vllm_omni_like import (
    EngineConfig,
    GenerationParams,
    Omni,
    OmniRequest,
    encode_image,
    new_request_id,
    resolve_pipeline,
)

if __name__ == "__main__":  # worker processes are spawned: keep the entry point guarded
    config = EngineConfig(pipelines=tuple(resolve_pipeline("tiny-omni")))
    prompts = ["red circle", "blue square at the top left", "green triangle"]
    with Omni(config) as omni:
        outputs = omni.generate(
            OmniRequest(new_request_id(), p, "tiny-omni", GenerationParams(seed=i))
            for i, p in enumerate(prompts)
        )
    for i, out in enumerate(outputs):
        if out.error is not None:
            print(f"{prompts[i]!r}: failed: {out.error.message}")
            continue
        path = f"offline-{i}.png"
        with open(path, "wb") as f:
            f.write(encode_image(out.result.images[0].pixels))
        print(f"{prompts[i]!r} -> {path} (revised prompt: {out.revised_prompt!r})")
