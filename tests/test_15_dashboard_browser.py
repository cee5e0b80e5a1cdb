"""Stage 15's live view in a real browser: headless Chromium against `python -m stages 15 serve`.

For each topology the page must handle (one engine, `preset=api`'s two data-parallel replicas, a
disaggregated prefill/decode pair) the test starts the real server command in its own process,
opens `/dashboard` in Chromium (driven with Selenium), sends requests, and checks what a person
would see: one panel per engine core, a step counter and a block grid that move while requests
run, and, once the server is idle again, queue counts and block counts equal to what `/health`
says. The requests are streams longer than any machine finishes while the page is read (the
long-context tiny model, `ignore_eos`); the test ends them, by disconnecting, once the page has
shown them, so a fast machine cannot finish them before the page looks. `.ci/run` installs
Debian's `chromium` and `chromium-driver` first, so CI always runs it;
elsewhere it skips, saying what is missing.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from .conftest import since

pytestmark = [since("15"), pytest.mark.timeout(240)]

BLOCK = 4
SERVER_CONFIG = ("block_size=4", "kv_cache_bytes=8388608", "max_model_len=4096")
STREAM_TOKENS = 4000  # tokens a request asks for: it is disconnected long before
PROMPTS = [f"request {i}: tell me about the block pool and the scheduler" for i in range(6)]
TOPOLOGIES = {
    "one engine": ((), ("0",)),  # in an engine-core process (the default)
    "one engine in the server's process": (("engine_core_process=false",), ("0",)),
    "preset=api": (("preset=api",), ("0", "1")),
    "disaggregated": (("disaggregated=true",), ("prefill", "decode")),
}


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from stages.common.tooling.browser import headless_chromium, missing

    if (reason := missing()) is not None:
        pytest.skip(f"{reason}; .ci/run installs them")
    driver = headless_chromium()
    try:
        yield driver
    finally:
        driver.quit()


def _wait_for(what: str, check: Callable[[], Any], seconds: float = 30.0) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"the page never showed {what} within {seconds:.0f} s")


def _panels(driver: Any) -> dict[str, dict[str, int]]:
    """What each engine core's panel shows, read from the DOM (the page's own numbers)."""
    return driver.execute_script(
        """
        const read = (el, sel) => {
          const node = el.querySelector(sel);
          return node === null ? null : parseInt(node.textContent, 10);
        };
        const out = {};
        for (const el of document.querySelectorAll('section.core')) {
          out[el.dataset.engine] = {
            waiting: read(el, '[data-queue="waiting"]'),
            running: read(el, '[data-queue="running"]'),
            loading: read(el, '[data-queue="loading"]'),
            swapped: read(el, '[data-queue="swapped"]'),
            free: read(el, '[data-blocks="free"]'),
            used: read(el, '[data-blocks="used"]'),
            cached: read(el, '[data-blocks="cached"]'),
            step: read(el, '[data-step]'),
            batch: read(el, '[data-batch-size]'),
          };
        }
        return out;
        """
    )


def _stream(url: str, prompt: str, stop: threading.Event) -> int:
    """A streamed completion of `STREAM_TOKENS`, read until `stop`; leaving the stream closes
    the connection, and the server aborts the request. Returns the tokens received."""
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": STREAM_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    tokens = 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            tokens += line.startswith("data: {")
            if stop.is_set():
                break
    return tokens


def _health_per_engine(health: dict[str, Any], labels: tuple[str, ...]) -> dict[str, dict]:
    """/health's numbers per engine label, whatever the topology's report looks like."""
    cores = health.get("replicas") or health.get("engines") or health.get("cores")
    if cores is None and labels == ("0",):  # the engine in the server's own process
        return {"0": health}
    assert cores is not None, f"/health has no per-core section: {sorted(health)}"
    if isinstance(cores, dict):
        return {str(k): v for k, v in cores.items()}
    return {label: core for label, core in zip(labels, cores, strict=True)}


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_the_live_view_follows_the_engine_in_a_real_browser(
    topology, browser, tiny_long_context_model
):
    from stages.common.tooling.server_process import ServerProcess

    extra, labels = TOPOLOGIES[topology]
    config = [arg for item in (*SERVER_CONFIG, *extra) for arg in ("--config", item)]
    model = str(tiny_long_context_model)
    with ServerProcess("15", model=model, extra_args=tuple(config), startup_timeout=120) as server:
        browser.get(f"{server.url}/dashboard")
        _wait_for("its first event", lambda: browser.execute_script(
            "return document.body.dataset.connected === 'true'"))  # fmt: skip
        before = _wait_for("a panel per engine core", lambda: (
            panels if set(panels := _panels(browser)) == set(labels) else None))  # fmt: skip

        seen_used = dict.fromkeys(labels, 0)
        seen_batch = dict.fromkeys(labels, 0)
        stop = threading.Event()
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [pool.submit(_stream, server.url, p, stop) for p in PROMPTS]
            deadline = time.monotonic() + 60
            try:  # until the page has shown blocks in use and a batch, on the cores that run
                while not (any(seen_used.values()) and any(seen_batch.values())):
                    assert time.monotonic() < deadline, f"never shown: {seen_used} {seen_batch}"
                    assert not any(f.done() for f in futures), [f.result() for f in futures]
                    for label, panel in _panels(browser).items():
                        seen_used[label] = max(seen_used[label], panel["used"] or 0)
                        seen_batch[label] = max(seen_batch[label], panel["batch"] or 0)
                    time.sleep(0.05)
            finally:
                stop.set()  # every stream disconnects at its next token
            assert all(0 < f.result() < STREAM_TOKENS for f in futures)

        # The grid and the batch moved while the requests ran, on every core that runs them.
        assert any(seen_used.values()), f"no panel ever showed a block in use: {seen_used}"
        assert any(seen_batch.values()), f"no panel ever showed a batch: {seen_batch}"
        for label in labels:
            _wait_for(f"engine {label}'s steps advance", lambda label=label: (
                (_panels(browser)[label]["step"] or 0) > (before[label]["step"] or 0)))  # fmt: skip

        # Idle again: the page's queues and block counts are /health's.
        last: list[Any] = []

        def settled() -> dict[str, dict[str, int]] | None:
            health = httpx.get(f"{server.url}/health", timeout=10).json()
            shown = _panels(browser)
            last[:] = [shown, health]
            for label, report in _health_per_engine(health, labels).items():
                panel = shown[label]
                if (panel["running"], panel["waiting"]) != (report["running"], report["waiting"]):
                    return None
                # /health counts a cached block as free (evictable); the grid tells them apart.
                if "kv_blocks_free" in report and (
                    panel["free"] + panel["cached"] != report["kv_blocks_free"]
                ):
                    return None
                if "kv_blocks_used" in report and panel["used"] != report["kv_blocks_used"]:
                    return None
            return shown

        try:
            shown = _wait_for("the queue and block counts /health reports", settled, seconds=20)
        except AssertionError as exc:
            page, health = last
            health = {k: v for k, v in health.items() if k not in ("config", "config_notes")}
            raise AssertionError(f"{exc}\npage: {page}\n/health: {health}") from None
        for label in labels:
            assert shown[label]["running"] == 0 and shown[label]["waiting"] == 0
        # Finished requests leave their full blocks cached for reuse: the grid says so.
        assert any(panel["cached"] for panel in shown.values()), shown
