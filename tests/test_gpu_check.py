"""The GPU check's CPU side: what a lent GPU machine would run is prepared and checked here.

- `tools/gpu_check.sh --dry-run` lists its steps (the newest stage's suite on CUDA, the GPU tests
  of stages 03, 05, 12, 13 and 14, the GPU bench), checks that the tree that would travel is
  under the device tool's 64 MiB and that the steps' time limits fit 8 minutes;
- `pytest --device cuda --collect-only` (the suite's dry run of a GPU run) collects on a CPU,
  with the CUDA-only tests selected and Triton left uninterpreted;
- the GPU bench runs end to end in its quick CPU form and writes its JSON and plot.
The GPU run itself needs a GPU machine (docs/devices.md, "What has run where").
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _needs_tool(name: str) -> None:
    """A student repository (`assign NN DIR --repo`) carries the stages and tests, not tools/."""
    if not (ROOT / "tools" / name).exists():
        pytest.skip(f"tools/{name} is not in this repository (a student repository has no tools/)")


def _run(*command: str, env: dict[str, str] | None = None, timeout: float = 300.0):
    return subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )


def test_the_dry_run_lists_every_step_and_the_tree_fits_the_device():
    _needs_tool("gpu_check.sh")
    done = _run("bash", "tools/gpu_check.sh", "--dry-run", "--skip-wheels")
    assert done.returncode == 0, done.stdout + done.stderr
    newest = sorted(p.name for p in (ROOT / "stages").glob("[0-9][0-9]_*"))[-1][:2]
    out = done.stdout
    assert "--device cuda" in out and f"--stage {newest} tests" in out
    for stage in ("03", "05", "12", "13", "14"):
        assert f"--stage {stage}" in out
    assert "-m cuda" in out and "tools/gpu_bench.py" in out
    assert "limit 64 MiB" in out and "one deadline of 420s" in out
    steps = re.findall(r"^  \[(\w+), at most", out, re.MULTILINE)
    assert steps == [
        "correctness", "gpu_bench", "gpu_tests", "triton_tests", "nccl", "step_profile", "newest"
    ]  # fmt: skip
    first_pytest = next(line for line in out.splitlines() if "-m pytest" in line)
    assert "[correctness," in first_pytest and "tests/test_15_cuda_graphs.py" in first_pytest
    assert f"--stage {newest} " in first_pytest and "--device cuda" in first_pytest
    packages = ("fastapi", "uvicorn", "pydantic", "gguf", "openai", "pytest-xdist", "execnet",
                "pytest-timeout", "hypothesis", "prometheus-client")  # fmt: skip
    for package in packages:
        assert package in out, f"{package} would not travel"


def test_the_full_dry_run_builds_the_wheels_and_every_requirement_travels(tmp_path):
    """The dry run a GPU call starts from, wheels included: every wheel downloads for the
    device's Python, and every requirement of a carried wheel is carried or in the image (a
    missing one fails only there, at import). Needs the package index, as `make test` does."""
    _needs_tool("gpu_check.sh")
    copy = tmp_path / "repo"  # the wheels are built in the tree's .whl/: build them in a copy
    subprocess.run(["git", "worktree", "add", "--detach", str(copy)], cwd=ROOT, check=True,
                   capture_output=True)  # fmt: skip
    try:
        for name in ("gpu_check.sh", "wheel_needs.py"):  # the working tree's, not HEAD's
            (copy / "tools" / name).write_bytes((ROOT / "tools" / name).read_bytes())
        env = {**os.environ, "DOWNLOAD_PYTHON": sys.executable}
        done = subprocess.run(["bash", "tools/gpu_check.sh", "--dry-run"], cwd=copy,
                              capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
        output = done.stdout + done.stderr
        if done.returncode != 0 and "could not build" in output and "pip download" in output:
            unreachable = ("NewConnectionError", "Temporary failure", "No matching distribution")
            if any(word in output for word in unreachable):
                pytest.skip("the package index cannot be reached from here")
        assert done.returncode == 0, output[-3000:]
        assert "every carried wheel's requirements are carried or in the image" in output
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(copy)], cwd=ROOT,
                       capture_output=True)  # fmt: skip


def test_each_step_reports_its_own_status_leaves_no_process_and_one_deadline_holds(tmp_path):
    """Three steps: one leaves a background process behind and fails, one hangs past its
    limit, one would start after the deadline. Each has its own line in the summary (a step
    of `a; b` would report b's status only), the straggler is killed with its step's process
    group before the next step starts, the hang is stopped at its limit, the last step is not
    run, and the logs come back as one archive (the device tool returns at most 8 files)."""
    _needs_tool("gpu_check.sh")
    marker = f"gpu-check-straggler-{os.getpid()}"
    steps = tmp_path / "steps.txt"
    steps.write_text(
        f"leaves|20|(exec -a {marker} sleep 300 &) ; sleep 0.5 ; exit 3\n"
        # "[g]": pgrep's pattern must not match this step's own command line
        f"hangs|5|pgrep -f '[g]{marker[1:]}' && echo STRAGGLER' 'ALIVE ; sleep 100\n"
        "late|5|echo never\n"
    )
    # Whole seconds: "hangs" starts while 9 - elapsed - 1 >= 4 (the first step may take up to
    # 3 s on a loaded machine); "late" finds at most 9 - 5 - 1 = 3 s left after the 5 s hang.
    env = {**os.environ, "OUT": str(tmp_path / "out"), "DEADLINE_SECONDS": "9",
           "DEADLINE_MARGIN": "1", "SHORTEST_STEP": "4"}  # fmt: skip
    done = _run("bash", "tools/gpu_check.sh", f"--steps={steps}", env=env)
    out = done.stdout
    assert done.returncode == 3, out + done.stderr  # three steps failed, each counted
    assert "gpu_check: leaves: exit 3" in out
    assert re.search(r"gpu_check: hangs: exit 1\d\d \(stopped at its 5s limit\)", out), out
    assert "gpu_check: late: not run (deadline)" in out
    assert "STRAGGLER ALIVE" not in out, "a process of the first step outlived it"
    assert subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode == 1
    with tarfile.open(tmp_path / "out" / "gpu_check_logs.tar.gz") as archive:
        names = set(archive.getnames())
    assert {"logs/leaves.log", "logs/hangs.log"} <= names


def test_an_unknown_argument_is_refused():
    _needs_tool("gpu_check.sh")
    done = _run("bash", "tools/gpu_check.sh", "--fast")
    assert done.returncode == 2 and "unknown argument --fast" in done.stderr


def test_pytest_device_cuda_collects_on_a_cpu_with_the_gpu_tests_selected():
    """The dry run of `pytest --device cuda`: the options exist, and the CUDA-only tests are
    among those selected (`-m cuda`), on a machine with no GPU."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    done = _run(
        sys.executable, "-m", "pytest", "--device", "cuda", "--collect-only", "-q",
        "--stage", "05", "-m", "cuda", "-p", "no:cacheprovider",
        "tests/test_05_async_cuda.py", env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "test_cuda_async_steps_equal_sync_steps_under_preemption" in done.stdout


def test_pytest_device_cuda_without_a_gpu_is_a_usage_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --device cuda runs")
    done = _run(
        sys.executable, "-m", "pytest", "--device", "cuda", "-q", "-p", "no:cacheprovider",
        "tests/test_05_async_cuda.py",
    )  # fmt: skip
    assert done.returncode != 0
    assert "torch sees no CUDA device" in done.stderr + done.stdout


def test_the_device_choice_reaches_auto(monkeypatch):
    """STAGES_DEVICE / STAGES_DTYPE (set by `pytest --device`) are what "auto" means; an
    explicit choice still wins."""
    import torch

    from stages.common.devices import resolve_device, resolve_dtype

    monkeypatch.setenv("STAGES_DEVICE", "cpu")
    monkeypatch.setenv("STAGES_DTYPE", "bfloat16")
    assert resolve_device(None) == torch.device("cpu")
    assert resolve_dtype(None, torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    monkeypatch.setenv("STAGES_DTYPE", "float7")
    with pytest.raises(ValueError, match="unknown dtype 'float7'"):
        resolve_dtype(None, torch.device("cpu"))


@pytest.mark.parametrize("name", ["tpu", "mps", "cuda:x", "meta", "", "cpu,cuda"])
def test_a_device_the_engine_has_no_path_for_is_one_clear_error(name, monkeypatch):
    """The code has a CPU path and a CUDA path. Before: `--device tpu` was torch's traceback,
    `mps` or `meta` reached the model loader."""
    from stages.common.devices import requested_device, resolve_device

    with pytest.raises(ValueError, match="is not supported: use auto, cpu, cuda or cuda:N"):
        requested_device(name)
    monkeypatch.setenv("STAGES_DEVICE", name or "tpu")
    with pytest.raises(ValueError, match="is not supported"):
        resolve_device(None)


def test_cpu_with_an_index_is_the_cpu_and_a_gpu_past_the_count_is_refused():
    import torch

    from stages.common.devices import resolve_device

    assert resolve_device("cpu:0") == torch.device("cpu")  # safetensors refuses "cpu:0"
    if torch.cuda.is_available():
        past = f"cuda:{torch.cuda.device_count()}"
        with pytest.raises(ValueError, match="GPU"):
            resolve_device(past)


def test_every_auto_device_follows_one_rule(monkeypatch):
    """One rule for "auto" (devices.requested_device), used by the engine, a DP plan and the
    presets: $STAGES_DEVICE, then a visible GPU, then cpu. Stage 15's `device_type` once read
    an explicit "auto" as "ask CUDA", ignoring $STAGES_DEVICE."""
    import torch

    import stages
    from stages.common.devices import requested_device

    monkeypatch.delenv("STAGES_DEVICE", raising=False)
    assert requested_device(None, has_gpu=False) == torch.device("cpu")
    assert requested_device("auto", has_gpu=True) == torch.device("cuda")
    assert requested_device("cuda:1", has_gpu=False) == torch.device("cuda:1")  # not checked
    monkeypatch.setenv("STAGES_DEVICE", "cuda")
    assert requested_device("auto", has_gpu=False) == torch.device("cuda")
    checks = importlib.import_module(f"{stages.load('15').__name__}.config_checks")
    assert checks.device_type("auto") == checks.device_type(None) == "cuda"
    monkeypatch.setenv("STAGES_DEVICE", "cpu")
    assert checks.device_type("auto") == "cpu"


@pytest.mark.slow
def test_the_gpu_bench_runs_end_to_end_in_its_quick_cpu_form(tmp_path):
    _needs_tool("gpu_bench.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = _run(sys.executable, "tools/gpu_bench.py", "--quick", "--out", str(tmp_path), env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert (tmp_path / "gpu_bench.png").exists()
    summary = record["summary"]
    assert summary["copy_bandwidth_gb_s"] > 0 and summary["quick_batch1_tok_s_best"] > 0
    assert "quick_async_gain_batch1" in summary["targets"]
    for case in record["results"]["attention"]:  # the paged kernel computes SDPA's answer
        assert case["max_abs_difference"] < 1e-4, case


def test_every_test_that_needs_cuda_carries_the_cuda_mark():
    """`-m cuda` (the GPU check's selection) finds a CUDA-only test only through its mark: a
    bare `skipif(not torch.cuda.is_available())` would be skipped here and missed there."""
    needs_cuda = re.compile(r"skipif\(\s*not torch\.cuda\.is_available\(\)|^\s*not torch\.cuda")
    bare = [
        f"{path.name}:{number}"
        for path in sorted((ROOT / "tests").glob("test_*.py"))
        if path.name != Path(__file__).name
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if needs_cuda.search(line)
    ]
    assert bare == [], f"use requires_cuda(why) from tests/conftest.py instead: {bare}"


def test_a_bench_log_reads_back_into_the_record_with_the_printed_roofline_shares(tmp_path):
    """The first H100 run's bench was stopped before it wrote its JSON; its printed lines are
    read back (tools/gpu_bench_log.py). The roofline share computed from the shapes must agree
    with the share the bench printed from the engine's own byte count (rounded to 1%)."""
    _needs_tool("gpu_bench_log.py")
    log = ROOT / "plots" / "gpu" / "h100_2026-11-26" / "gpu_bench.log"
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gpu_bench_log
    finally:
        sys.path.remove(str(ROOT / "tools"))
    text = log.read_text()
    results = gpu_bench_log.parse(text, tokens=256)
    printed = {
        (m.group(1), m.group(2)): int(m.group(3))
        for m in re.finditer(r"^(\S+) batch-1 decode, (.+?): [\d.]+ tok/s, (\d+)%", text, re.M)
    }
    assert len(printed) == 8
    for (shape, label), percent in printed.items():
        share = results["shapes"][shape]["decode_batch1"][label]["roofline_share"]
        assert abs(100 * share - percent) <= 0.51, (shape, label, share, percent)
    summary = gpu_bench_log.summarize(results)
    assert summary["targets"]["llama-1b_graphs_gain_batch1"]["met"] is True
    assert "llama-1b_vs_transformers_at_64" not in summary["targets"]  # not reached in that run
