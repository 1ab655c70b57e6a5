#!/usr/bin/env bash
# The wheels the GPU machines of the device tool lack (their image has torch, transformers,
# huggingface_hub, httpx, numpy, pillow, psutil...; not diffusers, fastapi, uvicorn, pydantic,
# python-multipart, llguidance, ftfy), for CPython 3.12 on x86-64, into .whl/ (ignored: add
# `/.whl/` to .git/info/exclude). The versions are the ones CI installs; pip fetches no
# dependencies, so the list is the whole closure beyond what that image holds. `--video` adds
# imageio-ffmpeg 0.5.1 (its ffmpeg binary: 27 MB more; 0.8.1's wheel is 68 MB, past a call's
# 64 MiB carry, and the API the server calls is the same) for the runs that write MP4s; `--fp8` the
# `fp8` extra's torchao (3.4 MB: bench/fp8.py's reference; 0.18.0 serves torch 2.11 and 2.13).
# On the machine: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
#   --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
extra=()
for flag in "$@"; do
    case "$flag" in
        --video) extra+=(imageio-ffmpeg==0.5.1) ;;
        --fp8) extra+=(torchao==0.18.0) ;;
        *) echo "unknown flag $flag (--video, --fp8)" >&2; exit 2 ;;
    esac
done
platforms=()
for tag in manylinux_2_17 manylinux2014 manylinux1 manylinux_2_24 manylinux_2_27 manylinux_2_28 \
    manylinux_2_31; do
    platforms+=(--platform "${tag}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl \
    diffusers==0.42.1 fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic_core==2.46.4 \
    annotated-types==0.7.0 typing-inspection==0.4.2 uvicorn==0.54.0 python-multipart==0.0.34 \
    ftfy==6.3.1 wcwidth==0.7.0 httptools==0.9.0 llguidance==1.9.1 importlib_metadata==10.2.0 \
    opentelemetry-api==1.45.2 "${extra[@]}"
du -sh .whl
