"""The "Follow one request" diagrams of stages 09-15: small SVGs generated from a spec.

Each diagram is a sequence diagram: the processes (or, inside one process, its threads) are
boxes across the top, each with a dashed lifeline; the messages are numbered arrows, top to
bottom in the order they happen. A step inside one box is a note on its lifeline; a collective
(all-reduce, all-to-all) is an arrow with two heads; a reply or a stream is dashed. The stage
README's "Follow one request" section walks the same path file by file, citing the arrows'
numbers.

The specs below are the single source: edit one, run this script, commit the SVG. The SVG is
written by hand (no plotting library): a few kilobytes, byte-stable, readable in a diff.

    python tools/request_diagrams.py            # write every stages/NN/diagrams/<name>.svg
    python tools/request_diagrams.py --check    # fail if a checked-in SVG differs, or a README
                                                # lacks its section, a link, or a file it names
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Follow one request"
FIRST_STAGE = 9  # every stage from here on has the section
NOT_OURS = {"call_soon_threadsafe"}  # names a section cites that no stage defines

LANE, MARGIN, BOX_H, TOP, ROW = 210, 14, 40, 40, 30
CHAR_W = 6.1  # a generous width of one 11px sans-serif character, to check that labels fit


@dataclass(frozen=True)
class Diagram:
    """One topology of one stage. `boxes`: (key, label; a newline splits two lines). `steps`:
    (from, to, label, style), in order; from == to is a note; style "" (a message), "reply"
    (dashed), "both" (a collective: two heads)."""

    stage: str
    name: str
    title: str
    boxes: tuple[tuple[str, str], ...]
    steps: tuple[tuple[str, str, str, str], ...]

    @property
    def path(self) -> Path:
        return ROOT / "stages" / self.stage / "diagrams" / f"{self.name}.svg"


def _d(stage: str, name: str, title: str, boxes: dict[str, str], *steps: tuple) -> Diagram:
    full = tuple((*s, "")[:4] for s in steps)
    return Diagram(stage, name, title, tuple(boxes.items()), full)


_HTTP = ("client", "srv", "POST /v1/completions")
_TP = {
    "client": "HTTP client",
    "srv": "server process\nLLMEngine + rank 0",
    "w1": "worker process\nrank 1 (worker.py)",
}
_DISAGG = {
    "client": "HTTP client",
    "fe": "front end process\nserver + DisaggClient",
    "pre": "prefill core process\nkv_role=prefill",
    "dec": "decode core process\nkv_role=decode",
}
_HOST_TIER = {
    "client": "HTTP client",
    "eng": "engine loop thread\nscheduler + host ledger",
    "run": "runner step thread\nModelRunner + connector",
    "copy": "copy lane\nCopyEngine (thread/stream)",
}
_EP_STEPS = (
    _HTTP,
    ("srv", "srv", "schedule(): SchedulerOutput"),
    ("srv", "w1", '("execute_model", output)'),
    ("w1", "w1", "attention: the whole batch"),
    ("srv", "w1", "all_to_all: tokens to experts", "both"),
    ("w1", "w1", "run_experts: its experts"),
    ("srv", "w1", "all_to_all: results back", "both"),
    ("srv", "w1", "all_gather: whole batch again", "both"),
    ("srv", "srv", "sample; update_from_output"),
    ("srv", "client", "SSE: data: {...}", "reply"),
)


def _disagg(stage: str, name: str, title: str, quant: bool) -> Diagram:
    start = (("pre", "dec", "start-up: handshake, layouts", "both"),) if quant else ()
    wrote = "prefill: int8 codes, scales" if quant else "prefill; lease the blocks"
    payload = "gloo: codes + scales, bytes" if quant else "gloo: header + staging buffer"
    return _d(
        stage,
        name,
        title,
        _DISAGG,
        *start,
        ("client", "fe", "POST /v1/completions"),
        ("fe", "pre", '("add", max_tokens=1)'),
        ("pre", "pre", wrote),
        ("pre", "fe", "outputs: kv_transfer_params", "reply"),
        ("fe", "dec", '("add", + kv_transfer_params)'),
        ("dec", "dec", "allocate; post the receive"),
        ("dec", "fe", 'peer: "pull" (block ids)'),
        ("fe", "pre", 'peer: "pull", relayed'),
        ("pre", "dec", payload),
        ("dec", "dec", "scatter; sample last token"),
        ("dec", "fe", 'peer: "done"'),
        ("fe", "pre", '"done" relayed: lease freed'),
        ("dec", "fe", "outputs: token ids", "reply"),
        ("fe", "client", "SSE frames", "reply"),
    )


DIAGRAMS: tuple[Diagram, ...] = (
    _d(
        "09_tp",
        "tp",
        "Stage 09, tensor parallelism (TP=2): one request",
        _TP,
        _HTTP,
        ("srv", "srv", "schedule(): SchedulerOutput"),
        ("srv", "w1", '("execute_model", output)'),
        ("w1", "w1", "forward on its shard"),
        ("srv", "w1", "all_reduce after each layer", "both"),
        ("srv", "w1", "all_gather: the logits", "both"),
        ("srv", "srv", "sample; update_from_output"),
        ("srv", "client", "SSE: data: {...}", "reply"),
    ),
    _d(
        "10_dp",
        "dp",
        "Stage 10, data parallelism (DP=2, TP=2 in replica 0): one request",
        {
            "client": "HTTP client",
            "fe": "front end process\nserver + DPClient",
            "r0": "replica 0 process\nengine core, rank 0",
            "r0w": "replica 0 worker\nTP rank 1",
            "r1": "replica 1 process\nengine core",
        },
        ("client", "fe", "POST /v1/completions"),
        ("fe", "fe", "tokenize; Router.route -> 0"),
        ("fe", "r0", '("add", EngineCoreRequest)'),
        ("r0", "r0", "_busy_loop: engine.step()"),
        ("r0", "r0w", '("execute_model", output)'),
        ("r0", "r0w", "all_reduce / all_gather", "both"),
        ("r0", "fe", "outputs: token ids, KV events", "reply"),
        ("fe", "fe", "OutputProcessor: detokenize"),
        ("fe", "client", "SSE frames", "reply"),
    ),
    _d("11_ep", "ep", "Stage 11, expert parallelism (2 ranks): one request", _TP, *_EP_STEPS),
    _d(
        "12_offload",
        "host_tier",
        "Stage 12, host tier: request A swapped out and back in",
        _HOST_TIER,
        ("eng", "eng", "_preempt(A): swap it out"),
        ("eng", "run", "SchedulerOutput + store job"),
        ("run", "copy", "submit_batch: device -> host"),
        ("run", "run", "forward the others"),
        ("copy", "run", "batch ended (polled)", "reply"),
        ("run", "eng", "KVConnectorOutput: stored", "reply"),
        ("eng", "eng", "_admit_waiting: host hit"),
        ("eng", "run", "SchedulerOutput + load job"),
        ("run", "copy", "submit_batch: host -> device"),
        ("copy", "run", "batch ended (polled)", "reply"),
        ("run", "eng", "KVConnectorOutput: loaded", "reply"),
        ("eng", "eng", "A runs on: nothing redone"),
        ("eng", "client", "SSE: A's next tokens", "reply"),
    ),
    _disagg(
        "13_disagg", "disagg", "Stage 13, disaggregated prefill and decode: one request", False
    ),
    _disagg("14_quant", "disagg_int8_kv", "Stage 14, disaggregated with an int8 KV cache", True),
    _d(
        "15_full",
        "chatbot",
        "Stage 15, preset chatbot (one process): one request",
        {
            "client": "HTTP client",
            "srv": "event loop\nserver + AsyncLLM",
            "eng": "engine loop thread\nLLMEngine + scheduler",
            "run": "runner step thread\nModelRunner",
        },
        ("client", "srv", "POST /v1/chat/completions"),
        ("srv", "eng", "the job, on AsyncLLM's queue"),
        ("eng", "eng", "schedule(): prefix hit"),
        ("eng", "run", "launch(SchedulerOutput)"),
        ("run", "run", "forward + sample"),
        ("run", "eng", "sampled token ids", "reply"),
        ("eng", "eng", "_propose: n-gram drafts"),
        ("eng", "run", "launch: token + k drafts"),
        ("run", "run", "_verify: rejection_sample"),
        ("run", "eng", "accepted drafts + 1", "reply"),
        ("eng", "srv", "RequestOutput (thread-safe)", "reply"),
        ("srv", "client", "SSE frames", "reply"),
    ),
    _d(
        "15_full",
        "api",
        "Stage 15, preset api (DP=2, cache-aware): one request",
        {
            "client": "HTTP client",
            "fe": "front end process\nserver + DPClient",
            "r0": "replica 0 process\nengine core",
            "r1": "replica 1 process\nengine core",
        },
        ("client", "fe", "POST /v1/chat/completions"),
        ("fe", "fe", "Router.route: its prefix"),
        ("fe", "r1", '("add", EngineCoreRequest)'),
        ("r1", "r1", "step(): prefix hit, decode"),
        ("r1", "fe", "outputs: token ids, KV events", "reply"),
        ("fe", "fe", "apply_events; detokenize"),
        ("fe", "client", "SSE frames", "reply"),
    ),
    _d(
        "15_full",
        "long_context",
        "Stage 15, preset long-context: a long prompt",
        _HOST_TIER,
        ("client", "eng", "POST: a long prompt"),
        ("eng", "eng", "schedule(): chunk 1 of n"),
        ("eng", "run", "SchedulerOutput: the chunk"),
        ("run", "run", "attention writes int8 codes"),
        ("eng", "eng", "pool full: _preempt (swap)"),
        ("eng", "run", "SchedulerOutput + store job"),
        ("run", "copy", "store: codes + scales"),
        ("copy", "run", "batch ended (polled)", "reply"),
        ("run", "eng", "KVConnectorOutput: stored", "reply"),
        ("eng", "run", "resume: load job"),
        ("run", "copy", "load: host -> device"),
        ("run", "eng", "KVConnectorOutput: loaded", "reply"),
        ("eng", "client", "SSE frames", "reply"),
    ),
    _d(
        "15_full",
        "moe",
        "Stage 15, preset moe (2 ranks, experts split): one request",
        _TP,
        *_EP_STEPS,
    ),
    _disagg("15_full", "disaggregated", "Stage 15, disaggregated with an int8 KV cache", True),
)


def render(diagram: Diagram) -> str:
    """The SVG text of one diagram; ValueError if a label cannot fit where it goes."""
    keys = [key for key, _ in diagram.boxes]
    x = {key: MARGIN + LANE * i + LANE // 2 for i, key in enumerate(keys)}
    width = 2 * MARGIN + LANE * len(keys)
    first = TOP + BOX_H + 28
    height = first + ROW * len(diagram.steps)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f"<title>{escape(diagram.title)}</title>",
        '<defs><marker id="h" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="7" '
        'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L8,4 L0,8 z" fill="#333"/>'
        "</marker></defs>",
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{MARGIN}" y="22" font-size="13" font-weight="bold">'
        f"{escape(diagram.title)}</text>",
    ]
    for key, label in diagram.boxes:
        lines = label.split("\n")
        _fit(label, max(map(len, lines)), LANE - 16)
        cx, left = x[key], x[key] - (LANE - 16) // 2
        out.append(
            f'<rect x="{left}" y="{TOP}" width="{LANE - 16}" height="{BOX_H}" rx="6" '
            'fill="#eaf1fb" stroke="#3b5b8c"/>'
        )
        for i, line in enumerate(lines):
            y = TOP + BOX_H // 2 + 4 + (i * 2 - len(lines) + 1) * 7
            weight = ' font-weight="bold"' if i == 0 else ""
            out.append(f'<text x="{cx}" y="{y}" text-anchor="middle"{weight}>{escape(line)}</text>')
        out.append(
            f'<line x1="{cx}" y1="{TOP + BOX_H}" x2="{cx}" y2="{height - 6}" stroke="#9aa8bd" '
            'stroke-dasharray="4 4"/>'
        )
    for n, (src, dst, label, style) in enumerate(diagram.steps, 1):
        y, text = first + ROW * (n - 1), f"{n}. {label}"
        if src == dst:
            _fit(text, len(text), LANE - 24)
            left = x[src] - (LANE - 24) // 2
            out.append(
                f'<rect x="{left}" y="{y - 11}" width="{LANE - 24}" height="18" rx="3" '
                'fill="#fff6dc" stroke="#c9a64b"/>'
            )
            out.append(f'<text x="{x[src]}" y="{y + 2}" text-anchor="middle">{escape(text)}</text>')
            continue
        x1, x2 = x[src], x[dst]
        _fit(text, len(text), abs(x2 - x1) - 8)
        step = 4 if x2 > x1 else -4
        dash = ' stroke-dasharray="5 3"' if style == "reply" else ""
        start = ' marker-start="url(#h)"' if style == "both" else ""
        out.append(
            f'<line x1="{x1 + step}" y1="{y}" x2="{x2 - step}" y2="{y}" stroke="#333"{dash}'
            f'{start} marker-end="url(#h)"/>'
        )
        mid, width = (x1 + x2) // 2, round(len(text) * 6.2) + 8
        out.append(
            f'<rect x="{mid - width // 2}" y="{y - 16}" width="{width}" height="14" fill="white"/>'
        )  # a white ground (not a stroke halo, which some renderers draw over the text)
        out.append(f'<text x="{mid}" y="{y - 5}" text-anchor="middle">{escape(text)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _fit(label: str, chars: int, room: int) -> None:
    if chars * CHAR_W > room:
        raise ValueError(f"label {label!r} is too long for its {room}px: shorten it")


def stage_diagrams(stage: str) -> list[Diagram]:
    return [d for d in DIAGRAMS if d.stage == stage]


def stage_folders() -> list[Path]:
    """Stage folders from FIRST_STAGE on (NN_name, NN >= 09)."""
    folders = (ROOT / "stages").glob("[0-9][0-9]_*")
    return sorted(p for p in folders if p.is_dir() and int(p.name[:2]) >= FIRST_STAGE)


def drift() -> list[str]:
    """Checked-in SVGs that differ from their spec, are missing, or have no spec."""
    problems = []
    for diagram in DIAGRAMS:
        rel = diagram.path.relative_to(ROOT)
        if not diagram.path.is_file():
            problems.append(f"{rel}: missing (run python tools/request_diagrams.py)")
        elif diagram.path.read_text() != render(diagram):
            problems.append(f"{rel}: differs from its spec (run python tools/request_diagrams.py)")
    known = {d.path for d in DIAGRAMS}
    for svg in sorted((ROOT / "stages").glob("*/diagrams/*.svg")):
        if svg not in known:
            problems.append(f"{svg.relative_to(ROOT)}: no spec in tools/request_diagrams.py")
    return problems


def section(readme: str) -> str | None:
    """The text of the README's "Follow one request" section (to the next "## "), or None."""
    match = re.search(rf"^{re.escape(SECTION)}\b.*?(?=^## |\Z)", readme, re.M | re.S)
    return match.group(0) if match else None


def readme_problems() -> list[str]:
    """Every stage from 09: its README has the section, the section links each of the stage's
    diagrams, and every module (`name.py`) and function or class (`Name.method`: its last part
    defined or assigned) it names exists in the stage folder (or in stages/common, which the
    stages share: the supervisor, for one), so a move that leaves the text
    behind is found."""
    problems = []
    for folder in stage_folders():
        diagrams = stage_diagrams(folder.name)
        if not diagrams:
            problems.append(f"stages/{folder.name}: no diagram in tools/request_diagrams.py")
        text = section((folder / "README.md").read_text())
        if text is None:
            problems.append(f"stages/{folder.name}/README.md: no '{SECTION}' section")
            continue
        for diagram in diagrams:
            if f"(diagrams/{diagram.name}.svg)" not in text:
                problems.append(f"stages/{folder.name}/README.md: no link to {diagram.name}.svg")
        present = {p.name for p in folder.rglob("*.py")}
        for module in sorted(set(re.findall(r"`([a-z_]+\.py)", text)) - present):
            problems.append(f"stages/{folder.name}/README.md names {module}: not in the stage")
        shared = sorted((ROOT / "stages" / "common").rglob("*.py"))  # the stages' shared code
        source = "\n".join(p.read_text() for p in [*folder.rglob("*.py"), *shared])
        defined = {a or b for a, b in re.findall(r"(?:def|class) (\w+)|(\w+) *[:=]", source)}
        for name in sorted(set(re.findall(r"`([A-Za-z_][\w.]*)`", text)) - NOT_OURS):
            if not name.endswith(".py") and name.rsplit(".", 1)[-1] not in defined:
                problems.append(f"stages/{folder.name}/README.md names {name}: not in the stage")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args(argv)
    if args.check:
        problems = drift() + readme_problems()
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    for diagram in DIAGRAMS:
        diagram.path.parent.mkdir(exist_ok=True)
        diagram.path.write_text(render(diagram))
        print(f"wrote {diagram.path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
