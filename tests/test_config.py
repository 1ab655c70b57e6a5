import pytest

from vllm_omni_like import flags
from vllm_omni_like.config import FAULTS_ENV, FaultRule, StageConfig, faults_from_env, parse_faults
from vllm_omni_like.errors import ConfigError, OmniError
from vllm_omni_like.stage_options import DiffusionOptions, NullOptions


def test_fault_rules_parse_both_selectors():
    rules = parse_faults(
        "stage=diffusion,point=execute,kind=raise,match=@fail;"
        " stage=llm,point=step,kind=oom,p=0.1,seed=7"
    )
    assert rules == (
        FaultRule("diffusion", "execute", "raise", match="@fail"),
        FaultRule("llm", "step", "oom", p=0.1, seed=7),
    )


@pytest.mark.parametrize(
    "text",
    [
        "stage=diffusion,point=execute,kind=raise,p=lots",
        "stage=diffusion,point=nowhere,kind=raise",
        "stage=diffusion,point=execute,kind=explode",
        "stage=diffusion,kind=raise",
        "stage=diffusion,point=execute,kind=raise,p=1.5",
        "stage=diffusion,point=execute,kind=raise,colour=red",
        "stage=diffusion;point",
    ],
)
def test_bad_fault_rules_are_refused(text):
    with pytest.raises(ConfigError, match="fault rule"):
        parse_faults(text)


def test_faults_are_read_from_the_environment(monkeypatch):
    monkeypatch.setenv(FAULTS_ENV, "stage=s,point=load,kind=exit")
    assert faults_from_env() == (FaultRule("s", "load", "exit"),)
    monkeypatch.delenv(FAULTS_ENV)
    assert faults_from_env() == ()


def test_stage_config_checks_its_fields():
    with pytest.raises(ConfigError, match="kind must be one of"):
        StageConfig(name="x", kind="magic")
    with pytest.raises(ConfigError, match="replicas"):
        StageConfig(name="x", kind="null", replicas=0)
    assert StageConfig(name="x", kind="tests.stage_helpers:CountingStage").kind.endswith("Stage")


def test_stage_options_are_typed_and_checked_when_the_config_is_built():
    stage = StageConfig(name="d", kind="diffusion", options={"default_steps": "20"})
    assert stage.options == DiffusionOptions(default_steps=20)
    with pytest.raises(ConfigError) as info:  # misspelt: never silently ignored
        StageConfig(name="d", kind="diffusion", options={"default_step": 20})
    assert str(info.value).startswith(
        "stage 'd': unknown option default_step for a diffusion stage; known: batch_buckets,"
    )
    with pytest.raises(ConfigError, match="option default_steps='many' is not a valid int"):
        StageConfig(name="d", kind="diffusion", options={"default_steps": "many"})
    with pytest.raises(ConfigError, match=r"option max_new_tokens=2\.5 is not a valid int"):
        StageConfig(name="l", kind="llm", options={"max_new_tokens": 2.5})
    with pytest.raises(ConfigError, match="output must be one of image, video, text"):
        StageConfig(name="n", kind="null", options={"output": "audio"})
    assert StageConfig(name="n", kind="null", options={"steps": 3}).options.steps == 3


def test_a_stage_class_of_ones_own_types_its_options_itself():
    from vllm_omni_like.stages.base import create_stage

    config = StageConfig(name="s", kind="tests.stage_helpers:CountingStage", options={"steps": 3})
    assert config.options == {"steps": 3}  # the config cannot know the class's options
    assert create_stage(config).options == NullOptions(steps=3)
    bad = StageConfig(name="s", kind="tests.stage_helpers:CountingStage", options={"stepz": 3})
    with pytest.raises(ConfigError, match="unknown option stepz for a null stage"):
        create_stage(bad)


def test_a_misspelt_option_in_a_yaml_pipeline_is_a_startup_error(tmp_path, capsys):
    from vllm_omni_like.cli import main

    path = tmp_path / "p.yaml"
    path.write_text(
        "pipelines:\n  - name: p\n    stages:\n"
        "      - {name: diffusion, kind: 'null', options: {stpes: 3}}\n"
    )
    args = ["generate", str(path), "--input", "x", "--output-dir", str(tmp_path)]
    assert main(args) == 2
    assert "stage 'diffusion': unknown option stpes for a null stage" in capsys.readouterr().err
    path.write_text(path.read_text().replace("'null'", "null"))  # YAML's null: nothing
    assert main(args) == 2
    assert "not None (in YAML, write kind: 'null')" in capsys.readouterr().err


def test_a_misconfiguration_raises_a_config_error_not_a_request_error():
    with pytest.raises(ConfigError, match="replicas and sizes must be >= 1") as info:
        StageConfig(name="x", kind="null", replicas=0)
    assert not isinstance(info.value, OmniError)  # no HTTP status: no request caused it


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["nope"], "error: unknown model 'nope': not a built-in pipeline"),
        (["null-image", "--ray-address", "x"], "error: --ray-address needs --executor ray"),
    ],
)
def test_the_cli_prints_a_misconfiguration_as_one_line(tmp_path, capsys, argv, message):
    from vllm_omni_like.cli import main

    lines = tmp_path / "in.jsonl"
    lines.write_text('{"prompt": "a cat"}\n')
    args = ["generate", *argv, "--input", str(lines), "--output-dir", str(tmp_path / "out")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and "Traceback" not in err
    assert err.count("\n") == 1


def test_a_bad_fault_variable_stops_the_cli_with_its_message(tmp_path, capsys, monkeypatch):
    from vllm_omni_like.cli import main

    monkeypatch.setenv(FAULTS_ENV, "stage=d,point=nowhere,kind=raise")
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"prompt": "a cat"}\n')
    args = ["generate", "null-image", "--input", str(lines), "--output-dir", str(tmp_path)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: fault rule 'stage=d,point=nowhere,kind=raise': point must")
    assert "Traceback" not in err


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_a_compile_mode_that_captures_its_own_cuda_graphs_is_refused_at_start_up(mode):
    """torch.compile's CUDA graphs crashed every request's worker after a healthy warm-up (an
    H100, reduce-overhead): refused with the reason and the modes that work, before any load."""
    with pytest.raises(ConfigError) as info:
        StageConfig(name="diffusion", kind="diffusion", compile=True, compile_mode=mode)
    message = str(info.value)
    assert f"--compile-mode {mode} is refused" in message
    assert "default or max-autotune-no-cudagraphs" in message
    StageConfig(name="diffusion", kind="diffusion", compile_mode="max-autotune-no-cudagraphs")


def test_the_cli_refuses_a_cuda_graph_compile_mode_in_one_line(tmp_path, capsys):
    from vllm_omni_like.cli import main

    lines = tmp_path / "in.jsonl"
    lines.write_text('{"prompt": "a cat"}\n')
    args = ["generate", "null-image", "--compile-mode", "reduce-overhead", "--input", str(lines)]
    assert main([*args, "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--compile-mode reduce-overhead is refused" in err and "Traceback" not in err
    assert err.count("\n") == 1


def test_quantization_is_a_stage_field_of_the_flags_and_of_yaml(tmp_path):
    """`--quantization fp8` overrides every diffusion stage (an LLM stage in front keeps its
    own precision); a YAML stage says `quantization: fp8` for itself. FP8 compiles regionally
    unless told (`regional_compile`)."""
    from vllm_omni_like.cli import build_parser
    from vllm_omni_like.flags import stage_overrides
    from vllm_omni_like.pipelines.catalog import resolve

    args = build_parser().parse_args(["serve", "tiny-omni", "--quantization", "fp8"])
    assert stage_overrides(args) == {"quantization": "fp8"}
    llm, diffusion = resolve("tiny-omni", **stage_overrides(args))[0].stages
    assert (llm.quantization, diffusion.quantization) == ("none", "fp8")
    assert diffusion.regional and not llm.regional
    off = StageConfig(name="d", kind="diffusion", quantization="fp8", regional_compile="off")
    assert not off.regional
    assert StageConfig(name="d", kind="diffusion", regional_compile="on").regional
    yaml_file = tmp_path / "p.yaml"
    yaml_file.write_text(
        "pipelines:\n  - name: v\n    output: video\n    stages:\n"
        "      - {name: diffusion, kind: diffusion, model: tiny-video, quantization: fp8}\n"
    )
    (stage,) = resolve(str(yaml_file))[0].stages
    assert stage.quantization == "fp8"


def test_a_quantization_it_does_not_know_or_on_an_llm_stage_is_refused():
    with pytest.raises(ConfigError) as info:
        StageConfig(name="d", kind="diffusion", quantization="int8")
    assert str(info.value) == "stage 'd': quantization must be one of none, fp8, not 'int8'"
    with pytest.raises(ConfigError) as info:
        StageConfig(name="llm", kind="llm", quantization="fp8")
    assert str(info.value) == (
        "stage 'llm': --quantization fp8 runs diffusion stages only, not 'llm'"
    )
    with pytest.raises(ConfigError, match="regional_compile must be one of auto, on, off"):
        StageConfig(name="d", kind="diffusion", regional_compile="yes")


def test_the_cli_refuses_fp8_for_a_unet_model_in_one_line(tmp_path, capsys):
    from vllm_omni_like.cli import main

    lines = tmp_path / "in.jsonl"
    lines.write_text('{"prompt": "a cat"}\n')
    args = ["generate", "tiny-image", "--quantization", "fp8", "--input", str(lines)]
    assert main([*args, "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: stage 'diffusion': --quantization fp8 runs the transformer")
    assert "not stable-diffusion: serve it with --quantization none" in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_cuda_graphs_on_is_refused_where_it_cannot_capture():
    """`--cuda-graphs on` captures compiled buckets on one device: without --compile, or on a
    replica of several ranks, it is a start-up error naming the flag (auto stays quiet)."""
    with pytest.raises(ConfigError) as info:
        StageConfig(name="d", kind="diffusion", cuda_graphs="on")
    assert str(info.value) == (
        "stage 'd': --cuda-graphs on captures the compiled buckets' forwards: it needs --compile"
    )
    with pytest.raises(ConfigError) as info:
        StageConfig(
            name="d",
            kind="diffusion",
            compile=True,
            cuda_graphs="on",
            sequence_parallel=2,
            device="cpu",
        )
    assert str(info.value) == (
        "stage 'd': --cuda-graphs on is not built for a replica of several ranks "
        "(--cfg-parallel, --sequence-parallel): leave it auto or off"
    )
    with pytest.raises(ConfigError, match="cuda_graphs must be one of auto, on, off, not 'yes'"):
        StageConfig(name="d", kind="diffusion", cuda_graphs="yes")
    StageConfig(name="d", kind="diffusion", compile=True, cuda_graphs="on")
    StageConfig(name="d", kind="diffusion", cfg_parallel=True, compile=True)  # (auto)


def test_serve_keeps_its_compile_cache_under_the_storage_dir(monkeypatch):
    """serve's default compile cache is <--storage-dir>/compile-cache, unless the host set
    TORCHINDUCTOR_CACHE_DIR (bench scripts do) or --compile-cache names one; generate has no
    storage dir: the worker's default (that variable, else the cache dir's)."""
    from vllm_omni_like.cli import _pipelines, build_parser

    def caches(argv: list[str]) -> list[str]:
        args = build_parser().parse_args(argv)
        pipelines = _pipelines(args)
        if args.command == "serve":
            pipelines = flags.with_compile_cache(pipelines, args.storage_dir)
        return [s.compile_cache for p in pipelines for s in p.stages]

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert caches(["serve", "null-omni", "--storage-dir", "/s"]) == ["/s/compile-cache"] * 2
    assert caches(["serve", "null-image", "--compile-cache", "/fast/cc"]) == ["/fast/cc"]
    assert caches(["generate", "null-image", "--input", "x", "--output-dir", "o"]) == [""]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/host/cache")
    assert caches(["serve", "null-image", "--storage-dir", "/s"]) == [""]
