"""How long the tests wait for a fact before they say it never came."""

TIMEOUT_SLACK = 3
"""What every wait's timeout is multiplied by (`tests.helpers.wait_until`, the webhook and
trace receivers' `wait_for`): the allowance of a loaded machine, four test processes on two
cores, each with its own servers. It changes only how long a wait that fails takes to say so; a
bound on how long something may take is asserted on the seconds a wait returns, never on its
timeout."""
