"""``python -m matrix``: build legs, run the suite in them, record the results.

    python -m matrix pins default           the leg's pins, one a line (make venv reads them)
    python -m matrix build roll-2.8         .matrix/roll-2.8/ with the leg's stack
    python -m matrix test roll-2.8 [...]    build it if needed, run the whole suite in it
    python -m matrix test --all --record    every leg; results into matrix/results/, the docs' table
    python -m matrix table                  docs/compatibility.md's table from matrix/results/

Options of ``test``: ``--workers N`` (2, as make test), ``--record``; anything after ``--``
goes to pytest (a run given pytest arguments is not the whole suite and is never recorded).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys

from . import legs as legs_mod
from .report import RESULTS, write_table
from .run import build, run_suite, venv_of


def _passed(result: dict) -> bool:
    return result["failed"] == 0 and result["errors"] == 0 and result["exit"] == 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1:]
    ap = argparse.ArgumentParser(prog="python -m matrix", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pins")
    p.add_argument("leg")
    p = sub.add_parser("build")
    p.add_argument("legs", nargs="+")
    p = sub.add_parser("test")
    p.add_argument("legs", nargs="*")
    p.add_argument("--all", action="store_true")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--record", action="store_true")
    sub.add_parser("table")
    args = ap.parse_args(argv)

    if args.cmd == "pins":
        print("\n".join(legs_mod.by_name(args.leg).pins))
        return 0
    if args.cmd == "build":
        for name in args.legs:
            print(build(legs_mod.by_name(name)))
        return 0
    if args.cmd == "table":
        print(write_table())
        return 0

    chosen = list(legs_mod.LEGS) if args.all else [legs_mod.by_name(n) for n in args.legs]
    if not chosen:
        ap.error("name the legs to test, or --all")
    for leg in chosen:  # every environment first: the cross-version tests write and read in the others
        build(leg)
    failed = []
    for leg in chosen:
        result = run_suite(leg, venv_of(leg) / "bin" / "python", args.workers, extra, recording=args.record)
        if not _passed(result):
            failed.append(leg.name)
        if args.record and result["whole_suite"]:
            RESULTS.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(venv_of(leg) / "result.json", RESULTS / f"{leg.name}.json")
    if args.record:
        print(write_table())
    for name in failed:
        result = json.loads((venv_of(legs_mod.by_name(name)) / "result.json").read_text())
        print(f"[{name}] failed: " + ", ".join(result["failures"][:20]), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
