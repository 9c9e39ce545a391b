"""RabbitMQ for the tests: a virtual host of the test session's own on the machine's server
(127.0.0.1:5672, `guest`), created with `rabbitmqctl` and deleted after, so a test never
touches a queue, exchange or message it did not create.

`rabbitmqctl` talks to the node as the Erlang cookie's owner (root, or the `rabbitmq` user):
without it, or with no server answering, the tests that need RabbitMQ skip, saying which is
missing (they fail under CI, `tests.helpers.missing_service`).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import uuid

from amqp.exceptions import ChannelError, PreconditionFailed
from kombu import Connection

HOST = "127.0.0.1"
PORT = 5672
USER = "guest"  # RabbitMQ's own account, allowed from loopback only
PASSWORD = "guest"
VHOST_PREFIX = "tj-test-"
RABBITMQCTL_SECONDS = 60.0
"""One `rabbitmqctl` call: a second or two (it starts an Erlang node of its own each time)."""


def answers(host: str = HOST, port: int = PORT, timeout: float = 1.0) -> bool:
    """Whether something accepts connections on RabbitMQ's AMQP port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def rabbitmqctl() -> str | None:
    """The `rabbitmqctl` binary (Debian installs it in /usr/sbin, off a user's PATH)."""
    return shutil.which("rabbitmqctl") or shutil.which("rabbitmqctl", path="/usr/sbin:/usr/bin")


class VirtualHost:
    """A virtual host created for this session, `guest` allowed everything in it."""

    def __init__(self, executable: str) -> None:
        self.executable = executable
        self.name = f"{VHOST_PREFIX}{uuid.uuid4().hex[:10]}"
        self._ctl("add_vhost", self.name)
        try:
            self._ctl("set_permissions", "-p", self.name, USER, ".*", ".*", ".*")
        except RuntimeError:
            self.delete()
            raise

    @property
    def url(self) -> str:
        """The AMQP URL of this virtual host (Celery's `Broker:Url`)."""
        return f"amqp://{USER}:{PASSWORD}@{HOST}:{PORT}/{self.name}"

    def delete(self) -> None:
        """Delete the virtual host with every queue and message in it."""
        self._ctl("delete_vhost", self.name)

    def _ctl(self, *args: str) -> None:
        done = subprocess.run(
            [self.executable, *args],
            capture_output=True,
            text=True,
            timeout=RABBITMQCTL_SECONDS,
            check=False,
        )
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()
            raise RuntimeError(
                f"rabbitmqctl {args[0]} failed: {said[-1] if said else done.returncode}"
            )


def purge_queues(url: str, names: list[str]) -> None:
    """Drop the ready messages of these queues of `url`'s virtual host (a queue that is not
    there yet is left so).

    Purged, not deleted: kombu's producer pools are the process's, keyed by the broker's URL,
    and a connection declares a queue once; a queue deleted under it would swallow the next
    test's messages unroutable (acknowledged all the same) until something declares it again.
    """
    with Connection(url, connect_timeout=5) as connection:
        for name in names:
            channel = connection.channel()
            try:
                channel.queue_purge(name)
            except ChannelError:  # NOT_FOUND closes the channel: the next name gets a new one
                continue
            channel.close()


def queue_depth(url: str, name: str) -> tuple[int, int]:
    """(messages ready, consumers) of a queue of `url`'s virtual host: a message a consumer
    took and has not acknowledged (prefetched) is no longer ready."""
    with Connection(url, connect_timeout=5) as connection:
        channel = connection.channel()
        try:
            _, ready, consumers = channel.queue_declare(name, passive=True)
        finally:
            channel.close()
    return int(ready), int(consumers)


def queue_type(url: str, name: str) -> str:
    """`quorum` or `classic`: the type RabbitMQ holds a queue of `url`'s virtual host to. Declared
    again as a classic queue, a quorum queue is refused (`PRECONDITION_FAILED`, inequivalent
    `x-queue-type`), and a classic one is left as it is."""
    with Connection(url, connect_timeout=5) as connection:
        channel = connection.channel()
        try:
            channel.queue_declare(name, passive=True)  # NOT_FOUND unless it is there
            channel.queue_declare(name, durable=True, auto_delete=False)
        except PreconditionFailed as refused:
            if "x-queue-type" not in str(refused):
                raise
            return "quorum"
        channel.close()
    return "classic"
