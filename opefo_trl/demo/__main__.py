"""``python -m opefo_trl.demo``: see ``opefo_trl.demo``."""

import sys

from opefo_trl.demo.runner import main

if __name__ == "__main__":  # not when a spawned worker process imports this module
    sys.exit(main())
