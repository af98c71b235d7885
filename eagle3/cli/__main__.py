"""`python -m eagle3.cli …`, as the launchers start the reference server."""

import sys

from eagle3.cli import main

sys.exit(main())
