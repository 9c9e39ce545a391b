""".ci/services rabbitmq, the part of .ci/run that makes RabbitMQ answer for the tests with it as
the broker: on machines with it running, stopped or missing, in the sandbox of
`test_ci_services.py` (`PATH` holds only the shell's own tools and stand-ins: rabbitmqctl
answers once the node was started, `service` starts it, apt-get installs it)."""

from __future__ import annotations

import pytest

from tests.integration.test_ci_services import Machine, stand_in
from tests.integration.test_ci_services import machine as machine  # the fixture, used here

pytestmark = pytest.mark.timeout(60)

RABBITMQCTL = '[ -e "$SANDBOX/rabbit-up" ]'
"""`rabbitmqctl -q await_startup`: the node answers once something started it."""
SERVICE = """
echo "service $*" >>"$SANDBOX/calls"
[ -e "$SANDBOX/rabbit-starts" ] && touch "$SANDBOX/rabbit-up"
exit 0
"""
APT_GET = """
echo "apt-get $*" >>"$SANDBOX/calls"
[ -e "$SANDBOX/apt-works" ] || exit 100
case "$*" in
  *"install -y rabbitmq-server"*) cp "$SANDBOX/available/rabbitmqctl" "$SANDBOX/bin/" ;;
esac
"""


@pytest.fixture
def rabbit_machine(machine: Machine) -> Machine:
    """The sandbox's root machine, with `service` and an apt-get that knows rabbitmq-server."""
    stand_in(machine.root / "available" / "rabbitmqctl", RABBITMQCTL)
    stand_in(machine.bin / "service", SERVICE)
    stand_in(machine.bin / "apt-get", APT_GET)
    (machine.root / "rabbit-starts").touch()
    return machine


def test_a_rabbitmq_that_answers_is_left_as_it_is(rabbit_machine: Machine) -> None:
    rabbit_machine.has("rabbitmqctl")
    (rabbit_machine.root / "rabbit-up").touch()

    assert rabbit_machine.run("rabbitmq") == (0, "")
    assert rabbit_machine.calls() == []


def test_a_stopped_rabbitmq_is_started(rabbit_machine: Machine) -> None:
    rabbit_machine.has("rabbitmqctl")

    code, output = rabbit_machine.run("rabbitmq")

    assert code == 0, output
    assert rabbit_machine.calls() == ["service rabbitmq-server start"]


def test_no_rabbitmq_installs_it_then_starts_it(rabbit_machine: Machine) -> None:
    code, output = rabbit_machine.run("rabbitmq")

    assert code == 0, output
    assert rabbit_machine.calls() == [
        "apt-get -qq update",
        "apt-get -qq install -y rabbitmq-server",
        "service rabbitmq-server start",
    ]


def test_a_rabbitmq_that_cannot_be_installed_fails_saying_so(rabbit_machine: Machine) -> None:
    (rabbit_machine.root / "apt-works").unlink()

    code, output = rabbit_machine.run("rabbitmq")

    assert code == 1
    assert "ci: RabbitMQ is not installed and could not be" in output


def test_a_rabbitmq_that_will_not_start_fails_naming_its_port(rabbit_machine: Machine) -> None:
    rabbit_machine.has("rabbitmqctl")
    (rabbit_machine.root / "rabbit-starts").unlink()

    code, output = rabbit_machine.run("rabbitmq")

    assert code == 1
    assert "ci: RabbitMQ does not answer on 127.0.0.1:5672" in output
