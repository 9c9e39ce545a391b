"""The fast paths' switch reaches every process a test starts: the CI pass that runs the
real-process tests with `TRACON_FAST_PATHS=off` proves the library paths only if the workers
it starts take them too (the cluster passes no other `TRACON_*` variable of the test's)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.e2e.cluster import Cluster
from tests.helpers import scripted_agent
from tracon_jobs.worker.broker import TRANSPORT

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


@pytest.mark.parametrize("switch", ["on", "off"])
def test_a_worker_takes_the_broker_path_the_switch_names(
    make_cluster: Callable[..., Cluster],
    sqlite_url: str,
    monkeypatch: pytest.MonkeyPatch,
    switch: str,
) -> None:
    monkeypatch.setenv("TRACON_FAST_PATHS", switch)
    monkeypatch.setenv("TRACON_LOG_FORMAT", "json")  # the test's: it stays out
    cluster = make_cluster(sqlite_url, **scripted_agent([{"Text": "-"}]))

    worker = cluster.worker("w1", concurrency=1)

    assert cluster.env["TRACON_FAST_PATHS"] == switch
    assert "TRACON_LOG_FORMAT" not in cluster.env
    [banner] = [line for line in worker.text().splitlines() if ".> transport:" in line]
    assert (TRANSPORT.split(":")[0] in banner) == (switch == "on"), banner
