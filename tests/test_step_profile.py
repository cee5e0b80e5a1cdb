"""The step profile (stages/common/tooling/step_profile.py): the engine's own cost per step.

Timing lives in benchmarks; these tests check what the profile reports and that it leaves the
engine as it found it: every phase a stage has is timed, a phase it lacks is absent, the
methods it wraps are put back, and what it cannot do (a stage without batching, kernel counts
without a GPU) is one clear error.
"""

from __future__ import annotations

import sys
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
    ("number", "phases"), [("04", STAGE_04_PHASES), ("15", set(step_profile.PHASES))]
)
def test_each_phase_the_stage_has_is_timed_and_the_steps_counted(checkpoint, number, phases):
    profile = step_profile.profile_stage(number, 3, checkpoint, output_tokens=5)
    assert set(profile.phases_us) == phases
    assert all(us > 0 for us in profile.phases_us.values())
    assert profile.steps >= 5  # a prefill and four decodes at least
    assert profile.per_request_us == pytest.approx(profile.median_step_us / 3)
    assert profile.tokens_per_second > 0
    if number == "15" and sys.platform.startswith("linux"):  # the runner's thread: it waits
        assert profile.switches_per_step > 0  # for the engine's, and the engine's for it


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
