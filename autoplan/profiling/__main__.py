"""``python -m autoplan.profiling``: the same as ``autoplan profile``."""

import sys

from . import main

sys.exit(main())
