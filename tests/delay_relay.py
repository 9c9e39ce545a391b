"""A TCP relay that delays what it forwards: the partition tests' stand-in for netem, which
the machine's kernel may lack (`tc qdisc add ... netem`: "Specified qdisc kind is unknown").

    python -m tests.delay_relay LISTEN_HOST LISTEN_PORT TARGET_HOST TARGET_PORT DELAY_FILE

Every chunk read from either side is written to the other side once the delay has passed
since it was read, in order: a request and its reply each wait the delay, so the round trip
grows by twice the delay. The delay is the number of milliseconds in `DELAY_FILE` (a missing
or empty file: none), read every 50 ms, so a test adds or removes latency while connections
stay open. It runs until killed, printing `listening` once it accepts connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path

CHUNK = 65536
POLL_SECONDS = 0.05


class Delay:
    """The delay each direction adds, read from a file while the relay runs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds = 0.0

    def read(self) -> None:
        try:
            text = self.path.read_text().strip()
        except OSError:
            text = ""
        self.seconds = float(text) / 1000 if text else 0.0

    async def follow(self) -> None:
        while True:
            self.read()
            await asyncio.sleep(POLL_SECONDS)


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: Delay) -> None:
    """Forward `reader` to `writer`, each chunk `delay` after it was read; ends at EOF."""
    loop = asyncio.get_running_loop()
    due: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def read() -> None:
        while chunk := await reader.read(CHUNK):
            due.put_nowait((loop.time() + delay.seconds, chunk))
        due.put_nowait((loop.time() + delay.seconds, b""))

    async def write() -> None:
        while True:
            at, chunk = await due.get()
            wait = at - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not chunk:
                return
            writer.write(chunk)
            await writer.drain()

    reading = asyncio.ensure_future(read())
    try:
        await write()
    finally:
        reading.cancel()


async def relay(
    target: tuple[str, int], delay: Delay, down: asyncio.StreamReader, client: asyncio.StreamWriter
) -> None:
    """One connection: both directions until either side closes, then both close."""
    try:
        up, server = await asyncio.open_connection(*target)
    except OSError:
        client.close()
        return
    directions = [
        asyncio.ensure_future(pump(down, server, delay)),
        asyncio.ensure_future(pump(up, client, delay)),
    ]
    with contextlib.suppress(Exception):
        await asyncio.wait(directions, return_when=asyncio.FIRST_COMPLETED)
    for direction in directions:
        direction.cancel()
    for writer in (client, server):
        writer.close()


async def main(argv: list[str]) -> None:
    listen_host, listen_port, target_host, target_port, delay_file = argv
    delay = Delay(Path(delay_file))
    delay.read()
    follower = asyncio.ensure_future(delay.follow())
    target = (target_host, int(target_port))

    async def accepted(down: asyncio.StreamReader, client: asyncio.StreamWriter) -> None:
        await relay(target, delay, down, client)

    server = await asyncio.start_server(accepted, listen_host, int(listen_port))
    print("listening", flush=True)
    async with server:
        await server.serve_forever()
    follower.cancel()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
