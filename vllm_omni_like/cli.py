"""`vllm-omni-like serve | generate`: the command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import io
import logging
import os
import signal
import sys

from vllm_omni_like import flags
from vllm_omni_like.errors import ConfigError, OmniError
from vllm_omni_like.pipelines.catalog import resolve

DEFAULT_MODELS = ("tiny-omni", "tiny-image", "tiny-video")


def _pipelines(args: argparse.Namespace) -> tuple:
    overrides = flags.stage_overrides(args)
    found = []
    for spec in args.model or DEFAULT_MODELS:
        found.extend(resolve(spec, args.llm, **overrides))
    return tuple(found)


def cmd_generate(args: argparse.Namespace) -> int:
    from vllm_omni_like.batch import read_lines, run_batch
    from vllm_omni_like.engine import AsyncOmni

    pipelines = _pipelines(args)
    try:  # the input is read before any model loads
        lines = read_lines(args.input, pipelines[0].output)
    except (OSError, UnicodeDecodeError) as exc:
        print(
            f"error: --input {args.input}: {getattr(exc, 'strerror', None) or exc}", file=sys.stderr
        )
        return 2
    engine = AsyncOmni(flags.engine_config(args, pipelines))
    engine.start()
    try:
        ran, failed = asyncio.run(
            run_batch(
                engine, lines, args.output_dir, flags.limits(args), args.resume, args.concurrency
            )
        )
    finally:
        engine.shutdown()
    print(
        f"{ran - failed} of {ran} lines succeeded; results in {args.output_dir}/results.jsonl",
        file=sys.stderr,
    )
    return 0 if failed == 0 or args.allow_failures else 1


def cmd_serve(args: argparse.Namespace) -> int:
    from vllm_omni_like.api.app import create_app
    from vllm_omni_like.api.http_server import build_server
    from vllm_omni_like.engine import AsyncOmni

    settings = flags.server_settings(args)
    pipelines = flags.with_compile_cache(_pipelines(args), settings.storage_dir)
    engine = AsyncOmni(flags.engine_config(args, pipelines))
    fatal: list[str] = []

    def on_fatal(reason: str) -> None:
        fatal.append(reason)
        server.should_exit = True

    app = create_app(engine, settings, on_fatal)
    server = build_server(app, settings)
    server.run()
    if fatal:
        print(f"error: the engine failed to start: {fatal[0]}", file=sys.stderr)
        return 1
    return 0 if server.started else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-omni-like")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    flags.add_engine_args(serve)
    flags.add_server_args(serve)
    serve.set_defaults(func=cmd_serve)
    gen = sub.add_parser("generate", help="offline batch over a JSONL file")
    flags.add_engine_args(gen)
    gen.add_argument(
        "--input", required=True, help="JSONL: OpenAI Batch lines or plain objects (required)"
    )
    gen.add_argument(
        "--output-dir",
        required=True,
        help="where images, videos and results.jsonl are written (required)",
    )
    gen.add_argument(
        "--resume",
        action="store_true",
        help="skip lines whose custom_id already succeeded in output-dir (default: off)",
    )
    gen.add_argument(
        "--allow-failures",
        action="store_true",
        help="exit 0 even if lines failed (default: off, exit 1)",
    )
    gen.add_argument(
        "--concurrency", type=int, default=16, help="lines in flight at once (default: %(default)s)"
    )
    gen.set_defaults(func=cmd_generate)
    return parser


def help_texts(width: int = 100) -> dict[str, str]:
    """Each command's --help text at a fixed width (docs/cli.md is written from it)."""
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)  # argparse reads the width from here
    try:
        parser = build_parser()
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return {name: sub.format_help() for name, sub in commands.choices.items()}
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # `kill -USR1 <pid>` prints every thread's stack to stderr (a hang's diagnosis; workers too);
    # not where stderr is no file (main() called in-process, its output captured)
    with contextlib.suppress(AttributeError, ValueError, io.UnsupportedOperation):
        faulthandler.register(signal.SIGUSR1, file=sys.stderr.fileno(), all_threads=True)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:  # a misconfiguration: its message, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OmniError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
