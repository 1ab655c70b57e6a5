#!/usr/bin/env bash
# Against `vllm-omni-like serve` on the default port. Needs curl, jq and base64.
set -euo pipefail
BASE=${BASE:-http://127.0.0.1:8000}

curl -sf "$BASE/health" | jq .
curl -sf "$BASE/v1/models" | jq '.data[].id'

# an image, written to disk
curl -sf "$BASE/v1/images/generations" -H 'content-type: application/json' \
  -d '{"prompt": "red circle", "size": "64x64", "seed": 7}' \
  | jq -r '.data[0].b64_json' | base64 -d > circle.png

# streaming: partial images from intermediate steps, then the completed image
curl -sN "$BASE/v1/images/generations" -H 'content-type: application/json' \
  -d '{"prompt": "blue square", "stream": true, "partial_images": 2}' | cut -c1-120

# an edit: transparent pixels of the mask mark the region to repaint
curl -sf "$BASE/v1/images/edits" -F image=@circle.png -F prompt='green triangle' \
  | jq -r '.data[0].b64_json' | base64 -d > edited.png

# a video job: create, poll, download
id=$(curl -sf "$BASE/v1/videos" -F prompt='a yellow square moving right' -F seconds=1 | jq -r .id)
until [ "$(curl -sf "$BASE/v1/videos/$id" | jq -r .status)" = completed ]; do sleep 0.2; done
curl -sf "$BASE/v1/videos/$id/content" -o clip.mp4
curl -sf "$BASE/v1/videos/$id/content?variant=thumbnail" -o thumb.png
