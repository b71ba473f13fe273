"""``docs/compatibility.md``'s table, made from ``matrix/results/<leg>.json``."""

from __future__ import annotations

import json
from pathlib import Path

from .legs import LEGS

__all__ = ["RESULTS", "PAGE", "load_results", "table", "write_table"]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "matrix" / "results"
PAGE = ROOT / "docs" / "compatibility.md"
BEGIN, END = "<!-- matrix table: made by python -m matrix table -->", "<!-- end of the matrix table -->"


def load_results() -> list[dict]:
    """The recorded results, in the legs' order."""
    out = []
    for leg in LEGS:
        f = RESULTS / f"{leg.name}.json"
        if f.is_file():
            out.append(json.loads(f.read_text()))
    return out


def _minutes(seconds: int) -> str:
    return f"{seconds // 60} min {seconds % 60:02d} s"


def table(results: list[dict]) -> str:
    rows = ["| leg | whose stack | Python | torch | transformers | NumPy | Ray | passed | failed | skipped | time | run on |",
            "|---|---|---|---|---|---|---|---:|---:|---:|---:|---|"]
    skips = []
    for r in results:
        v = r["versions"]
        failed = r["failed"] + r["errors"]
        rows.append(f"| `{r['leg']}` | {r['who']} | {v['python']} | {v['torch']} | {v['transformers']} | "
                    f"{v['numpy']} | {v['ray']} | {r['passed']} | {failed} | {r['skipped']} | "
                    f"{_minutes(r['seconds'])} | {r['date']} |")
        for reason, n in sorted(r["skips"].items()):
            skips.append(f"- `{r['leg']}`, {n}×: {reason}")
    out = "\n".join(rows)
    if skips:
        out += "\n\nWhat each leg skipped, and why:\n\n" + "\n".join(skips)
    return out


def write_table() -> str:
    """Rewrite the table in :data:`PAGE` from the results; returns the table."""
    text = PAGE.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{PAGE} has no '{BEGIN}' ... '{END}' markers for the table")
    made = table(load_results())
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    PAGE.write_text(f"{head}{BEGIN}\n{made}\n{END}{tail}")
    return made
