"""``python -m roll_ckpt_roll SCRIPT [ARGS...]``: run a ROLL entry script with roll-ckpt as its
checkpoint layer (:func:`roll_ckpt_roll.enable` first), the script itself unchanged."""

from __future__ import annotations

import runpy
import sys


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    from . import enable

    enable()
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
