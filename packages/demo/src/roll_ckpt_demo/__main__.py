"""``python -m roll_ckpt_demo ARGS`` is ``roll-ckpt demo ARGS`` (each rank of ``--nproc N`` runs it)."""

import sys

from .launch import main

sys.exit(main())
