"""The official openai SDK against `vllm-omni-like serve` (default host and port; or set
OPENAI_BASE_URL, e.g. http://127.0.0.1:8000/v1)."""

import base64
import os
import warnings

from openai import OpenAI

client = OpenAI(
    base_url=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
    api_key=os.environ.get("OPENAI_API_KEY", "unused-unless-configured"),
)

result = client.images.generate(prompt="red circle", size="64x64", n=2, extra_body={"seed": 7})
for i, item in enumerate(result.data):
    with open(f"image-{i}.png", "wb") as f:
        f.write(base64.b64decode(item.b64_json))
    print(f"image-{i}.png: revised prompt {getattr(item, 'revised_prompt', None)!r}")

for event in client.images.generate(prompt="blue square", stream=True, partial_images=2):
    print(event.type)

with warnings.catch_warnings():  # the SDK marks its Sora helpers deprecated: not this server
    warnings.filterwarnings("ignore", "The Sora API is scheduled", DeprecationWarning)
    video = client.videos.create_and_poll(prompt="a yellow square moving right", seconds="1")
    client.videos.download_content(video.id).write_to_file("clip.mp4")
print(video.status, video.progress, video.size, "clip.mp4")
