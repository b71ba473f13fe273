"""``python -m roll_ckpt.cli``."""

import sys

from . import main

sys.exit(main())
