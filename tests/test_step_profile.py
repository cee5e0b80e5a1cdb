"""The step profile (stages/common/tooling/step_profile.py): the engine's own cost per step.

Timing lives in benchmarks; these tests check what the profile reports and that it leaves the
engine as it found it: every phase a stage has is timed, a phase it lacks is absent, the
methods it wraps are put back, and what it cannot do (a stage without batching, kernel counts
without a GPU) is one clear error. The before-and-after tool's summary pairs each round's two
sides (tools/step_profile_ab.py).
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
import types
from pathlib import Path

import pytest
import torch

from stages import load
from stages.cli import main
from stages.common.tooling import step_profile
from stages.common.tooling.tiny import TinySpec, make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("profile") / "tiny", TinySpec())


STAGE_04_PHASES = set(step_profile.PHASES) - {"host-to-device", "wait for the step"}


@pytest.mark.parametrize(
    ("number", "phases", "config"),
    [
        ("04", STAGE_04_PHASES, {}),
        ("15", set(step_profile.PHASES), {}),
        ("15", set(step_profile.PHASES), {"async_scheduling": True}),
    ],
    ids=["04", "15", "15-overlapped"],
)
def test_each_phase_the_stage_has_is_timed_and_the_steps_counted(
    checkpoint, number, phases, config
):
    profile = step_profile.profile_stage(number, 3, checkpoint, output_tokens=5, config=config)
    assert set(profile.phases_us) == phases
    assert all(us > 0 for us in profile.phases_us.values())
    assert profile.steps >= 5  # a prefill and four decodes at least
    assert profile.per_request_us == pytest.approx(profile.median_step_us / 3)
    assert profile.tokens_per_second > 0
    if number == "15" and sys.platform.startswith("linux"):
        # Overlapped (`config`), the runner's thread waits for the engine's and the engine's
        # for it (about 7 switches a step); by default a CPU runs stage 15's steps on the
        # engine's thread, and nothing in a step puts it to sleep.
        overlapped = config.get("async_scheduling", False)
        assert (profile.switches_per_step > 0.5) is overlapped, profile.switches_per_step


def test_the_wrapped_methods_are_put_back(checkpoint):
    module = load("15")
    llm = step_profile._engine("15", 2, checkpoint, 4, "cpu")
    try:
        runner_module = __import__(type(llm.runner).__module__, fromlist=["sample"])
        sample, result = runner_module.sample, runner_module.StepHandle.result
        clock = step_profile._Clock()
        with step_profile._patched(llm, clock):
            params = module.SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
            llm.generate([[11, 12, 13]], params)
            assert "schedule" in vars(llm.scheduler)
        assert clock.seconds["schedule"] > 0 and clock.seconds["forward"] > 0
        assert "schedule" not in vars(llm.scheduler) and "forward" not in vars(llm.runner.model)
        assert "update_from_output" not in vars(llm)
        assert runner_module.sample is sample and runner_module.StepHandle.result is result
    finally:
        llm.shutdown()


def test_the_table_and_the_report_name_every_phase(checkpoint, tmp_path, capsys):
    out = tmp_path / "profile.json"
    profiles = step_profile.run(["15"], [1, 2], output_tokens=3, out=out, with_plot=False)
    assert [p.requests for p in profiles] == [1, 2]
    printed = capsys.readouterr().out
    assert all(phase in printed for phase in step_profile.PHASES) and "switches/step" in printed
    report = __import__("json").loads(out.read_text())
    assert report["device"] == "cpu" and report["machine"]["torch"] == torch.__version__
    assert [p["requests"] for p in report["profiles"]] == [1, 2]
    assert all(p["switches_per_step"] >= 0 for p in report["profiles"])


def test_a_failing_engine_loses_no_other_cell_and_the_report_is_written_as_it_goes(
    tmp_path, monkeypatch
):
    """One stage's engine failing (a kernel that does not compile on a GPU, say) is recorded
    with why; the other stage's cells are still measured and written, and the run says it
    failed. The JSON is rewritten after every cell, so a run stopped at its limit keeps what
    it measured."""
    import json

    profile = step_profile.profile_stage
    writes: list[int] = []
    write = step_profile.write_report

    def failing(stage, *args, **kwargs):
        if stage == "04":
            raise RuntimeError("no kernel for you")
        return profile(stage, *args, **kwargs)

    def counting(out, *args):
        write(out, *args)
        writes.append(len(json.loads(out.read_text())["profiles"]))

    monkeypatch.setattr(step_profile, "profile_stage", failing)
    monkeypatch.setattr(step_profile, "write_report", counting)
    out = tmp_path / "profile.json"
    with pytest.raises(step_profile.ProfileFailed, match="no kernel for you"):
        step_profile.run(["04", "15"], [1, 2], output_tokens=3, out=out, with_plot=False)
    report = json.loads(out.read_text())
    measured = [(p["stage"], p["requests"]) for p in report["profiles"]]
    assert measured == [("15_full", 1), ("15_full", 2)]
    assert [(e["stage"], e["requests"]) for e in report["errors"]] == [("04", 1), ("04", 2)]
    assert writes == [0, 0, 1, 2], "the report is written after every cell"


def test_what_the_profile_cannot_do_is_one_clear_error(checkpoint, capsys):
    assert main(["02", "bench", "--step-profile", "--quick", "--out-dir", "/nonexistent"]) == 2
    assert "stage 04 on" in capsys.readouterr().err
    with pytest.raises(ValueError, match="at least 2"):
        step_profile.run(["15"], [1], output_tokens=1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA only"):
            step_profile.kernels_per_step("15", 1, checkpoint, None)


def test_the_embedded_throughput_counts_every_stream_and_refuses_none(checkpoint):
    """`embedded_throughput` (the step-cost issue's "the embedded model's tok/s not lower"):
    every stream's tokens counted, its table printed; zero streams refused before any load."""
    from stages.common.tooling import embedded_throughput

    row = embedded_throughput.measure("04", 3, output_tokens=4, model=str(checkpoint))
    assert (row.stage, row.streams, row.output_tokens) == ("04_batching", 3, 12)
    assert row.tokens_per_second > 0 and "04_batching" in embedded_throughput.table([row])
    with pytest.raises(ValueError, match="streams"):
        embedded_throughput.measure("04", 0)


def test_config_settings_reach_every_engine_measured(checkpoint, monkeypatch, tmp_path):
    """`--config KEY=VALUE` (both tools, and the A/B tool on both sides): each text becomes
    the field's value (true/false, none, a number, else the text), a malformed one is refused,
    and the setting reaches the engine, overriding the profile's own."""
    from stages.common.tooling import embedded_throughput

    values = embedded_throughput.config_values(
        ["async_scheduling=true", "max-num-seqs=4", "cuda_graphs=None", "dtype=bfloat16"]
    )
    assert values == {
        "async_scheduling": True, "max_num_seqs": 4, "cuda_graphs": None, "dtype": "bfloat16"
    }  # fmt: skip
    for bad in ("async_scheduling", "=true"):
        with pytest.raises(ValueError, match="KEY=VALUE"):
            embedded_throughput.config_values([bad])
    llm = step_profile._engine("15", 2, checkpoint, 4, "cpu", {"max_num_seqs": 1})
    try:
        assert llm.config.max_num_seqs == 1  # the profile's own would be 2
    finally:
        llm.shutdown()
    ab, commands = _ab_tool(), []  # the A/B tool hands the settings to each side's tool

    def run(command, **_):
        commands.append(command)
        return types.SimpleNamespace(returncode=0, stdout="a table")

    monkeypatch.setattr(ab.subprocess, "run", run)
    assert ab._profile(tmp_path, ["15"], [64], ab.PROFILER, ["async_scheduling=true"]) == "a table"
    assert commands[0][-1] == "--config=async_scheduling=true"


def _ab_tool():
    """tools/step_profile_ab.py, imported by path (tools/ is no package)."""
    path = Path(__file__).resolve().parents[1] / "tools/step_profile_ab.py"
    spec = importlib.util.spec_from_file_location("step_profile_ab", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_before_and_after_summary_pairs_each_round(tmp_path, capsys):
    """`step_profile_ab.summarize` (and `--summarize LOG`): per stage and count, the medians of
    each side with their ranges, the ratio of the medians, and the round-by-round ratios,
    pairing the first table of each round (before) with the second (after); a file that is
    not such a log is one clear error."""
    head = "      stage  reqs  step us  own CPU/step  schedule"
    rows = {  # round -> (before, after) own CPU at 64 requests
        1: ("1,000", "500"), 2: ("2,000", "600"), 3: ("1,200", "300"),
    }  # fmt: skip
    log = ["(both sides measured by ...)"]
    for round_, (before, after) in rows.items():
        for label, value in (("abc1234", before), ("def5678 + working tree", after)):
            log += [f"=== round {round_}: {label}", head, f"04_batching    64    9,999  {value}  1"]
    summary = _ab_tool().summarize("\n".join(log))
    assert "before = abc1234, after = def5678 + working tree" in summary
    row = next(line for line in summary.splitlines() if line.startswith("| 04_batching | 64"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "1,200.0 [1,000.0-2,000.0]" and cells[3] == "500.0 [300.0-600.0]"
    assert cells[4] == "0.42"  # 500 / 1,200
    assert cells[5] == "0.30 [0.25-0.50]"  # 0.50, 0.30, 0.25: round by round
    path = tmp_path / "ab.log"
    path.write_text("\n".join(log))
    assert _ab_tool().main(["--summarize", str(path)]) == 0
    assert capsys.readouterr().out.strip() == summary
    path.write_text("not a log")
    with pytest.raises(SystemExit):
        _ab_tool().main(["--summarize", str(path)])
    assert "not a log of this tool" in capsys.readouterr().err


def test_repeated_runs_combine_into_each_numbers_median():
    """`median_profile` (`--repeat N`): each number of a cell, phases included, is the median
    of its runs; runs of another stage or batch are refused, as is a repeat below one."""

    def profile(scale: float, requests: int = 64) -> step_profile.StepProfile:
        return step_profile.StepProfile(
            stage="04_batching", requests=requests, steps=65,
            median_step_us=1000 * scale, per_request_us=1000 * scale / requests,
            tokens_per_second=100 / scale, phases_us={"schedule": 10 * scale},
            cpu_per_step_us=900 * scale, own_cpu_per_step_us=300 * scale,
            phases_cpu_us={"schedule": 9 * scale}, threads={"schedule": "MainThread"},
            switches_per_step=scale,
        )  # fmt: skip

    combined = step_profile.median_profile([profile(1.0), profile(3.0), profile(1.5)])
    assert combined.median_step_us == 1500 and combined.own_cpu_per_step_us == 450
    assert combined.tokens_per_second == pytest.approx(100 / 1.5)
    assert combined.phases_us == {"schedule": 15} and combined.phases_cpu_us == {"schedule": 13.5}
    assert combined.switches_per_step == 1.5 and combined.steps == 65
    with pytest.raises(ValueError, match="one stage at one number of requests"):
        step_profile.median_profile([profile(1.0), profile(1.0, requests=8)])
    with pytest.raises(ValueError, match="repeat"):
        step_profile.run(["04"], [1], repeat=0)


def test_the_scheduler_bench_times_real_decode_steps(checkpoint, monkeypatch):
    """tools/scheduler_bench.py: every request is running when the timing starts, each timed
    `schedule()` gives each request one token (its token lands before the next), and the
    engine's requests are gone after. Five positive timings; a stage before 04 is refused."""
    path = Path(__file__).resolve().parents[1] / "tools" / "scheduler_bench.py"
    spec = importlib.util.spec_from_file_location("scheduler_bench", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    seen = []
    engine = bench.step_profile._engine

    def recording_engine(*args, **kwargs):
        llm = engine(*args, **kwargs)
        schedule = llm.scheduler.schedule

        def recording():
            out = schedule()
            seen.append(
                {r.request_id: (r.num_computed_tokens, len(r.token_ids)) for r in out.requests}
            )
            return out

        llm.scheduler.schedule = recording
        seen.append(llm)
        return llm

    monkeypatch.setattr(bench.step_profile, "_engine", recording_engine)
    runs = bench.schedule_us("15", 3, checkpoint, steps=2)
    assert len(runs) == 5 and all(t >= 0 for t in runs)  # CPU seconds: no clock runs back
    llm, steps = seen[0], seen[3:]  # the engine, two real steps, then the timed ones
    assert len(steps) == 10 and all(len(s) == 3 for s in steps)
    for before, after in itertools.pairwise(steps):
        assert all(after[r] == (before[r][0] + 1, 1) for r in before)  # one token each
    assert not llm.scheduler.requests
    with pytest.raises(SystemExit, match="04 on"):
        bench.main(["--stages", "03"])
