"""Where a Wan denoising step's time goes on one GPU: prints a JSON line.

    python bench/wan_forward.py     # on a GPU: 832x480, 33 frames, bf16, random weights

- the transformer's forward alone at batch 1 and 2 (CUDA events, median of `--runs`): what
  CFG-parallel's split step (batch 1 per rank) can at best take against one GPU's (batch 2);
  and the host's time to launch it, from an empty queue (near the device's: host-bound);
  with `--graphs`, also replayed from a CUDA graph (no launch gaps at all);
- a step of the pipeline (`--steps` steps, CFG 5, batched guidance as the server runs it) against
  its forward: the host's share of a step;
- the host-device synchronisations in the pipeline's steps, with where they happen (CUDA's sync
  debug mode), after the first step.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import traceback
import warnings

import torch

from bench.forward_probe import launch_and_device_ms
from vllm_omni_like.models.wan.adapter import WanAdapter
from vllm_omni_like.stages.diffusion import acceleration as accel
from vllm_omni_like.stages.diffusion.host_scheduler import host_scheduler
from vllm_omni_like.stages.torch_utils import dummy_pipeline

HERE = os.path.dirname(os.path.abspath(__file__))
WAN = os.path.join(HERE, "..", "vllm_omni_like", "assets", "archs", "wan2.1-t2v-1.3b")


def forward_ms(model, latents, timestep, text, runs: int) -> tuple[list[float], float]:
    """The forward's device times and the host's time to launch it (median, from an empty
    queue)."""

    def forward() -> None:
        with torch.inference_mode():
            model(hidden_states=latents, timestep=timestep, encoder_hidden_states=text)

    return launch_and_device_ms(forward, runs)


def graphed_ms(model, latents, timestep, text, runs: int) -> float | str:
    """The forward's device time replayed from a CUDA graph (no launches): what the eager
    forward loses to launch gaps. An error's text if the forward cannot be captured."""
    static = dict(hidden_states=latents.clone(), timestep=timestep.clone())
    static["encoder_hidden_states"] = text.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):
                model(**static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph):
            model(**static)
    except Exception as exc:  # reported, not fatal to the rest
        return f"{type(exc).__name__}: {exc}"[:300]
    times = []
    for i in range(2 + runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    del graph
    torch.cuda.empty_cache()
    return round(statistics.median(times), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--diffusers-scheduler", action="store_true", help="keep diffusers' UniPC")
    ap.add_argument("--graphs", action="store_true", help="also the forward from a CUDA graph")
    args = ap.parse_args()
    torch.manual_seed(0)
    pipe = dummy_pipeline(WAN, torch.device("cuda"), torch.bfloat16).to("cuda")
    pipe.set_progress_bar_config(disable=True)
    if not args.diffusers_scheduler:
        host_scheduler(pipe)
    accel.set_attention(pipe, "auto", torch.device("cuda"), "wan")
    model = pipe.transformer
    out: dict = {"device": torch.cuda.get_device_name(), "scheduler": type(pipe.scheduler).__name__}
    text = torch.randn(2, 512, 4096, device="cuda", dtype=torch.bfloat16)
    latents = torch.randn(2, 16, 9, 60, 104, device="cuda", dtype=torch.bfloat16)
    t = torch.full((2,), 900.0, device="cuda")
    for rows in (1, 2):
        times, host_ms = forward_ms(model, latents[:rows], t[:rows], text[:rows], args.runs)
        out[f"forward_b{rows}_ms"] = round(statistics.median(times), 2)
        out[f"forward_b{rows}_range_ms"] = [round(min(times), 2), round(max(times), 2)]
        out[f"forward_b{rows}_launch_ms"] = round(host_ms, 2)  # the host's, to the return
        if args.graphs:
            graphed = graphed_ms(model, latents[:rows], t[:rows], text[:rows], args.runs)
            out[f"forward_b{rows}_graph_ms"] = graphed
    cfg = WanAdapter(pipe).batched_cfg()
    kwargs = dict(
        prompt_embeds=text[:1],
        negative_prompt_embeds=text[1:],
        height=480,
        width=832,
        num_frames=33,
        guidance_scale=5.0,
        output_type="latent",
    )
    syncs: collections.Counter[str] = collections.Counter()
    seen_step = [0]

    def on_step(pipe, i, t, callback_kwargs):
        seen_step[0] = i + 1
        if i == 0:
            torch.cuda.set_sync_debug_mode("warn")
        return callback_kwargs

    def record(message, category, filename, lineno, file=None, line=None):
        if "Synchronizing" not in str(message) and "synchroniz" not in str(message).lower():
            return
        if seen_step[0] == 0:
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in frames[-4:])
        syncs[f"{message} @ {where}"] += 1

    for steps in (2, 2 + args.steps):
        cfg.arm(kwargs)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.inference_mode():
            pipe(num_inference_steps=steps, **kwargs)
        end.record()
        end.synchronize()
        cfg.disarm()
        out[f"pipeline_{steps}_steps_ms"] = round(start.elapsed_time(end), 1)
    step = (out[f"pipeline_{2 + args.steps}_steps_ms"] - out["pipeline_2_steps_ms"]) / args.steps
    out["pipeline_step_ms"] = round(step, 2)
    out["host_share_ms"] = round(step - out["forward_b2_ms"], 2)
    # the syncs of steps 2..4 (the first finds its index in the timesteps: one sync per call)
    warnings.showwarning = record
    warnings.simplefilter("always")
    cfg.arm(kwargs)
    with torch.inference_mode():
        pipe(num_inference_steps=4, callback_on_step_end=on_step, **kwargs)
    torch.cuda.set_sync_debug_mode("default")
    cfg.disarm()
    out["syncs_after_step_1"] = dict(syncs)
    print(json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
