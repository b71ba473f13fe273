"""``manifest.json``: the file whose presence commits a checkpoint.

It lists every file of the checkpoint with its size and checksum, so a checkpoint can be
verified before torch reads any of it, and carries a checksum of its own content
(``manifest_checksum``), so a damaged manifest is reported as such rather than as damage
to the files it describes. With ``ROLL_CKPT_SIGNING_KEY`` set, it also carries an HMAC
over its own canonical form.

**Digests.** Checksums: xxHash's XXH3-128 (fast, maintained), computed while data streams by.

A file is described by its whole checksum and, for files written by roll-ckpt's own
writer, the checksums of its :data:`CHUNK_SIZE` pieces: a reader can then check the pieces
in parallel, or each piece before it uses it, without reading the file twice.

**Verification.** Verification: a checkpoint is compared with its manifest before torch reads it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import posixpath
import xxhash
import errno
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable

from ..errors import CheckpointCorruptError, CheckpointNotFoundError, UnsafeCheckpointError
from ..contracts import Storage

__all__ = ['Manifest', 'FileEntry', 'MANIFEST_NAME', 'FORMAT', 'FORMAT_VERSION', 'safe_relpath', 'seal', 'UnsafeManifestError', 'BESIDE_KEY', 'beside', 'ALGORITHM', 'CHUNK_SIZE', 'hash_stream', 'hash_bytes', 'hash_chunk', 'verify', 'read_manifest', 'list_files', 'VerifyReport', 'content_fault']



# ---- digests ---------------------------------------------------------------

ALGORITHM = "xxh3_128"
CHUNK_SIZE = 8 << 20
"""The pieces a file's chunk checksums cover (the last one may be shorter)."""
_CHUNK = 256 << 10
"""Read size of :func:`hash_stream`: small enough that the hash reads the chunk from the CPU
cache the read just filled (8 MiB chunks cost about 40% more CPU per byte)."""


def hash_stream(stream: BinaryIO, on_bytes=None) -> tuple[int, str]:
    """The size and checksum of what ``stream`` holds from where it is to its end."""
    h = xxhash.xxh3_128()
    size = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    while True:
        n = stream.readinto(view) if hasattr(stream, "readinto") else None
        if n is None:
            chunk = stream.read(_CHUNK)
            n = len(chunk)
            if not n:
                break
            h.update(chunk)
        else:
            if not n:
                break
            h.update(view[:n])
        size += n
        if on_bytes is not None:
            on_bytes(n)
    return size, h.hexdigest()


def hash_bytes(data: bytes) -> tuple[int, str]:
    return len(data), xxhash.xxh3_128_hexdigest(data)


def hash_chunk(data: bytes | bytearray | memoryview) -> str:
    """The checksum of one piece (``xxhash`` releases the GIL: pieces hash in parallel)."""
    return xxhash.xxh3_128_hexdigest(data)


# ---- the manifest ----------------------------------------------------------

MANIFEST_NAME = "manifest.json"
FORMAT = "roll-ckpt"
FORMAT_VERSION = 1
SIGNING_ENV = "ROLL_CKPT_SIGNING_KEY"
CHECKSUM_FIELD = "manifest_checksum"


class UnsafeManifestError(ValueError):
    """The manifest names a path outside the checkpoint folder (``problems`` says which)."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def seal(body: dict[str, Any]) -> bytes:
    """The bytes of ``manifest.json`` for ``body``: with its own checksum, and signed when
    ``ROLL_CKPT_SIGNING_KEY`` is set (any ``manifest_checksum``/``signature`` in ``body``
    is replaced)."""
    body = {k: v for k, v in body.items() if k not in (CHECKSUM_FIELD, "signature")}
    body[CHECKSUM_FIELD] = hash_bytes(_canonical(body))[1]
    key = os.environ.get(SIGNING_ENV)
    if key:
        body["signature"] = {
            "algorithm": "hmac-sha256",
            "value": hmac.new(key.encode(), _canonical(body), hashlib.sha256).hexdigest(),
        }
    return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()


@dataclass(frozen=True)
class FileEntry:
    size: int
    checksum: str
    chunks: tuple[str, ...] = ()
    """Checksums of the file's ``chunk_size`` pieces (files of roll-ckpt's own writer;
    empty for others and for checkpoints written before they were recorded)."""
    chunk_size: int = CHUNK_SIZE
    """The manifest's ``chunk_size`` (kept with each entry for the readers that check pieces)."""
    taken_over: str = ""
    """The checkpoint (``checkpoint-<step>``) this file's bytes were taken over from by an
    incremental save (:mod:`roll_ckpt.dcp.writer`); the file is whole here either way."""


def safe_relpath(name: str) -> bool:
    """True when ``name`` is a plain relative path that stays inside the checkpoint."""
    if not isinstance(name, str) or not name or "\\" in name or "\x00" in name:
        return False
    if name.startswith("/") or posixpath.isabs(name) or ":" in name.split("/")[0]:
        return False
    parts = name.split("/")
    return all(p not in ("", ".", "..") for p in parts)


def _file_body(entry: FileEntry) -> dict[str, Any]:
    body: dict[str, Any] = {"size": entry.size, "checksum": entry.checksum}
    if entry.chunks:
        body["chunks"] = list(entry.chunks)
    if entry.taken_over:
        body["taken_over"] = entry.taken_over
    return body


@dataclass
class Manifest:
    step: int
    files: dict[str, FileEntry]
    created: str = ""
    world_size: int = 1
    component: str | None = None
    plugins: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    chunk_size: int = CHUNK_SIZE
    """The size of the pieces the files' chunk checksums cover."""

    @property
    def parts(self) -> dict[str, dict]:
        """The parts a step's manifest lists, by component (``extra[COMPONENTS_KEY]``); empty for
        a checkpoint without components (:mod:`roll_ckpt.format.components`)."""
        parts = self.extra.get(COMPONENTS_KEY)
        return dict(parts) if isinstance(parts, dict) else {}

    def as_dict(self) -> dict[str, Any]:
        """The manifest as the JSON values ``manifest.json`` holds (its own checksum aside)."""
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "created": self.created,
            "world_size": self.world_size,
            "component": self.component,
            "checksum_algorithm": ALGORITHM,
            "chunk_size": self.chunk_size,
            "files": {k: _file_body(v) for k, v in sorted(self.files.items())},
            "plugins": dict(sorted(self.plugins.items())),
            "extra": self.extra,
        }

    def to_bytes(self) -> bytes:
        return seal(self.as_dict())

    @classmethod
    def from_bytes(cls, data: bytes) -> tuple["Manifest", list[str]]:
        """Parse; return the manifest and the problems found (empty when sound).

        Raises ``ValueError`` when the manifest is damaged (not JSON, its own checksum does
        not match, malformed) and :class:`UnsafeManifestError` when it names a path that
        leaves the checkpoint folder. The problems returned concern its signature.
        """
        try:
            body = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not valid JSON ({exc})") from None
        if not isinstance(body, dict) or (body.get("format") != FORMAT and CHECKSUM_FIELD not in body):
            raise ValueError("not a roll-ckpt manifest")
        signature = body.pop("signature", None)
        stored = body.pop(CHECKSUM_FIELD, None)
        unsafe = [f"lists the path {name!r}, which leaves the checkpoint folder"
                  for name in (body.get("files") if isinstance(body.get("files"), dict) else {})
                  if not safe_relpath(name)]
        damaged = None
        if stored is None:
            damaged = f"has no {CHECKSUM_FIELD} (damaged, or not written by roll-ckpt)"
        elif stored != hash_bytes(_canonical(body))[1]:
            damaged = "checksum mismatch (the manifest changed after it was written)"
        if unsafe:
            raise UnsafeManifestError(unsafe + ([damaged] if damaged else []))
        if damaged:
            raise ValueError(damaged)
        if body.get("format") != FORMAT:
            raise ValueError("not a roll-ckpt manifest")
        if body.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"format_version {body.get('format_version')!r} is not supported "
                             f"(this roll-ckpt reads {FORMAT_VERSION}); upgrade roll-ckpt")
        if body.get("checksum_algorithm") != ALGORITHM:
            raise ValueError(f"unknown checksum algorithm {body.get('checksum_algorithm')!r}")
        chunk_size = body.get("chunk_size", CHUNK_SIZE)
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise ValueError("malformed 'chunk_size'")
        files_raw = body.get("files")
        step = body.get("step")
        if not isinstance(files_raw, dict) or not isinstance(step, int) or isinstance(step, bool):
            raise ValueError("missing or malformed 'files' or 'step'")
        problems: list[str] = []
        files: dict[str, FileEntry] = {}
        for name, ent in files_raw.items():
            if (not isinstance(ent, dict) or not isinstance(ent.get("size"), int)
                    or not isinstance(ent.get("checksum"), str)):
                raise ValueError(f"malformed entry for {name!r}")
            chunks = ent.get("chunks", [])
            if not isinstance(chunks, list) or not all(isinstance(c, str) for c in chunks) or (
                    chunks and len(chunks) != -(-ent["size"] // chunk_size)):
                raise ValueError(f"malformed chunk checksums for {name!r}")
            taken = ent.get("taken_over", "")
            if not isinstance(taken, str):
                raise ValueError(f"malformed 'taken_over' of {name!r}")
            files[name] = FileEntry(ent["size"], ent["checksum"], tuple(chunks), chunk_size, taken)
        if signature is not None:
            body["signature"] = signature
        body[CHECKSUM_FIELD] = stored
        problems.extend(cls._check_signature(body))
        world_size, component = body.get("world_size", 1), body.get("component")
        plugins, extra = body.get("plugins") or {}, body.get("extra") or {}
        if (not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1
                or not isinstance(plugins, dict) or not isinstance(extra, dict)
                or not (component is None or isinstance(component, str))):
            raise ValueError("malformed 'world_size', 'component', 'plugins' or 'extra'")
        m = cls(step=step, files=files, created=str(body.get("created", "")), world_size=world_size,
                component=component, plugins=dict(plugins), extra=dict(extra), chunk_size=chunk_size)
        return m, problems

    @classmethod
    def _check_signature(cls, body: dict[str, Any]) -> list[str]:
        key = os.environ.get(SIGNING_ENV)
        sig = body.pop("signature", None)
        if not key:
            return []
        if not isinstance(sig, dict) or sig.get("algorithm") != "hmac-sha256":
            return [f"unsigned, but {SIGNING_ENV} is set: only signed checkpoints are accepted"]
        want = hmac.new(key.encode(), _canonical(body), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, str(sig.get("value", ""))):
            return [f"signature does not match {SIGNING_ENV}: the manifest was altered or signed with another key"]
        return []


COMPONENTS_KEY = "components"
"""``manifest.extra[COMPONENTS_KEY]`` of a step: ``{component: {"step", "world_size", "strategy"}}``."""

BESIDE_KEY = "beside"
"""``manifest.extra[BESIDE_KEY]``: names (glob patterns) of files another program adds to the
checkpoint's folder once it is committed (``checkpoint_config.beside``), not covered."""


def beside(manifest: "Manifest", name: str) -> bool:
    """``name`` (relative to the checkpoint) is a file the manifest says another program adds."""
    import fnmatch

    patterns = manifest.extra.get(BESIDE_KEY) or ()
    return "/" not in name and any(fnmatch.fnmatchcase(name, p) for p in patterns)


# ---- verification ----------------------------------------------------------

@dataclass(frozen=True)
class VerifyReport:
    path: str
    manifest: Manifest
    files: int
    bytes: int
    beside: list[str]
    """Files another program added to the folder once it was committed (``checkpoint_config.beside``):
    not covered by the manifest."""


def list_files(storage: Storage, root: str, prefix: str = "") -> dict[str, int]:
    """Every file below ``root`` as ``relative/path -> size``."""
    out: dict[str, int] = {}
    for e in storage.list(root):
        rel = f"{prefix}{e.name}"
        if e.is_dir:
            out.update(list_files(storage, e.path, rel + "/"))
        else:
            out[rel] = e.size
    return out


def unsafe_read_fault(exc: OSError) -> str:
    """What a file that cannot be opened safely is (local disks open with ``O_NOFOLLOW``)."""
    if exc.errno == errno.ELOOP:
        return "is a symbolic link, refused (a checkpoint holds regular files inside its folder)"
    return f"cannot be read safely ({exc.strerror or exc})"


def content_fault(entry: FileEntry | None, size: int, digest: str) -> str | None:
    """What is wrong with a file's bytes as read (``size`` bytes hashing to ``digest``)
    compared with its manifest ``entry`` (``None``: the manifest does not list it); ``None``
    when they match. The one comparison of read bytes with the manifest: :func:`verify`
    and the readers of a resume (:mod:`roll_ckpt.dcp.reader`) use it."""
    if entry is None:
        return "not listed in the manifest"
    if size != entry.size:
        return f"read {size} bytes, the manifest says {entry.size}"
    if digest != entry.checksum:
        return "checksum mismatch (the content changed after it was written)"
    return None


def read_manifest(storage: Storage, path: str) -> Manifest:
    """The manifest of the committed checkpoint at ``path``, checked (its own checksum, the
    paths it lists, its signature). :class:`CheckpointNotFoundError` where ``path`` is no
    folder, or holds no manifest: the open tells, with no look for the file before it."""
    if not storage.isdir(path):
        raise CheckpointNotFoundError(f"no checkpoint at {path}: the folder does not exist")
    try:
        try:
            with storage.open_read(storage.join(path, MANIFEST_NAME)) as f:
                data = f.read()
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"{path} is not a committed checkpoint (no {MANIFEST_NAME}): it is either not a "
                "roll-ckpt checkpoint or a save that never finished; resume from another one"
            ) from None
        except OSError as exc:  # e.g. a link planted in place of the manifest
            raise UnsafeCheckpointError(path, [(MANIFEST_NAME, unsafe_read_fault(exc))]) from None
        manifest, problems = Manifest.from_bytes(data)
    except UnsafeManifestError as exc:
        raise UnsafeCheckpointError(path, [(MANIFEST_NAME, p) for p in exc.problems]) from None
    except ValueError as exc:
        raise CheckpointCorruptError(path, [(MANIFEST_NAME, str(exc))]) from None
    if problems:
        raise UnsafeCheckpointError(path, [(MANIFEST_NAME, p) for p in problems])
    return manifest


def verify(storage: Storage, path: str, *, checksums: bool = True,
           on_bytes: Callable[[int], None] | None = None,
           defer: str = "", manifest: Manifest | None = None) -> VerifyReport:
    """Check every file of the checkpoint at ``path`` against its manifest.

    Raises :class:`CheckpointCorruptError` naming every file that is missing, of the
    wrong size, with the wrong checksum, or not listed. Links are refused. Files whose
    name starts with ``defer`` (a folder, ``"dcp/"``) get every check but the checksum: the
    caller checks that while it reads them (``resume`` does, through
    :class:`~roll_ckpt.dcp.reader.SafeReader`).
    ``manifest``: the one :func:`read_manifest` just read from ``path`` (a resume reads it
    first to find the part it loads); ``None``: read here.
    """
    if manifest is None:
        manifest = read_manifest(storage, path)
    present = list_files(storage, path)
    present.pop(MANIFEST_NAME, None)
    faults: list[tuple[str, str]] = []
    others = sorted(set(present) - set(manifest.files))
    for name in others:
        if not beside(manifest, name):
            faults.append((name, "unexpected file, not listed in the manifest"))
    total = 0
    for name, ent in sorted(manifest.files.items()):
        if name not in present:
            faults.append((name, "missing"))
            continue
        if present[name] != ent.size:
            faults.append((name, f"size {present[name]} bytes, the manifest says {ent.size} (truncated or altered)"))
            continue
        total += ent.size
        if checksums and not (defer and name.startswith(defer)):
            try:
                with storage.open_read(storage.join(path, name)) as f:
                    size, digest = hash_stream(f, on_bytes)
            except OSError as exc:  # e.g. a link, refused by O_NOFOLLOW
                faults.append((name, unsafe_read_fault(exc)))
                continue
            if (fault := content_fault(ent, size, digest)) is not None:
                faults.append((name, fault))
    if faults:
        raise CheckpointCorruptError(path, faults)
    return VerifyReport(path, manifest, len(manifest.files), total, [n for n in others if beside(manifest, n)])
