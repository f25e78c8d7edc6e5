"""``python -m elastic.cli`` is ``elastic-run``."""

import sys

from . import main

sys.exit(main())
