"""The command line's arguments: the parsers of `python -m stages ...` and of
`python -m stages NN ...`, and how `--config key=value` becomes a stage's `EngineConfig` keyword
arguments. What each command does is in cli.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
NONE_WORDS = ("none", "null")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


def _kinds(annotation: Any) -> tuple[Any, ...]:
    """The types a field accepts: `int | None` -> (int, NoneType); a Literal stays whole."""
    if get_origin(annotation) in (Union, types.UnionType):
        return tuple(k for arg in get_args(annotation) for k in _kinds(arg))
    return (annotation,)


def _accepted(kinds: tuple[Any, ...]) -> str:
    """What a field accepts, in words, for the error message."""
    words = []
    for kind in kinds:
        if get_origin(kind) is Literal:
            words.append("one of " + ", ".join(str(v) for v in get_args(kind)))
        elif kind is bool:
            words.append("true or false")
        elif kind is type(None):
            words.append("none")
        else:
            words.append({int: "an integer", float: "a number", str: "any text"}.get(kind, "?"))
    return " or ".join(words)


def _parse_value(text: str, annotation: Any, name: str = "the value") -> Any:
    """Turn 'true' / '16' / '0.5' / 'none' / 'paged' into the type a config field declares;
    anything else is a ValueError naming the field and what it accepts (a typo must not reach
    the engine as a string: `disaggregated=maybe` would be truthy)."""
    lowered = text.strip().lower()
    kinds = _kinds(annotation)
    if type(None) in kinds and lowered in NONE_WORDS:
        return None
    for kind in kinds:
        if get_origin(kind) is Literal:
            for choice in get_args(kind):
                if str(choice).lower() == lowered:
                    return choice
        elif kind is bool:
            if lowered in TRUE_WORDS or lowered in FALSE_WORDS:
                return lowered in TRUE_WORDS
        elif kind is int:
            try:
                return int(text)
            except ValueError:
                pass
        elif kind is float:
            try:
                return float(text)
            except ValueError:
                pass
        elif kind is str:
            return text
    raise ValueError(f"{name}={text!r} is not accepted: {name} takes {_accepted(kinds)}")


def port_number(text: str) -> int:
    """A TCP port for `serve --port`: 0..65535 (0: the OS picks a free one, and the "serving on"
    line says which). Checked here, before a model loads, not by bind() after."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port: ports are 0 to 65535")
    return port


def seconds(text: str) -> float:
    """A duration for `serve --drain-seconds`: a finite number, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a duration: give 0 or more seconds")
    return value


def engine_kwargs(stage: types.ModuleType, args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from --model/--device/--dtype/--config k=v; a value the
    field's type cannot take is a ValueError: one line (`error: ...`, exit 2), not a traceback."""
    config_cls = stage.EngineConfig
    hints = get_type_hints(config_cls)
    fields = {f.name for f in dataclasses.fields(config_cls)}
    kwargs: dict[str, Any] = {}
    for name in ("device", "dtype", "max_model_len"):
        value = getattr(args, name, None)
        if value is not None:
            kwargs[name] = value
    for item in getattr(args, "config", None) or []:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in fields:
            raise ValueError(f"--config {item!r}: expected key=value with key in {sorted(fields)}")
        try:
            kwargs[key] = _parse_value(value.strip(), hints[key], key)
        except ValueError as exc:
            raise ValueError(f"--config: {exc}") from None
    return kwargs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m stages",
        description="Run, serve and benchmark the engine's stages.",
        epilog="python -m stages gradebook ROSTER --stage NN --out DIR: grade a whole class "
        "(python -m stages gradebook --help)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the stages")
    diff = sub.add_parser("diff", help="show what stage B adds to stage A")
    diff.add_argument("a")
    diff.add_argument("b")
    diff.add_argument(
        "--all",
        action="store_true",
        help="every file, not only the modules the lesson.toml files list (bench.py, READMEs)",
    )
    diff.add_argument(
        "--stat",
        action="store_true",
        help="changed lines per file and the lesson's size (stages/lesson_size.py)",
    )
    diff.add_argument(
        "--part",
        type=int,
        metavar="N",
        help="one part of a lesson that teaches several (its lesson.toml's [[part]] N, from 1)",
    )
    assign = sub.add_parser(
        "assign", help="write a student copy of stage NN to DIR/NN_name, and DIR/ASSIGNMENT.md"
    )
    assign.add_argument("stage", help="stage number, e.g. 03")
    assign.add_argument("dir", help="where to write (DIR/NN_name is the stage copy)")
    assign.add_argument(
        "--solution", action="store_true", help="write the reference code instead (the answers)"
    )
    assign.add_argument(
        "--repo",
        action="store_true",
        help="write DIR as a standalone student repository instead: the stages before NN "
        "solved, NN blanked, no later stage, the tests that apply, the grader, a README",
    )
    assign.add_argument("--force", action="store_true", help="overwrite an existing copy")
    grade = sub.add_parser("grade", help="run each task's tests on a stage copy, report per task")
    grade.add_argument("path", help="the stage copy, DIR/NN_name")
    grade.add_argument("--stage", default=None, help="stage number, if the folder is not NN_*")
    grade.add_argument("--task", type=int, action="append", help="grade only task N (repeatable)")
    grade.add_argument(
        "--quick", action="store_true", help="leave out the tests marked slow (the real model)"
    )
    grade.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds a test may take: setup, call and teardown together (default 30)",
    )
    grade.add_argument(
        "--task-timeout",
        type=float,
        default=None,
        help="seconds a task's tests may take together: past it, that task's other tests fail "
        "unrun and the other tasks still run (default: no limit)",
    )
    grade.add_argument("--verbose", action="store_true", help="show pytest's own output")
    # the gradebook's (stages/grade_check.py): what each test did, and a test that must fail
    grade.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)
    grade.add_argument("--sentinel", default="", help=argparse.SUPPRESS)
    grade.add_argument(
        "--json",
        action="store_true",
        help="print the grade as JSON (per task: status, points, tests passed of total, the "
        "failing tests with their first line, seconds) instead of the report, for a CI",
    )
    return parser


def build_stage_parser(stage_number: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m stages {stage_number}")
    engine = argparse.ArgumentParser(add_help=False)
    engine.add_argument(
        "--model",
        default=None,
        help="model name, local folder or hub id (default: embedded SmolLM2)",
    )
    engine.add_argument("--device", default=None)
    engine.add_argument("--dtype", default=None)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument(
        "--config",
        action="append",
        metavar="KEY=VALUE",
        help="any EngineConfig field of the stage, e.g. use_kv_cache=false",
    )
    sampling = argparse.ArgumentParser(add_help=False)
    sampling.add_argument("--max-tokens", type=int, default=128)
    sampling.add_argument("--temperature", type=float, default=0.0)
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=0)
    sampling.add_argument("--seed", type=int, default=None)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", parents=[engine], help="stream answers to sample prompts")
    demo.add_argument("--max-tokens", type=int, default=96)
    gen = sub.add_parser("generate", parents=[engine, sampling], help="complete one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    sub.add_parser("chat", parents=[engine, sampling], help="interactive chat")
    serve = sub.add_parser("serve", parents=[engine], help="run the HTTP server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument(
        "--port", type=port_number, default=8000, help="0: a free port the OS picks (default 8000)"
    )
    serve.add_argument("--log-level", default="info", choices=LOG_LEVELS, type=str.lower)
    serve.add_argument(
        "--drain-seconds",
        type=seconds,
        default=10.0,
        help="on SIGTERM, how long requests in flight may run before they are ended "
        "(a second SIGTERM or Ctrl-C stops at once)",
    )
    serve.add_argument(
        "--cors-origin",
        action="append",
        metavar="ORIGIN",
        help="let browser pages from ORIGIN call the API, e.g. https://chat.example.org "
        "(repeatable; * for any); off by default",
    )
    bench = sub.add_parser("bench", help="run this stage's benchmark, write plots/NN_*.png+json")
    bench.add_argument("--quick", action="store_true", help="a small version (seconds)")
    bench.add_argument("--out-dir", default=None, help="where to write (default: plots/)")
    bench.add_argument("--model", default=None)
    bench.add_argument(
        "--step-profile",
        action="store_true",
        help="instead: the engine's own cost per step and per phase, on a tiny model at 1, 8, "
        "64 and 256 running requests (stages/common/tooling/step_profile.py), written to "
        "plots/step_profile/NN_name.json+png",
    )
    bench.add_argument("--device", default="cpu", help="with --step-profile: cpu or cuda")
    return parser
