"""``python -m kvtrim`` runs the command line."""

import sys

from kvtrim.cli import main

sys.exit(main())
