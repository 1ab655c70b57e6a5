"""Offline batch: JSONL in (OpenAI Batch lines or plain objects), files and results JSONL out."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from tqdm import tqdm

from vllm_omni_like.config import Limits
from vllm_omni_like.engine import AsyncOmni, new_request_id
from vllm_omni_like.errors import InvalidRequestError, OmniError
from vllm_omni_like.inputs import OmniRequest
from vllm_omni_like.media import decode_upload
from vllm_omni_like.outputs import OmniRequestOutput
from vllm_omni_like.protocol.envelope import envelope
from vllm_omni_like.protocol.requests import image_items, image_request, video_request
from vllm_omni_like.protocol.schemas import ImageRequest, VideoRequest
from vllm_omni_like.video_codec import write_video

URLS = {"/v1/images/generations": "image", "/v1/videos": "video"}
RESULTS_FILE = "results.jsonl"
logger = logging.getLogger(__name__)


@dataclass
class Line:
    number: int
    custom_id: str | None  # None: the line gave none (read_lines names it)
    kind: str | None = None  # image | video
    body: dict[str, Any] | None = None
    error: OmniError | None = None
    stem: str = ""  # output files are <stem>.png, <stem>-1.png, ... (unique in the run)


def parse_line(number: int, text: str, default_kind: str) -> Line:
    """One input line -> a Line; a bad line carries its error instead of a body."""
    custom_id = None
    try:
        obj = json.loads(text)
        if not isinstance(obj, dict):
            raise InvalidRequestError("a line must be a JSON object")
        if obj.get("custom_id") is not None:
            custom_id = str(obj["custom_id"])
        if "body" in obj or "url" in obj:
            extra = set(obj) - {"custom_id", "method", "url", "body"}
            if extra:
                raise InvalidRequestError(f"unknown batch fields {sorted(extra)}")
            if obj.get("method", "POST") != "POST" or obj.get("url") not in URLS:
                raise InvalidRequestError(f"url must be POST one of {sorted(URLS)}", param="url")
            body = obj.get("body")
            if not isinstance(body, dict):
                raise InvalidRequestError(
                    f"body must be a JSON object, not {type(body).__name__}", param="body"
                )
            return Line(number, custom_id, URLS[obj["url"]], dict(body))
        obj.pop("custom_id", None)
        return Line(number, custom_id, default_kind, obj)
    except json.JSONDecodeError as exc:
        return Line(number, custom_id, error=InvalidRequestError(f"invalid JSON: {exc}"))
    except OmniError as exc:
        return Line(number, custom_id, error=exc)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:100].lstrip(".") or "_"


def file_stem(custom_id: str, taken: set[str]) -> str:
    """A file name for `custom_id`'s outputs: its own where it is safe and free, else with a
    digest of the id, so two ids never share a file (also on case-insensitive disks)."""
    stem = _safe(custom_id)
    if stem != custom_id or stem.lower() in taken:
        stem = f"{stem[:80]}-{hashlib.sha256(custom_id.encode()).hexdigest()[:10]}"
    while stem.lower() in taken:  # an id that looks like another's digest name
        stem += "_"
    taken.add(stem.lower())
    return stem


def _result(line: Line, status: int, body: dict[str, Any], request_id: str) -> dict[str, Any]:
    return {
        "id": f"batch_req_{uuid.uuid4().hex[:24]}",
        "custom_id": line.custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }


def _error_body(exc: OmniError, request_id: str) -> dict[str, Any]:
    return envelope(exc.info, request_id)


class BatchRunner:
    def __init__(
        self, engine: AsyncOmni, out_dir: str, limits: Limits, concurrency: int = 16
    ) -> None:
        self.engine = engine
        self.out_dir = out_dir
        self.limits = limits
        self.concurrency = concurrency

    async def run_line(self, line: Line) -> dict[str, Any]:
        request_id = new_request_id()
        try:
            if line.error is not None:
                raise line.error
            request = self._request(line, request_id)
            output = await self.engine.generate_final(request)
            if output.error is not None:
                raise output.error.error()
            write = asyncio.to_thread(self._write, line, output)
            body = await self.engine.store(request, write, "output")
            return _result(line, 200, body, request_id)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            bad = InvalidRequestError(f"{where}: {err['msg']}", param=where)
            return _result(line, 400, _error_body(bad, request_id), request_id)
        except OmniError as exc:
            return _result(line, exc.status, _error_body(exc, request_id), request_id)
        except Exception as exc:  # a line that breaks our code fails alone, not the run
            logger.exception("line %d (%s) failed", line.number, line.custom_id)
            broken = OmniError(f"internal error: {type(exc).__name__}: {exc}")
            return _result(line, broken.status, _error_body(broken, request_id), request_id)

    def _request(self, line: Line, request_id: str) -> OmniRequest:
        """The line's request; the command writes its files (its success counts once they are)."""
        if line.body is None:  # (a line that failed to parse never runs)
            raise ValueError(f"line {line.number} has no request")
        if line.kind == "video":
            fields = dict(line.body)
            path = fields.pop("input_reference", None)  # a first frame: a local image file
            images = None if path is None else [self._image(path)]
            video = VideoRequest(**fields)
            return video_request(self.engine, video, self.limits, request_id, images)
        body = ImageRequest(**line.body)
        if body.stream:
            raise InvalidRequestError("stream is not supported offline", param="stream")
        return image_request(self.engine, body, self.limits, request_id, stores_output=True)

    def _image(self, path: Any) -> Any:
        """A line's input_reference: a PNG, JPEG or WebP file's path (absolute, or relative to
        the directory the command runs in), under the server's upload limits."""
        if not isinstance(path, str):
            raise InvalidRequestError(
                "input_reference must be an image file's path", param="input_reference"
            )
        try:
            with open(path, "rb") as f:
                data = f.read(self.limits.max_upload_bytes + 1)
        except OSError as exc:
            raise InvalidRequestError(
                f"input_reference {path!r} cannot be read: {exc.strerror}",
                param="input_reference",
            ) from None
        return decode_upload(
            data, self.limits.max_upload_bytes, self.limits.max_upload_pixels, "input_reference"
        )

    def _write(self, line: Line, output: OmniRequestOutput) -> dict[str, Any]:
        stem = os.path.join(self.out_dir, line.stem)
        video = output.result.video
        if video is not None:
            path = stem + ".mp4"
            if video.mp4 is not None:  # encoded by the stage while it decoded
                with open(path, "wb") as f:
                    f.write(video.mp4)
            else:
                write_video(video.frames, video.fps, path)
            return {
                "created": int(time.time()),
                "file": path,
                "seed": video.seed,
                "revised_prompt": output.revised_prompt,
            }
        body = ImageRequest(**(line.body or {}))
        items = image_items(output, body.output_format, body.output_compression, as_b64=False)
        data = []
        for i, item in enumerate(items):
            path = f"{stem}-{i}.{body.output_format}"
            with open(path, "wb") as f:
                f.write(item.pop("bytes"))
            data.append({"file": path, **item})
        return {"created": int(time.time()), "data": data, "output_format": body.output_format}

    async def run(self, lines: list[Line], results_path: str, progress: tqdm) -> int:
        """Run every line; append each result as it ends; return how many failed."""
        gate = asyncio.Semaphore(self.concurrency)
        failed = 0

        async def one(line: Line) -> None:
            nonlocal failed
            async with gate:
                result = await self.run_line(line)
            with open(results_path, "a") as f:
                f.write(json.dumps(result) + "\n")
            failed += result["response"]["status_code"] != 200
            progress.update(1)

        await asyncio.gather(*(one(line) for line in lines))
        return failed


def load_done(results_path: str) -> dict[str, str]:
    """custom_id -> its successful result line, from an earlier run (for --resume)."""
    done: dict[str, str] = {}
    if not os.path.exists(results_path):
        return done
    with open(results_path) as f:
        for raw in f:
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash: run it again
            if obj.get("response", {}).get("status_code") == 200:
                done[obj["custom_id"]] = raw if raw.endswith("\n") else raw + "\n"
    return done


def read_lines(path: str, default_kind: str) -> list[Line]:
    """Every line of `path` (OSError if it cannot be read). Lines without a custom_id get
    `line-N`, or `line-N-K` where a user's id already is `line-N`."""
    with open(path) as f:
        texts = [(n, t) for n, t in enumerate(f, start=1) if t.strip()]
    lines = [parse_line(number, text, default_kind) for number, text in texts]
    given = {line.custom_id for line in lines if line.custom_id is not None}
    seen: set[str] = set()
    stems: set[str] = set()
    for line in lines:
        if line.custom_id is None:
            name, k = f"line-{line.number}", 0
            while name in given:
                k += 1
                name = f"line-{line.number}-{k}"
            line.custom_id = name
            given.add(name)
        elif line.custom_id in seen and line.error is None:
            line.error = InvalidRequestError(f"duplicate custom_id {line.custom_id!r}")
        seen.add(line.custom_id)
        line.stem = file_stem(line.custom_id, stems)
    return lines


async def run_batch(
    engine: AsyncOmni,
    lines: list[Line],
    out_dir: str,
    limits: Limits,
    resume: bool,
    concurrency: int = 16,
) -> tuple[int, int]:
    """Run the lines (read before the engine started); returns (lines run, lines failed)."""
    os.makedirs(out_dir, exist_ok=True)
    results_path = os.path.join(out_dir, RESULTS_FILE)
    done = load_done(results_path) if resume else {}
    with open(results_path, "w") as f:  # keep earlier successes; failures run again
        f.writelines(done.values())
    todo = [line for line in lines if line.custom_id not in done]
    runner = BatchRunner(engine, out_dir, limits, concurrency)
    with tqdm(total=len(lines), initial=len(lines) - len(todo), unit="req") as progress:
        failed = await runner.run(todo, results_path, progress)
    return len(todo), failed
