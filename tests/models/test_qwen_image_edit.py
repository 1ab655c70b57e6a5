"""Qwen-Image-Edit beyond the contract suite: the template prefix its pipeline cuts is 64 tokens
of the synthesized tokenizer, the processor expands each image's pad as Qwen2VLProcessor does,
and over HTTP it edits through /v1/images/edits (the openai SDK), refuses a generation, a
strength and a mask with a 400 that says why, and keeps the upload's aspect for its image; the
stage pads its texts to their text bucket."""

from __future__ import annotations

import base64
import inspect
import io
import re
import time

import numpy as np
import openai
import pytest
from PIL import Image

from tests.api.conftest import live_server
from tests.models.tiny_qwen import tiny_qwen_image_edit_path
from vllm_omni_like.models.chat_tokenizer import build_chat_tokenizer
from vllm_omni_like.models.qwen_image.vl_processor import (
    IMAGE_TOKEN,
    VisionTextProcessor,
    expand_image_tokens,
)

pytestmark = pytest.mark.slow
UPLOAD = (np.indices((48, 80)).sum(0) * 5 % 256).astype(np.uint8)[..., None].repeat(3, -1)


def _png(array: np.ndarray, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array, mode).save(buf, format="PNG")
    return buf.getvalue()


def test_the_template_prefix_the_pipeline_cuts_is_its_system_prompt():
    from diffusers import QwenImageEditPipeline

    source = inspect.getsource(QwenImageEditPipeline.__init__)
    template = re.search(r'prompt_template_encode = "(.*)"', source).group(1)
    template = template.encode().decode("unicode_escape")
    cut = int(re.search(r"prompt_template_encode_start_idx = (\d+)", source).group(1))
    tokenizer = build_chat_tokenizer()
    prefix = template[: template.index("<|vision_start|>")]
    assert cut == 64 and len(tokenizer(prefix).input_ids) == cut
    prompt = template.format("make the circle red")
    tokens = tokenizer.convert_ids_to_tokens(tokenizer(prompt).input_ids)
    assert tokens[cut : cut + 3] == ["<|vision_start|>", IMAGE_TOKEN, "<|vision_end|>"]
    assert tokens[cut + 3 : cut + 7] == ["make", "the", "circle", "red"]
    assert "<unk>" not in tokens  # its words are all known


def test_the_processor_gives_each_image_its_patches():
    processor = VisionTextProcessor.load(f"{tiny_qwen_image_edit_path()}/processor")
    images = [Image.fromarray(UPLOAD), Image.fromarray(UPLOAD[:28, :28])]
    texts = [f"<|vision_start|>{IMAGE_TOKEN}<|vision_end|>edit {i}" for i in range(2)]
    out = processor(text=texts, images=images, padding=True, return_tensors="pt")
    grids = out["image_grid_thw"].tolist()
    assert grids[1] == [1, 2, 2]  # 28x28: 2x2 patches of 14, merged 2x2 into one token
    pad = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    counts = (out["input_ids"] == pad).sum(dim=1).tolist()
    assert counts == [g[0] * g[1] * g[2] // 4 for g in grids]
    assert out["pixel_values"].shape[0] == sum(g[0] * g[1] * g[2] for g in grids)
    with pytest.raises(ValueError, match="more images"):
        expand_image_tokens(["no image here"], [1])
    with pytest.raises(ValueError, match=r"more <\|image_pad\|>"):
        expand_image_tokens([IMAGE_TOKEN * 2], [1])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(
        tmp_path_factory,
        tiny_qwen_image_edit_path(),
        stage_kw={"options": {"default_size": 64}},
    ) as s:
        yield s


@pytest.mark.drill  # (~13 s; the contract runs its edit, tests/api every edit route)
def test_edits_by_instruction_over_http(server):
    client = server.client()
    model = client.models.retrieve(client.models.list().data[0].id).model_dump()
    assert model["limits"]["needs_image"] is True and model["limits"]["edit_strength"] is False
    upload = ("a.png", _png(UPLOAD), "image/png")
    body = {"seed": 5, "num_inference_steps": 2}
    res = client.images.edit(image=upload, prompt="make it red", extra_body=body)
    out = np.asarray(Image.open(io.BytesIO(base64.b64decode(res.data[0].b64_json))))
    assert out.shape == (32, 64, 3)  # the upload's 80x48 down to the tiny model's multiple, 32
    again = client.images.edit(image=upload, prompt="make it red", extra_body=body)
    assert again.data[0].b64_json == res.data[0].b64_json  # the seed decides it
    other = client.images.edit(image=upload, prompt="make it blue", extra_body=body)
    assert other.data[0].b64_json != res.data[0].b64_json  # the instruction counts


def test_what_it_cannot_do_is_a_400_that_says_why(server):
    client = server.client()
    name = client.models.list().data[0].id
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as exc:
        client.images.generate(prompt="a red circle", model=name)
    assert time.monotonic() - started < 2.0  # refused at admission
    err = exc.value.body
    assert (err["param"], err["code"]) == ("model", "image_required")
    assert err["message"] == f"{name} edits an input image: send it one through /v1/images/edits"
    upload = ("a.png", _png(UPLOAD), "image/png")
    with pytest.raises(openai.BadRequestError) as exc:
        client.images.edit(image=upload, prompt="x", extra_body={"strength": 0.5})
    err = exc.value.body
    assert (err["param"], err["message"]) == (
        "strength",
        f"{name} edits by instruction and takes no strength",
    )
    mask = np.zeros((48, 80, 4), np.uint8)
    with pytest.raises(openai.BadRequestError) as exc:
        client.images.edit(
            image=upload, mask=("m.png", _png(mask, "RGBA"), "image/png"), prompt="x"
        )
    assert "this model's edits take no mask" in exc.value.body["message"]
    snap = server.engine.stats.snapshot()
    assert sum(snap["final"].values()) == snap["requests_total"]  # nothing left behind


def test_the_stages_edit_texts_are_padded_to_their_text_bucket():
    """Prompts of two lengths with the same upload reach the transformer at one length (their
    text bucket), each with its own tokens unmasked: a compiled transformer sees one shape."""
    import torch

    from vllm_omni_like.config import StageConfig
    from vllm_omni_like.models.text_buckets import text_bucket
    from vllm_omni_like.stages.diffusion.stage import DiffusionStage

    config = StageConfig(name="diffusion", kind="diffusion", model=tiny_qwen_image_edit_path())
    stage = DiffusionStage(config)
    stage.load("cpu")
    pipe = stage.runtime.edit_pipes["edit"]
    image = [Image.new("RGB", (64, 48), (90, 30, 200))]
    shapes, counts = set(), []
    with torch.inference_mode():
        for prompt in ("make it red", "make the circle red and the square a pale blue"):
            embeds, mask = pipe.encode_prompt(prompt=[prompt], image=image, device="cpu")
            shapes.add((embeds.shape[1], mask.shape[1]))
            counts.append(int(mask.sum()))
            assert mask[0, : counts[-1]].all() and not mask[0, counts[-1] :].any()
            assert not embeds[0, counts[-1] :].any()  # (masked zeros)
    assert counts[0] < counts[1] and shapes == {(text_bucket(counts[1]),) * 2}


def _vision_inputs(text_encoder) -> tuple[list, object]:
    """What Qwen2.5-VL is handed, image by image: its grid (T, H, W patches) and patches."""
    seen: list = []

    def record(module, args, kwargs):
        grids = kwargs["image_grid_thw"]
        patches = kwargs["pixel_values"].split(grids.prod(dim=1).tolist())
        seen.extend(zip(grids.tolist(), patches, strict=True))

    return seen, text_encoder.register_forward_pre_hook(record, with_kwargs=True)


@pytest.mark.drill  # (Qwen2.5-VL over two uploads and the pipeline: ~24 s; the contract edits)
def test_the_vision_encoder_reads_the_upload_fitted_as_the_pipelines_single_image_call():
    """Rows of small uploads (40x24 and 24x40: Qwen2.5-VL would read each as one merged patch)
    of another size than the output (64x64), two in one batch and one of another size (its own
    batch: the batching key): each row is what `QwenImageEditPipeline(image=<its upload>)` makes
    at its seed, and Qwen2.5-VL reads the same patches of the image that call fits to about a
    megapixel (here 1312x800 or 800x1312: 2x4 or 4x2 patches within the processor's limits)."""
    import torch

    from tests.models.test_family_contract import STEPS, _pixels, case_of
    from vllm_omni_like.params import GenerationParams
    from vllm_omni_like.stages.base import StageControl
    from vllm_omni_like.stages.faults import FaultInjector
    from vllm_omni_like.wire import StageRequest

    case = case_of("qwen-image-edit")
    batches = [[UPLOAD[:24, :40], UPLOAD[24:, 40:][::-1]], [UPLOAD[:40, :24]]]
    stage, pipe = case.stage(), case.pipeline()
    params = GenerationParams(seed=7, num_inference_steps=STEPS, width=64, height=64)
    got, hook = _vision_inputs(stage.runtime.pipe.text_encoder)
    outs = []
    with hook:
        for uploads in batches:
            batch = [
                StageRequest(f"r{len(outs)}{i}", "a red circle", params, "edit", [u])
                for i, u in enumerate(uploads)
            ]
            outs += stage.execute(batch, StageControl(FaultInjector((), "diffusion")))
    want, hook = _vision_inputs(pipe.text_encoder)
    rows = [u for uploads in batches for u in uploads]
    with hook:
        for out, upload in zip(outs, rows, strict=True):
            assert out.error is None, out.error
            one = case.call(
                pipe,
                image=Image.fromarray(upload),
                width=64,
                height=64,
                generator=[torch.Generator().manual_seed(7)],
            )
            diff = out.images[0].pixels.astype(int) - _pixels(case, one).astype(int)
            assert np.abs(diff).max() <= 1
    # each row's prompt then negative prompt (a batch reads its rows' prompts, then negatives)
    got = [got[i] for i in (0, 2, 1, 3, 4, 5)]
    assert [grid for grid, _ in got] == [grid for grid, _ in want]
    assert [grid for grid, _ in want] == [[1, 2, 4]] * 4 + [[1, 4, 2]] * 2  # not [1, 2, 2]
    assert all(torch.equal(g, w) for (_, g), (_, w) in zip(got, want, strict=True))


def test_an_edit_that_joins_a_busy_set_of_edits_at_step_k_makes_what_it_makes_alone(monkeypatch):
    """Our loop's instruction edits: rows of one upload shape and output size share a shape
    group and a forward; an edit joins at a step boundary with texts of its own (its prompt and
    negative prompt read with its own upload: b, a's prompt with another upload of a's shape,
    has its own text rows) and its upload's latents, put after its noise's tokens; each image
    is the one it makes alone. (Uploads fit to about 128x128 here, not a megapixel: a CPU's
    speed.)"""
    import torch

    from tests.models.test_family_contract import case_of
    from tests.stages.diffusion.test_running_set import _Harness
    from vllm_omni_like.models.qwen_image import edit
    from vllm_omni_like.params import GenerationParams
    from vllm_omni_like.wire import Mode, StageRequest

    monkeypatch.setattr(edit, "FITTED_AREA", 128 * 128)
    stage = case_of("qwen-image-edit").stage()
    assert stage.runtime.loops[Mode.EDIT] == ("own", None)

    def request(rid: str, steps: int, upload: np.ndarray, prompt: str = "make it red", **more):
        params = GenerationParams(seed=3, num_inference_steps=steps, width=64, height=32, **more)
        return StageRequest(rid, prompt, params, "edit", [upload])

    a = request("a", 4, UPLOAD)
    b = request("b", 4, np.random.default_rng(0).integers(0, 256, UPLOAD.shape, np.uint8))
    c = request(
        "c", 3, UPLOAD, "make the circle a pale blue and the square red", guidance_scale=1.0
    )
    own = frozenset(stage.runtime.own)
    assert a.batch_key(own) == b.batch_key(own) == c.batch_key(own)
    assert request("d", 3, UPLOAD[:40]).batch_key(own) != a.batch_key(own)  # (another fit)
    alone = {}
    for r in (a, b, c):
        h = _Harness(stage)
        h.add(1, r)
        h.steps()
        alone[r.request_id] = h.pixels(r.request_id)
    h = _Harness(stage)
    h.add(1, a)
    h.steps(2)
    h.add(2, b, c)  # the same lane: one forward a step
    assert [lane.batch_ids for lane in h.rows.lanes] == [[1, 2]]
    joined = h.stepper.set
    rows = {row.request.request_id: row for row in joined.rows}
    assert rows["a"].text != rows["b"].text and rows["a"].negative != rows["b"].negative
    upload = joined.conditioning["image"]  # (a row each, in the rows' order: a, b, c)
    assert not torch.equal(upload[0], upload[1]) and torch.equal(upload[0], upload[2])
    h.steps()
    for rid, image in alone.items():
        assert np.abs(h.pixels(rid) - image).max() <= 1, rid


def test_edits_of_two_upload_shapes_step_in_two_lanes_in_turn(monkeypatch):
    """Uploads of two aspects fit to two sequence lengths: two shape groups, each its own lane
    (two lanes a replica here), the lanes stepping in turn by age; each image is the one it
    makes alone."""
    from tests.models.test_family_contract import case_of
    from tests.stages.diffusion.test_running_set import _Harness
    from vllm_omni_like.models.qwen_image import edit
    from vllm_omni_like.params import GenerationParams
    from vllm_omni_like.wire import StageRequest

    monkeypatch.setattr(edit, "FITTED_AREA", 128 * 128)
    stage = case_of("qwen-image-edit").stage()
    params = GenerationParams(seed=3, num_inference_steps=4, width=64, height=32)
    wide = StageRequest("w", "make it red", params, "edit", [UPLOAD])
    tall = StageRequest("t", "make it red", params, "edit", [UPLOAD.transpose(1, 0, 2).copy()])
    own = frozenset(stage.runtime.own)
    assert wide.batch_key(own) != tall.batch_key(own)
    alone = {}
    for r in (wide, tall):
        h = _Harness(stage)
        h.add(1, r)
        h.steps()
        alone[r.request_id] = h.pixels(r.request_id)
    h = _Harness(stage, lanes=2)
    h.add(1, wide)
    h.steps(1)
    h.add(2, tall)  # another shape group: a lane of its own
    assert [lane.batch_ids for lane in h.rows.lanes] == [[1], [2]]
    h.steps(6)
    assert h.stepped[1:] == [[1], [2], [1], [2], [1], [2]]  # in turn (the older wait first)
    h.steps()
    for rid, image in alone.items():
        assert np.abs(h.pixels(rid) - image).max() <= 1, rid


@pytest.mark.drill  # (a text past 512 tokens through Qwen2.5-VL and the pipeline: ~9 s)
def test_an_edit_whose_text_passes_512_tokens_is_the_pipelines_padded_to_a_bucket_past_it():
    """QwenImageEditPipeline cuts no edit text (its `max_sequence_length` is never applied to
    one; a real upload's vision tokens alone pass 512): a prompt of 640 tokens read with its
    upload reaches the transformer whole, padded to the 1024 bucket with a mask, and the image
    is the pipeline's call's at the seed."""
    import torch

    from tests.models.test_family_contract import STEPS, _pixels, case_of
    from vllm_omni_like.params import GenerationParams
    from vllm_omni_like.stages.base import StageControl
    from vllm_omni_like.stages.faults import FaultInjector
    from vllm_omni_like.wire import StageRequest

    case = case_of("qwen-image-edit")
    stage, pipe = case.stage(), case.pipeline()
    prompt = " ".join(["make the circle red and the square blue"] * 80)
    assert len(stage.runtime.pipe.tokenizer(prompt).input_ids) == 640
    texts: list[tuple[int, int]] = []  # (length, unmasked tokens) of each forward's text
    hook = stage.runtime.pipe.transformer.register_forward_pre_hook(
        lambda m, a, kw: texts.append(
            (kw["encoder_hidden_states"].shape[1], int(kw["encoder_hidden_states_mask"][0].sum()))
        ),
        with_kwargs=True,
    )
    params = GenerationParams(seed=7, num_inference_steps=STEPS, width=64, height=64)
    request = StageRequest("long", prompt, params, "edit", [UPLOAD])
    with hook:
        (out,) = stage.execute([request], StageControl(FaultInjector((), "diffusion")))
    assert out.error is None, out.error
    assert {length for length, _ in texts} == {1024} and 640 < texts[0][1] <= 1024
    one = case.call(
        pipe,
        prompt=prompt,
        image=Image.fromarray(UPLOAD),
        width=64,
        height=64,
        generator=[torch.Generator().manual_seed(7)],
    )
    assert np.abs(out.images[0].pixels.astype(int) - _pixels(case, one).astype(int)).max() <= 1


@pytest.mark.drill
def test_the_edit_warm_up_has_a_prompt_for_each_text_bucket_past_512_too():
    """The warm-up's prompts, each read with a blank upload, land one in each text bucket, those
    past 512 (where a real upload's texts fall) included."""
    import torch

    from tests.models.test_family_contract import case_of
    from vllm_omni_like.models.qwen_image.edit import EDIT_TEXT_BUCKETS, edit_text_bucket

    stage = case_of("qwen-image-edit").stage()
    adapter = stage.runtime.adapter
    warm = adapter.warm_up_prompts(torch.device("cpu"))
    blank = Image.new("RGB", (1024, 1024))
    with torch.inference_mode():
        counts = [
            int(adapter.encode_text_with_images([p], [blank], torch.device("cpu"))["mask"].sum())
            for p in warm
        ]
    assert [edit_text_bucket(c) for c in counts] == list(EDIT_TEXT_BUCKETS)  # (one each)
