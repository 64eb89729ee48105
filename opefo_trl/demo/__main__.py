"""``python -m opefo_trl.demo``: see ``opefo_trl.demo``."""

import sys

from opefo_trl.demo.runner import main

sys.exit(main())
