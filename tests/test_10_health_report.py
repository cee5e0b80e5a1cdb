"""Stage 10: `/health` of a data-parallel front end (DPClient.health_report), alone.

A replica's queue lengths are those its last report gave; a dead replica's last report no
longer holds (issue 27: `"alive": false, "running": 3` after its process was killed): it runs
and holds nothing, so it reports zero. test_10_dp.py checks the same behind killed processes.
"""

from __future__ import annotations

import importlib
import threading
from types import SimpleNamespace

from .conftest import since, unit

pytestmark = since("10")


def _replica(alive: bool) -> SimpleNamespace:
    error = None if alive else "killed"
    return SimpleNamespace(process=SimpleNamespace(pid=1), alive=alive, devices=["cpu"],
                           num_waiting=2, num_running=3, error=error)  # fmt: skip


@unit("frontend/dp_client.py")
def test_a_dead_replica_reports_nothing_running_or_waiting(stage):
    dp_client = importlib.import_module(f"{stage.__name__}.frontend.dp_client")
    replicas = [_replica(True), _replica(False)]
    router = SimpleNamespace(stats=lambda: {"replicas": [{"load": 1}, {"load": 0}]})
    front_end = SimpleNamespace(_lock=threading.Lock(), router=router, _in_flight={},
                                replicas=replicas)  # fmt: skip
    report = dp_client.DPClient.health_report(front_end)
    assert report["status"] == "degraded"
    counts = [(r["alive"], r["running"], r["waiting"]) for r in report["replicas"]]
    assert counts == [(True, 3, 2), (False, 0, 0)]
