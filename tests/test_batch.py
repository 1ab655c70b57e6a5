"""The offline batch command, end to end on null pipelines (real workers)."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest
from PIL import Image

from vllm_omni_like.batch import BatchRunner, parse_line, read_lines, run_batch
from vllm_omni_like.cli import main
from vllm_omni_like.config import EngineConfig, Limits
from vllm_omni_like.engine import AsyncOmni
from vllm_omni_like.pipelines.catalog import resolve
from vllm_omni_like.video_codec import read_video

LINES = [
    {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/images/generations",
        "body": {"prompt": "a red circle", "seed": 1, "n": 2, "size": "32x16"},
    },
    {"prompt": "a blue square", "seed": 2, "output_format": "jpeg"},
    {"custom_id": "bad-size", "prompt": "x", "size": "99999x64"},
    {"custom_id": "unknown-field", "prompt": "x", "colour": "red"},
    {"custom_id": "bad-scheduler", "prompt": "x", "scheduler": "euler-a"},
    {"custom_id": "fault", "prompt": "x @fail"},
    {
        "custom_id": "v",
        "method": "POST",
        "url": "/v1/videos",
        "body": {"prompt": "a square moving left", "seed": 3, "num_frames": 6},
    },
]


def _write(path, lines, extra=""):
    with open(path, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
        f.write(extra)


def _results(out):
    with open(os.path.join(out, "results.jsonl")) as f:
        return {r["custom_id"]: r for r in map(json.loads, f)}


def test_parse_line_variants():
    line = parse_line(1, json.dumps(LINES[0]), "image")
    assert (line.custom_id, line.kind, line.body["n"]) == ("a", "image", 2)
    assert parse_line(2, "{nope", "image").error.message.startswith("invalid JSON")
    wrong = parse_line(3, json.dumps({"url": "/v1/chat/completions", "body": {}}), "image")
    assert "url must be POST one of" in wrong.error.message
    assert parse_line(4, json.dumps({"prompt": "x"}), "video").kind == "video"


def test_generate_writes_files_and_per_line_results(tmp_path, monkeypatch):
    monkeypatch.setenv(
        "VLLM_OMNI_LIKE_FAULTS", "stage=diffusion,point=execute,kind=raise,match=@fail"
    )
    src, out = tmp_path / "in.jsonl", str(tmp_path / "out")
    _write(src, LINES, extra="not json\n\n")
    args = ["generate", "null-omni", "null-video", "--input", str(src), "--output-dir", out]
    assert main(args) == 1  # some lines failed
    res = _results(out)
    assert set(res) == {
        "a",
        "line-2",
        "bad-size",
        "unknown-field",
        "bad-scheduler",
        "fault",
        "v",
        "line-8",
    }
    ok = res["a"]["response"]
    assert ok["status_code"] == 200 and ok["body"]["output_format"] == "png"
    files = [d["file"] for d in ok["body"]["data"]]
    assert [d["seed"] for d in ok["body"]["data"]] == [1, 2]
    for f in files:
        with Image.open(f) as image:
            assert image.size == (32, 16)
    assert res["line-2"]["response"]["body"]["data"][0]["file"].endswith(".jpeg")
    assert read_video(res["v"]["response"]["body"]["file"]).shape[0] == 9  # rounded to 4k+1
    bad = res["bad-size"]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "size"
    unknown = res["unknown-field"]["response"]["body"]["error"]
    assert unknown["message"] == "colour: Extra inputs are not permitted"
    scheduler = res["bad-scheduler"]["response"]  # (a null model runs no named scheduler)
    assert scheduler["status_code"] == 400 and scheduler["body"]["error"]["param"] == "scheduler"
    assert scheduler["body"]["error"]["message"] == (
        "scheduler 'euler-a' is not one null-omni runs; it runs: none: only its own"
    )
    fault = res["fault"]["response"]
    assert fault["status_code"] == 500 and fault["body"]["error"]["stage"] == "diffusion"
    assert res["line-8"]["response"]["body"]["error"]["message"].startswith("invalid JSON")

    # --resume: successes are kept and not run again; failures run again
    before = os.path.getmtime(files[0])
    monkeypatch.delenv("VLLM_OMNI_LIKE_FAULTS")
    assert main([*args, "--resume", "--allow-failures"]) == 0
    again = _results(out)
    assert again["a"] == res["a"] and os.path.getmtime(files[0]) == before
    assert again["fault"]["response"]["status_code"] == 200
    assert again["bad-size"]["response"]["status_code"] == 400


def test_a_malformed_line_fails_alone_and_output_names_never_collide(tmp_path):
    src, out = tmp_path / "in.jsonl", str(tmp_path / "out")
    lines = [
        {"url": "/v1/images/generations", "body": ["prompt"]},  # body is not an object
        {"custom_id": "a/b", "prompt": "one", "seed": 1},
        {"custom_id": "a_b", "prompt": "two", "seed": 2},
        {"custom_id": "line-5", "prompt": "a user's id that looks generated", "seed": 3},
        {"prompt": "line 5 without an id", "seed": 4},
        {"custom_id": "A_B", "prompt": "three", "seed": 5},
    ]
    _write(src, lines)
    assert main(["generate", "null-image", "--input", str(src), "--output-dir", out]) == 1
    res = _results(out)
    assert set(res) == {"line-1", "a/b", "a_b", "line-5", "line-5-1", "A_B"}
    bad = res["line-1"]["response"]
    assert bad["status_code"] == 400
    assert bad["body"]["error"]["message"] == "body must be a JSON object, not list"
    files = {
        cid: r["response"]["body"]["data"][0]["file"] for cid, r in res.items() if cid != "line-1"
    }
    assert len({f.lower() for f in files.values()}) == 5  # unique, also case-insensitively
    assert os.path.basename(files["a_b"]) == "a_b-0.png"  # a safe, free id keeps its name
    for cid, path in files.items():
        assert os.path.dirname(path) == out and os.path.isfile(path), (cid, path)
    assert res["line-5-1"]["response"]["status_code"] == 200
    assert res["line-5"]["response"]["body"]["data"][0]["seed"] == 3  # the user's line


def test_a_missing_input_fails_before_any_model_loads(tmp_path, capsys):
    out = tmp_path / "out"
    started = time.monotonic()
    code = main(
        [
            "generate",
            "tiny-omni",
            "--input",
            str(tmp_path / "missing.jsonl"),
            "--output-dir",
            str(out),
        ]
    )
    assert code == 2
    assert time.monotonic() - started < 3  # loading tiny-omni's workers alone takes longer
    assert capsys.readouterr().err == (
        f"error: --input {tmp_path / 'missing.jsonl'}: No such file or directory\n"
    )
    assert not out.exists()


def test_the_offline_runs_requests_are_counted_once_their_files_are_written(tmp_path, monkeypatch):
    """The engine records a stored output's success once the command says its files are whole
    (a video's too), and a failed write as an error: the final statuses sum to the total."""
    write = BatchRunner._write

    def write_or_fail(self, line, output):
        if line.custom_id == "full-disk":
            raise OSError(28, "No space left on device")
        return write(self, line, output)

    monkeypatch.setattr(BatchRunner, "_write", write_or_fail)
    src, out = tmp_path / "in.jsonl", str(tmp_path / "out")
    video = {"url": "/v1/videos", "body": {"prompt": "a square", "num_frames": 6}}
    _write(src, [{"custom_id": "img", "prompt": "a circle"}, {"custom_id": "vid", **video}])
    _write(tmp_path / "more.jsonl", [{"custom_id": "full-disk", "prompt": "x"}])
    lines = read_lines(str(src), "image")
    lines += read_lines(str(tmp_path / "more.jsonl"), "image")
    pipelines = (*resolve("null-image"), *resolve("null-video"))
    e = AsyncOmni(EngineConfig(pipelines=pipelines))
    e.start()
    try:
        ran, failed = asyncio.run(run_batch(e, lines, out, Limits(), resume=False))
        assert (ran, failed) == (3, 1)
        disk = _results(out)["full-disk"]["response"]
        assert disk["status_code"] == 500 and disk["body"]["error"]["code"] == "storage_error"
        assert disk["body"]["error"]["message"] == (
            "the output was made but could not be stored: No space left on device"
        )
        snap = e.stats.snapshot()
        assert snap["requests_total"] == 3
        assert snap["final"]["success"] == 2 and snap["final"]["error"] == 1, snap
        assert len(e.orchestrator.ledger) == 0  # no id left in the engine
    finally:
        e.shutdown()


@pytest.mark.slow
def test_a_video_line_starts_from_its_input_reference_file(tmp_path):
    """`input_reference` in a video line: an image file's path; the video takes its aspect
    (2:1 at the model's 64x64 area: 96x48); a file that cannot be read fails its line alone."""
    from tests.models.tiny_wan22 import tiny_wan22_ti2v_path

    image = tmp_path / "first.png"
    Image.new("RGB", (64, 32), (200, 10, 10)).save(image)
    src, out = tmp_path / "in.jsonl", str(tmp_path / "out")
    body = {"prompt": "x", "num_frames": 5, "num_inference_steps": 2, "seed": 1}
    missing = str(tmp_path / "nope.png")
    _write(
        src,
        [
            {
                "custom_id": "i2v",
                "url": "/v1/videos",
                "body": {**body, "input_reference": str(image)},
            },
            {
                "custom_id": "missing",
                "url": "/v1/videos",
                "body": {**body, "input_reference": missing},
            },
            {"custom_id": "t2v", "url": "/v1/videos", "body": body},
        ],
    )
    lines = read_lines(str(src), "video")
    pipelines = tuple(resolve(tiny_wan22_ti2v_path(), options={"default_size": 64}))
    e = AsyncOmni(EngineConfig(pipelines=pipelines))
    e.start()
    try:
        ran, failed = asyncio.run(run_batch(e, lines, out, Limits(), resume=False))
    finally:
        e.shutdown()
    assert (ran, failed) == (3, 1)
    error = _results(out)["missing"]["response"]
    assert error["status_code"] == 400
    assert error["body"]["error"]["message"] == (
        f"input_reference {missing!r} cannot be read: No such file or directory"
    )
    assert read_video(os.path.join(out, "i2v.mp4")).shape == (5, 48, 96, 3)
    assert read_video(os.path.join(out, "t2v.mp4")).shape == (5, 64, 64, 3)
