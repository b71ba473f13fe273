"""The torchtitan tests' assets (their helpers: ``_tt.py``)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def tt_assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """torchtitan's test tokenizer (assets/tokenizer) and a seeded stand-in for its c4_test data."""
    data = tmp_path_factory.mktemp("c4_test")
    rnd = random.Random(0)
    words = ("the of and to in a is that for it as was with be by on not he this are or his from at which but have "
             "an they you were her she there been one all we their has would when if so no will more model train step "
             "checkpoint rank shard tensor data loss save load resume").split()
    with open(data / "data.json", "w") as f:
        for i in range(2000):
            text = " ".join(rnd.choice(words) for _ in range(rnd.randint(40, 200)))
            f.write(json.dumps({"text": text, "timestamp": "2019-01-01T00:00:00Z",
                                "url": f"https://example.invalid/{i}"}) + "\n")
    return {"tokenizer": str(HERE / "assets" / "tokenizer"), "data": str(data)}
