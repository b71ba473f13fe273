"""``manifest.json``: the file whose presence commits a checkpoint.

It lists every file of the checkpoint with its size and checksum, so a checkpoint can be
verified before torch reads any of it. With ``ROLL_CKPT_SIGNING_KEY`` set, it also
carries an HMAC over its own canonical form.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import posixpath
from dataclasses import dataclass, field
from typing import Any

from .digest import ALGORITHM

__all__ = ["Manifest", "FileEntry", "MANIFEST_NAME", "FORMAT", "FORMAT_VERSION", "safe_relpath"]

MANIFEST_NAME = "manifest.json"
FORMAT = "roll-ckpt"
FORMAT_VERSION = 1
SIGNING_ENV = "ROLL_CKPT_SIGNING_KEY"


@dataclass(frozen=True)
class FileEntry:
    size: int
    checksum: str


def safe_relpath(name: str) -> bool:
    """True when ``name`` is a plain relative path that stays inside the checkpoint."""
    if not isinstance(name, str) or not name or "\\" in name or "\x00" in name:
        return False
    if name.startswith("/") or posixpath.isabs(name) or ":" in name.split("/")[0]:
        return False
    parts = name.split("/")
    return all(p not in ("", ".", "..") for p in parts)


@dataclass
class Manifest:
    step: int
    files: dict[str, FileEntry]
    created: str = ""
    world_size: int = 1
    component: str | None = None
    plugins: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def _body(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "created": self.created,
            "world_size": self.world_size,
            "component": self.component,
            "checksum_algorithm": ALGORITHM,
            "files": {k: {"size": v.size, "checksum": v.checksum} for k, v in sorted(self.files.items())},
            "plugins": dict(sorted(self.plugins.items())),
            "extra": self.extra,
        }

    @staticmethod
    def _canonical(body: dict[str, Any]) -> bytes:
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    def to_bytes(self) -> bytes:
        body = self._body()
        key = os.environ.get(SIGNING_ENV)
        if key:
            body["signature"] = {
                "algorithm": "hmac-sha256",
                "value": hmac.new(key.encode(), self._canonical(body), hashlib.sha256).hexdigest(),
            }
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> tuple["Manifest", list[str]]:
        """Parse; return the manifest and the problems found (empty when sound)."""
        try:
            body = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not valid JSON ({exc})") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise ValueError("not a roll-ckpt manifest")
        if body.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"format_version {body.get('format_version')!r} is not supported "
                             f"(this roll-ckpt reads {FORMAT_VERSION}); upgrade roll-ckpt")
        if body.get("checksum_algorithm") != ALGORITHM:
            raise ValueError(f"unknown checksum algorithm {body.get('checksum_algorithm')!r}")
        files_raw = body.get("files")
        step = body.get("step")
        if not isinstance(files_raw, dict) or not isinstance(step, int) or isinstance(step, bool):
            raise ValueError("missing or malformed 'files' or 'step'")
        problems: list[str] = []
        files: dict[str, FileEntry] = {}
        for name, ent in files_raw.items():
            if not safe_relpath(name):
                raise ValueError(f"lists the path {name!r}, which leaves the checkpoint folder")
            if (not isinstance(ent, dict) or not isinstance(ent.get("size"), int)
                    or not isinstance(ent.get("checksum"), str)):
                raise ValueError(f"malformed entry for {name!r}")
            files[name] = FileEntry(ent["size"], ent["checksum"])
        problems.extend(cls._check_signature(body))
        m = cls(step=step, files=files, created=str(body.get("created", "")),
                world_size=int(body.get("world_size", 1) or 1), component=body.get("component"),
                plugins=dict(body.get("plugins") or {}), extra=dict(body.get("extra") or {}))
        return m, problems

    @classmethod
    def _check_signature(cls, body: dict[str, Any]) -> list[str]:
        key = os.environ.get(SIGNING_ENV)
        sig = body.pop("signature", None)
        if not key:
            return []
        if not isinstance(sig, dict) or sig.get("algorithm") != "hmac-sha256":
            return [f"unsigned, but {SIGNING_ENV} is set: only signed checkpoints are accepted"]
        want = hmac.new(key.encode(), cls._canonical(body), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, str(sig.get("value", ""))):
            return [f"signature does not match {SIGNING_ENV}: the manifest was altered or signed with another key"]
        return []
