"""The official openai SDK against `vllm-omni-like serve` (default host and port)."""

import base64
import warnings

from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused-unless-configured")

result = client.images.generate(prompt="red circle", size="64x64", n=2, extra_body={"seed": 7})
for i, item in enumerate(result.data):
    with open(f"image-{i}.png", "wb") as f:
        f.write(base64.b64decode(item.b64_json))
    print(f"image-{i}.png: revised prompt {getattr(item, 'revised_prompt', None)!r}")

for event in client.images.generate(prompt="blue square", stream=True, partial_images=2):
    print(event.type)

with warnings.catch_warnings():  # the SDK marks its Sora helpers deprecated
    warnings.simplefilter("ignore", DeprecationWarning)
    video = client.videos.create_and_poll(prompt="a yellow square moving right", seconds="1")
print(video.status, video.progress)
client.videos.download_content(video.id).write_to_file("clip.mp4")
