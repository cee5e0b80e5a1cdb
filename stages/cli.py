"""Command line: ``python -m stages list | NN demo|generate|chat|serve|bench | diff A B``, and
``assign NN DIR`` / ``grade DIR/NN_name`` for course assignments (see stages/assign.py).

The same commands drive every stage, because every stage keeps the same public API
(`LLM`, `SamplingParams`, `create_app`, `bench.run`). Stage-specific switches are passed as
``--config key=value`` and land in that stage's `EngineConfig` (the parsers: cli_args.py).
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
import types
from pathlib import Path
from typing import Any

from stages import list_stages, load, stage_info
from stages.cli_args import build_parser, build_stage_parser, engine_kwargs

DEMO_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for staying focused while studying.",
)


def _err(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_engine(stage: types.ModuleType, args: argparse.Namespace) -> Any:
    kwargs = engine_kwargs(stage, args)  # a bad --config value: refused before loading
    _err(f"[stages] loading {args.model or 'the default model'} with stage {stage.STAGE} ...")
    model = args.model or stage.EngineConfig().model
    engine = stage.LLM(model, **kwargs)
    _err(
        f"[stages] ready in {engine.load_seconds:.1f} s: {engine.model_name} on "
        f"{engine.device} ({str(engine.dtype).removeprefix('torch.')})"
    )
    _say_weight_format(engine)
    return engine


def _say_weight_format(engine: Any) -> None:
    """Stage 15's quantization="auto" says what it picked for this machine, and why."""
    weight_format = getattr(engine, "weight_format", None)
    if weight_format is not None:
        _err(f"[stages] quantization auto: {weight_format.describe()}")
        if weight_format.quantization != "none":
            _err("[stages] the same with fp32 weights: add --config quantization=none")


def _sampling(stage: types.ModuleType, args: argparse.Namespace) -> Any:
    return stage.SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )


def stream_one(engine: Any, request: Any) -> Any:
    """Print a request's text as it is generated; return the final output."""
    shown, output = 0, None
    for output in engine.stream(request):
        print(output.text[shown:], end="", flush=True)
        shown = len(output.text)
    print(flush=True)
    return output


def _report(output: Any) -> str:
    count = len(output.token_ids)
    itl = output.itl
    rate = len(itl) / sum(itl) if itl and sum(itl) > 0 else float("nan")
    return (
        f"[{count} tokens, {output.finish_reason}; time to first token "
        f"{output.ttft * 1e3:.0f} ms, decode {rate:.1f} tokens/s]"
    )


def cmd_demo(stage: types.ModuleType, args: argparse.Namespace) -> None:
    engine = build_engine(stage, args)
    params = stage.SamplingParams(max_tokens=args.max_tokens, temperature=0)
    for prompt in DEMO_PROMPTS:
        print(f"\n>>> {prompt}", flush=True)
        request = engine.make_request(None, params, messages=[{"role": "user", "content": prompt}])
        output = stream_one(engine, request)
        print(_report(output), flush=True)


def cmd_generate(stage: types.ModuleType, args: argparse.Namespace) -> None:
    engine = build_engine(stage, args)
    params = _sampling(stage, args)
    if args.chat:
        request = engine.make_request(
            None, params, messages=[{"role": "user", "content": args.prompt}]
        )
    else:
        request = engine.make_request(args.prompt, params)
    output = stream_one(engine, request)
    _err(_report(output))


def cmd_chat(stage: types.ModuleType, args: argparse.Namespace) -> None:
    engine = build_engine(stage, args)
    params = _sampling(stage, args)
    messages: list[dict[str, str]] = []
    _err("[stages] chat: type a message, an empty line or Ctrl-D to quit, /reset to forget")
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        if line == "/reset":
            messages.clear()
            continue
        messages.append({"role": "user", "content": line})
        print("bot> ", end="", flush=True)
        try:
            output = stream_one(engine, engine.make_request(None, params, messages=messages))
        except ValueError as exc:  # the conversation outgrew the context, say
            _err(f"[stages] {exc}")
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": output.text})
        _err(_report(output))


def build_serving_engine(stage: types.ModuleType, args: argparse.Namespace) -> Any:
    """What `serve` runs: the stage's `serving_engine(model, **config)` when it has one (from
    stage 10: engine-core replicas behind a router when data_parallel_size > 1), else its LLM."""
    factory = getattr(stage, "serving_engine", None)
    if factory is None:
        return build_engine(stage, args)
    kwargs = engine_kwargs(stage, args)
    _err(f"[stages] loading {args.model or 'the default model'} with stage {stage.STAGE} ...")
    started = time.perf_counter()
    engine = factory(args.model or stage.EngineConfig().model, **kwargs)
    _err(f"[stages] ready in {time.perf_counter() - started:.1f} s: {engine.model_name}")
    _say_weight_format(engine)
    return engine


def bind_port(host: str, port: int) -> socket.socket:
    """The server's listening socket, taken before the engine loads: a busy port is a one-line
    error at once, not after a model load that ends in a failed bind (and a "serving on" that
    was never true). It listens at once too, so that nobody takes the port meanwhile;
    connections made while the engine loads wait, and are answered once it is ready."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past connections' TIME_WAIT
    try:
        sock.bind((host, port))
        sock.listen(2048)  # uvicorn's default backlog
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def serving_message(model_name: str, app: Any, host: str, port: int) -> str:
    """What `serve` says once it listens: the address, and the pages a person opens there
    (stage 15's live view and metrics) where the app has them."""
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"  # IPv6: brackets
    lines = [
        f"[stages] serving {model_name} on {url} "
        "(OpenAI-compatible: /v1/completions, /v1/chat/completions; also /generate, /health)"
    ]
    paths = {getattr(route, "path", None) for route in app.routes}
    if "/dashboard" in paths:
        lines.append(f"[stages] live view of the engine: {url}/dashboard")
    if "/metrics" in paths:
        lines.append(f"[stages] Prometheus metrics: {url}/metrics")
    return "\n".join(lines)


def cmd_serve(stage: types.ModuleType, args: argparse.Namespace) -> None:
    import uvicorn

    from stages.common.serving import DrainingServer, allow_cors

    sock = bind_port(args.host, args.port)
    with sock:
        port = sock.getsockname()[1]  # the one the OS picked, for --port 0
        engine = build_serving_engine(stage, args)
        app = stage.create_app(engine)
        allow_cors(app, args.cors_origin or ())
        _err(serving_message(engine.model_name, app, args.host, port))
        config = uvicorn.Config(app, host=args.host, port=port, log_level=args.log_level)
        server = DrainingServer(
            config, getattr(app.state.engine, "drain", None), args.drain_seconds
        )
        server.run(sockets=[sock])


def cmd_bench(stage: types.ModuleType, args: argparse.Namespace) -> None:
    from importlib import import_module

    started = time.perf_counter()
    if args.step_profile:
        from stages.common.tooling import step_profile

        info = stage_info(stage.STAGE)
        where = (
            Path(args.out_dir)
            if args.out_dir
            else Path(__file__).resolve().parents[1] / "plots" / "step_profile"
        )
        requests, tokens = ([1, 8], 8) if args.quick else ([1, 8, 64, 256], None)
        step_profile.run(
            [info.number],
            requests,
            output_tokens=tokens or step_profile.OUTPUT_TOKENS,
            device=args.device,
            out=where / f"{info.folder}.json",
        )
        _err(f"[stages] step profile finished in {time.perf_counter() - started:.0f} s")
        return
    bench = import_module(f"{stage.__name__}.bench")
    result = bench.run(
        quick=args.quick, out_dir=Path(args.out_dir) if args.out_dir else None, model=args.model
    )
    _err(f"[stages] bench finished in {time.perf_counter() - started:.0f} s")
    for key, value in result.get("summary", {}).items():
        print(f"{key}: {value}")


def cmd_list(_: argparse.Namespace) -> None:
    for info in list_stages():
        try:
            technique = load(info.number).TECHNIQUE
        except Exception as exc:  # a broken stage should not hide the others
            technique = f"(fails to import: {exc})"
        print(f"{info.folder:<16} {technique}")


def cmd_diff(args: argparse.Namespace) -> None:
    """The lesson: what stage B changes relative to stage A (stages/lesson.py, `lesson_diff`)."""
    from stages.lesson import lesson_diff, part_diff
    from stages.lesson_size import check_part, stat_lines

    if args.stat:
        print("\n".join(stat_lines(args.a, args.b, args.part)))
        return
    if args.part is not None:
        lines = part_diff(check_part(args.a, args.b, args.part), args.part)
    else:
        lines = lesson_diff(args.a, args.b, every_file=args.all)
    changed = False
    for line in lines:
        changed = True
        sys.stdout.write(line)
    if not changed:
        _err("[stages] no differences")


def cmd_assign(args: argparse.Namespace) -> None:
    """Write a student copy of a stage (its technique's functions blanked) and ASSIGNMENT.md,
    or with --repo a standalone student repository (stages/student_repo.py)."""
    try:
        _assign(args)
    except OSError as exc:  # a file where the folder should be, a folder we may not write to
        where = exc.filename or args.dir
        raise ValueError(f"cannot write the assignment to {where}: {exc.strerror or exc}") from None


def _assign(args: argparse.Namespace) -> None:
    from stages.assign import ASSIGNMENT_FILE, assign, grade_command

    if args.repo:
        from stages.student_repo import write_repo

        copy = write_repo(args.stage, Path(args.dir), solution=args.solution, force=args.force)
        repo = copy.parents[1]
        print(f"repository: {repo} (README.md says how to grade)")
        print(f"tasks:      {repo / ASSIGNMENT_FILE}")
        print(f"grade:      cd {repo} && {grade_command(copy, repo)}")
        return
    copy = assign(args.stage, Path(args.dir), solution=args.solution, force=args.force)
    kind = "solution" if args.solution else "student copy"
    print(f"{kind}: {copy}")
    print(f"tasks:  {copy.parent / ASSIGNMENT_FILE}")
    print(f"grade:  {grade_command(copy)}")


def cmd_grade(args: argparse.Namespace) -> int:
    """Run each task's tests on a stage copy and print a per-task report; 0 if all pass."""
    from stages.grade import grade

    _err(f"[stages] grading {args.path}: running each task's tests (a minute or more) ...")
    try:
        report, passed = grade(
            args.path,
            stage=args.stage,
            quick=args.quick,
            tasks=args.task or (),
            timeout=args.timeout,
            verbose=args.verbose,
            as_json=args.json,
            task_timeout=args.task_timeout,
            raw=args.raw,
            sentinel=args.sentinel,
        )
    except RuntimeError as exc:  # pytest itself could not run: say so, with its output
        _err(f"[stages] {exc}")
        return 2
    print(report, flush=True)
    return 0 if passed or args.raw else 1  # --raw: 0 says the result above is complete


STAGE_COMMANDS = {
    "demo": cmd_demo,
    "generate": cmd_generate,
    "chat": cmd_chat,
    "serve": cmd_serve,
    "bench": cmd_bench,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "gradebook":  # a class at once (stages/gradebook.py)
        from stages.gradebook import main as gradebook_main

        return gradebook_main(argv[1:])
    if argv and argv[0][:2].isdigit():
        try:
            info = stage_info(argv[0])
        except ValueError as exc:
            _err(str(exc))
            return 2
        args = build_stage_parser(info.number).parse_args(argv[1:])
        try:
            stage = load(info.number)  # a bad setting it reads at import (STAGES_CPU_CLASS) too
            STAGE_COMMANDS[args.command](stage, args)
        except ValueError as exc:  # bad input: a message, not a traceback
            _err(f"error: {exc}")
            return 2
        except KeyboardInterrupt:
            return 130
        return 0
    args = build_parser().parse_args(argv)
    try:
        if args.command == "list":
            cmd_list(args)
        elif args.command == "assign":
            cmd_assign(args)
        elif args.command == "grade":
            return cmd_grade(args)
        else:
            cmd_diff(args)
    except ValueError as exc:
        _err(str(exc))
        return 2
    except BrokenPipeError:  # `python -m stages diff 03 04 | head` closed the pipe: fine
        sys.stderr.close()
    return 0
