"""make_abortable: every connection pool of a client gets the abortable backend, or it fails."""

from __future__ import annotations

import httpx2
import pytest

from tracon_jobs.providers.abortable_http import AbortableBackend, make_abortable


def _backends(client: httpx2.Client) -> list[object]:
    transports = [client._transport, *client._mounts.values()]
    return [t._pool._network_backend for t in transports if t is not None]  # type: ignore[attr-defined]


def test_the_direct_pool_and_a_proxy_pool_are_both_made_abortable() -> None:
    client = httpx2.Client(proxy="http://127.0.0.1:9", trust_env=False)

    make_abortable(client)

    backends = _backends(client)
    assert len(backends) == 2
    assert all(isinstance(backend, AbortableBackend) for backend in backends)


def test_a_client_on_another_transport_is_refused() -> None:
    client = httpx2.Client(transport=httpx2.MockTransport(lambda request: httpx2.Response(200)))

    with pytest.raises(TypeError, match="cannot make MockTransport abortable"):
        make_abortable(client)
