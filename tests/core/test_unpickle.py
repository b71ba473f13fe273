"""The restricted unpickler of DCP's ``.metadata`` admits what every supported CPython writes
for it, and nothing else.

CPython 3.11.0-3.11.4 (3.11.2 is Debian 12's system Python) pickle an enum member as
``getattr(EnumClass, "NAME")``; the other releases as ``EnumClass(value)``. The first form is
written here with a pickler that reduces enums the way 3.11.2 does (the same opcodes: checked
against ``/usr/bin/python3.11`` in ``test_the_311_2_form_is_what_that_python_writes``), so every
leg tests it; the ``debian-3.11.2`` leg of the matrix writes and resumes real checkpoints on it.
"""

from __future__ import annotations

import enum
import io
import os
import pickle
import pickletools
import subprocess

import pytest
import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType

from roll_ckpt.errors import UnsafeCheckpointError
from roll_ckpt.dcp.checked import _MetadataUnpickler, safe_load_metadata

SYSTEM_311 = "/usr/bin/python3.11"


class _Pickler311(pickle.Pickler):
    """Pickles enum members as CPython 3.11.2's ``Enum.__reduce_ex__`` does."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def _metadata() -> Metadata:
    props = TensorProperties(dtype=torch.float32)
    md = TensorStorageMetadata(properties=props, size=torch.Size([4, 2]),
                               chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([4, 2]))])
    return Metadata(state_dict_metadata={"model.w": md},
                    storage_data={MetadataIndex("model.w", torch.Size([0, 0])): (LoadItemType.TENSOR,
                                                                                  WriteItemType.TENSOR)})


def _dumps_311(obj: object, protocol: int = 4) -> bytes:
    buf = io.BytesIO()
    _Pickler311(buf, protocol=protocol).dump(obj)
    return buf.getvalue()


def _globals(data: bytes) -> set[str]:
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            found.add(f"{strings[-2]}.{strings[-1]}")
        elif op.name == "GLOBAL":
            found.add(arg.replace(" ", "."))
    return found


@pytest.mark.parametrize("protocol", [2, 4])
def test_enum_members_pickled_by_name_are_admitted(protocol: int) -> None:
    data = _dumps_311(_metadata(), protocol)
    assert {"builtins.getattr", "__builtin__.getattr"} & _globals(data), "not the 3.11.2 form"
    md = safe_load_metadata(data)
    assert md.storage_data == _metadata().storage_data
    assert md.state_dict_metadata["model.w"].properties.memory_format == torch.contiguous_format


def test_enum_members_pickled_by_value_are_admitted() -> None:
    md = safe_load_metadata(pickle.dumps(_metadata()))
    assert md.storage_data == _metadata().storage_data


def test_getattr_on_a_module_is_refused() -> None:
    """``getattr(os, "system")``, written by hand: ``os`` is never an admitted global."""
    data = b"cbuiltins\ngetattr\n(cos\nsystem\nS'system'\ntR."
    with pytest.raises(UnsafeCheckpointError) as err:
        safe_load_metadata(data)
    assert "os.system is not a DCP metadata class" in str(err.value)


@pytest.mark.parametrize("target,name", [
    (torch.Size, "__reduce__"),     # an admitted class that is not an enum
    (LoadItemType, "__class__"),    # an admitted enum, a name that is not a member
    (LoadItemType, "_value2member_map_"),
])
def test_getattr_on_anything_but_an_admitted_enum_member_is_refused(target: object, name: str) -> None:
    class _Evil:
        def __reduce__(self):
            return getattr, (target, name)

    with pytest.raises(UnsafeCheckpointError) as err:
        safe_load_metadata(pickle.dumps({"x": _Evil()}), "ckpt/dcp/.metadata")
    assert "ckpt/dcp/.metadata" in str(err.value)


def test_getattr_then_call_is_refused() -> None:
    """``getattr(os, "system")("...")``: the classic payload, with getattr admitted."""
    class _Call:
        def __reduce__(self):
            return os.system, ("echo PWNED",)

    with pytest.raises(UnsafeCheckpointError):
        safe_load_metadata(pickle.dumps(_Call()))


@pytest.mark.skipif(not os.access(SYSTEM_311, os.X_OK), reason=f"no {SYSTEM_311} here")
def test_the_311_2_form_is_what_that_python_writes() -> None:
    """The pickler above writes the opcodes Debian 12's Python writes for an enum member."""
    code = ("import enum, pickle, sys\n"
            "class LoadItemType(enum.Enum):\n    TENSOR = 0\n    BYTE_IO = 1\n"
            "sys.stdout.buffer.write(pickle.dumps(LoadItemType.TENSOR, protocol=4))")
    ran = subprocess.run([SYSTEM_311, "-c", code], capture_output=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    version = subprocess.run([SYSTEM_311, "-c", "import platform; print(platform.python_version())"],
                             capture_output=True, text=True, timeout=60).stdout.strip()
    if not ("3.11.0" <= version <= "3.11.4"):
        pytest.skip(f"{SYSTEM_311} is {version}, which pickles enum members by value")

    theirs = [(op.name, arg) for op, arg, _ in pickletools.genops(ran.stdout) if op.name != "FRAME"]
    ours = [(op.name, arg) for op, arg, _ in pickletools.genops(_dumps_311(LoadItemType.TENSOR, 4))
            if op.name != "FRAME"]
    # the same opcodes and strings, but the module the enum lives in (__main__ in the child)
    assert [(n, a) for n, a in theirs if a != "__main__"] == \
           [(n, a) for n, a in ours if a != "torch.distributed.checkpoint.planner"]
    assert ("SHORT_BINUNICODE", "getattr") in theirs


def test_python_3_13s_module_for_paths_is_admitted_on_every_python() -> None:
    """Python 3.13 pickles a PosixPath as ``pathlib._local.PosixPath`` (DCP's FileSystemWriter
    records the checkpoint folder as one): read as ``pathlib.PosixPath`` everywhere."""
    import pathlib

    data = pickle.dumps(pathlib.PurePosixPath("/x"), protocol=2)
    data = data.replace(b"cpathlib\nPurePosixPath", b"cpathlib._local\nPurePosixPath")
    assert b"pathlib._local" in data
    obj = _MetadataUnpickler(io.BytesIO(data)).load()
    assert obj == pathlib.PurePosixPath("/x")
    with pytest.raises(pickle.UnpicklingError):  # the module's other names stay refused
        _MetadataUnpickler(io.BytesIO(b"cpathlib._local\nPath\n.")).load()
