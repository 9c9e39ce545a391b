"""`python -m tracon_jobs.cli`: the `tracon-jobs` command, as the process launchers run it."""

import sys

from tracon_jobs.cli import main

sys.exit(main())
