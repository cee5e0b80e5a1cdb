"""tools/serve_compare.py's load against a stage alone (no llama-server: building it takes
minutes): every cell answers every stream in full, the JSON and the plot are written, and the
served one-stream latency is set beside the same engine's offline one."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import serve_compare  # noqa: E402


@pytest.mark.slow
def test_the_load_runs_against_a_stage_alone_and_writes_json_and_plot(tmp_path, tiny_model):
    model = str(tiny_model("llama-gqa"))
    args = ["--no-llama", "--stage", "15", "--model", model, "--streams", "1", "3",
            "--rounds", "1", "--max-tokens", "6", "--out-dir", str(tmp_path),
            "--config", "max_num_seqs=4", "--config", "max_model_len=128"]  # fmt: skip
    result = serve_compare.main(args)
    assert [c["streams"] for c in result["cells"]] == [1, 3]
    for cell in result["cells"]:
        assert cell["ok"], cell["errors"]
        assert cell["output_tokens"] == 6 * cell["streams"], "ignore_eos: every token, every stream"
    assert result["offline_itl_ms"] > 0 and result["served_over_offline_itl"] > 0
    written = json.loads((tmp_path / "serve_compare.json").read_text())
    assert written["summary"] == result["summary"] and "ratio" not in written["summary"][0]
    assert (tmp_path / "serve_compare.png").stat().st_size > 10_000


def test_bad_arguments_are_refused_before_anything_starts(capsys):
    with pytest.raises(SystemExit):
        serve_compare.main(["--streams", "0"])
    assert "must be positive" in capsys.readouterr().err
