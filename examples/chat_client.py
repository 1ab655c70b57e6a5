"""Chat completions with the official openai SDK against `vllm-omni-like serve` (the default
`tiny-omni` pipeline; or set OPENAI_BASE_URL, e.g. http://127.0.0.1:8000/v1)."""

import base64
import json
import os

from openai import OpenAI

client = OpenAI(
    base_url=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
    api_key=os.environ.get("OPENAI_API_KEY", "unused-unless-configured"),
)
MODEL = "tiny-omni"  # a pipeline whose first stage is an LLM

answer = client.chat.completions.create(
    model=MODEL, messages=[{"role": "user", "content": "a red circle on white"}], temperature=0
)
print("answer:", answer.choices[0].message.content)
print("usage:", answer.usage.prompt_tokens, answer.usage.completion_tokens)

# streamed, token by token, with the usage in a last chunk
words = []
for chunk in client.chat.completions.create(
    model=MODEL,
    messages=[{"role": "user", "content": "a small blue square at the top"}],
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
):
    if chunk.choices:
        words.append(chunk.choices[0].delta.content or "")
    else:
        print("streamed:", "".join(words), "| tokens:", chunk.usage.completion_tokens)

# guided decoding: the answer is JSON that follows the schema
schema = {
    "type": "object",
    "properties": {"shape": {"enum": ["circle", "square"]}, "count": {"type": "integer"}},
    "required": ["shape", "count"],
    "additionalProperties": False,
}
guided = client.chat.completions.create(
    model=MODEL,
    messages=[{"role": "user", "content": "two circles"}],
    response_format={"type": "json_schema", "json_schema": {"name": "shapes", "schema": schema}},
    max_tokens=40,
)
print("json:", json.loads(guided.choices[0].message.content))

# the text and the image the pipeline draws from it (content parts, a PNG data URL)
drawn = client.chat.completions.create(
    model=MODEL,
    messages=[{"role": "user", "content": "a green triangle on black"}],
    modalities=["text", "image"],
    temperature=0,
)
text, image = drawn.choices[0].message.content
with open("chat-image.png", "wb") as f:
    f.write(base64.b64decode(image["image_url"]["url"].split(",", 1)[1]))
print("drew:", text["text"], "-> chat-image.png")
