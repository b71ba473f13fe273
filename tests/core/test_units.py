"""Sizes as people write them (``--max-shard-size 5GB``) and read them."""

from __future__ import annotations

import pytest

from roll_ckpt.runtime.units import human_bytes, parse_size


@pytest.mark.parametrize("text,expected", [
    ("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("200KB", 200_000), ("200kb", 200_000), ("2GiB", 2 * 2**30),
    ("1.5MB", 1_500_000), ("3 MiB", 3 * 2**20), ("10k", 10_000), ("1024", 1024), ("12B", 12), (4096, 4096),
])
def test_parse_size(text, expected) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "x", "5XB", "-1", "0", "1e9", "GB"])
def test_parse_size_refuses_what_is_not_a_size(text) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_human_bytes() -> None:
    assert human_bytes(1536) == "1.5 KiB" and human_bytes(None) == "-" and human_bytes(12) == "12 B"
