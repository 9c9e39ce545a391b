"""A process that competes for one singleton lease and logs, every tick, what it believes.

Run as `python -m tests.e2e.lease_contender REDIS_URL LEASE TTL_MS LOG_KEY`. It asks
`is_owner` once (which makes the lease wanted) and from then on relies on `Singleton`'s own
background thread, so a takeover measures the elector, not this loop. Every record is a
JSON list pushed to LOG_KEY, times in Redis server milliseconds:

    ["op", pid, script, at_ms, granted]     one per acquire or renewal; `at_ms` is read in
                                            the same MULTI as the script, so it is the
                                            instant the lease was set to expire from
    ["tick", pid, before_ms, after_ms, believed]
                                            `still_owner` evaluated between the two reads

While the key `LOG_KEY:hang:PID` exists, the next acquire or renewal blocks before it
reaches Redis, as a renewal stuck on a dead socket would, and the tick loop goes on.
"""

from __future__ import annotations

import json
import os
import sys
import time

import redis

from tracon_jobs.coordination.leases import RedisLeaseStore, Singleton
from tracon_jobs.coordination.scripts import source

TICK_SECONDS = 0.01


def server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


class RecordingLeaseStore(RedisLeaseStore):
    """The real scripts, each run in a MULTI right after TIME, and logged."""

    def __init__(self, client: redis.Redis, log_key: str) -> None:
        super().__init__(client)
        self.log_key = log_key
        self.lua = {n: client.register_script(source(n)) for n in ("lease_acquire", "lease_renew")}

    def acquire(self, name: str, owner: str, ttl_ms: int) -> bool:
        return self._recorded("lease_acquire", name, owner, ttl_ms)

    def renew(self, name: str, owner: str, ttl_ms: int) -> bool:
        return self._recorded("lease_renew", name, owner, ttl_ms)

    def _recorded(self, script: str, name: str, owner: str, ttl_ms: int) -> bool:
        while self.client.exists(f"{self.log_key}:hang:{os.getpid()}"):
            time.sleep(TICK_SECONDS)
        pipe = self.client.pipeline(transaction=True)
        pipe.time()
        self.lua[script](keys=[self.key(name)], args=[owner, ttl_ms], client=pipe)
        (seconds, micros), granted = pipe.execute()
        at = int(seconds) * 1000 + int(micros) // 1000
        record = ["op", os.getpid(), script, at, bool(granted)]
        self.client.rpush(self.log_key, json.dumps(record))
        return bool(granted)


def main(url: str, lease: str, ttl_ms: int, log_key: str) -> None:
    client = redis.Redis.from_url(url)
    store = RecordingLeaseStore(client, log_key)
    singleton = Singleton(store, f"contender/{os.getpid()}", ttl_ms)
    singleton.is_owner(lease)
    print("ready", flush=True)
    while True:
        before = server_ms(client)
        believed = singleton.still_owner(lease)
        after = server_ms(client)
        client.rpush(log_key, json.dumps(["tick", os.getpid(), before, after, believed]))
        time.sleep(TICK_SECONDS)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
