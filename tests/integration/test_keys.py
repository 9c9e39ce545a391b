"""API keys: `tracon-jobs keys list` and `keys revoke`, through the cli's `main` on the test's
database; a revoked key is refused by the next request; last use is recorded to the minute."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import MakeRuntime, scripted_agent
from tracon_jobs.cli import main
from tracon_jobs.runtime import Runtime
from web import create_app


@pytest.fixture
def runtime(
    make_runtime: MakeRuntime,
    sql_url: str,
    redis_url: str,
    write_config: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
) -> Runtime:
    path = write_config(Database={"Url": sql_url}, Redis={"Url": redis_url}, **scripted_agent([]))
    monkeypatch.setenv("TRACON_CONFIG", str(path))
    return make_runtime(sql_url, **scripted_agent([]))


def test_list_then_revoke_a_key(runtime: Runtime, capsys: pytest.CaptureFixture[str]) -> None:
    acme = runtime.tenants.ensure_tenant("acme")
    kept, revoked = runtime.tenants.issue_key(acme), runtime.tenants.issue_key(acme)
    client = create_app(runtime, {"TESTING": True}).test_client()
    headers = {"Authorization": f"Bearer {revoked.secret}"}
    assert client.get("/api/runs", headers=headers).status_code == 200

    assert main(["keys", "revoke", revoked.key_id]) == 0
    assert client.get("/api/runs", headers=headers).status_code == 401
    assert (
        client.get("/api/runs", headers={"Authorization": f"Bearer {kept.secret}"}).status_code
        == 200
    )
    assert main(["keys", "revoke", revoked.key_id]) == 1  # revoked already

    capsys.readouterr()
    assert main(["keys", "list", "--tenant", "acme"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["KEY", "TENANT"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == {kept.key_id, revoked.key_id}
    assert rows[kept.key_id].split()[1] == "acme" and rows[kept.key_id].split()[-1] == acme
    assert rows[kept.key_id].split()[-2] == "-"  # not revoked (the tenant's id comes last)
    assert rows[revoked.key_id].split()[-2] != "-"
    assert kept.secret not in "\n".join(lines)
    [used] = [k for k in runtime.tenants.keys(acme) if k.id == kept.key_id]
    assert used.last_used_at is not None
