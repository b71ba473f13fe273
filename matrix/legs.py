"""The legs of the matrix: who runs each stack, and its exact pins.

ROLL ships requirement sets for torch 2.6 (transformers 4.51), 2.8 (4.57) and 2.10
(transformers 5.2), all with numpy < 2 on Python 3.10; verl pins torch 2.11. The default
leg is ``make test``'s; the newest is the newest release of each that pip installs here. The
torchtitan leg is the default's torch and Python with torchtitan 0.3.0 from PyPI beside it: the only
leg where torchtitan is installed, so the only one that runs its integration's tests (it runs the
whole suite too: its pins, datasets < 4.8 and what that holds back, are within the range).

A framework leg (:attr:`Leg.framework`) installs a framework roll-ckpt integrates with (verl,
from PyPI) on the stack that framework resolves to, and runs that integration's tests
(:attr:`Leg.tests`): it checks the integration inside the real framework, not the supported
range, so its stack is not among the range's bounds (``tests/compat/test_seams.py`` checks it
lies within them) nor among the releases the compat seams were checked on.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Leg", "LEGS", "RANGE", "DEFAULT", "CI_LEG", "by_name"]


@dataclass(frozen=True)
class Leg:
    name: str
    """``.matrix/<name>/`` and ``matrix/results/<name>.json``."""
    python: str
    """``major.minor``; found on PATH, in pyenv or in ``MATRIX_PYTHON_<major>_<minor>``."""
    pins: tuple[str, ...]
    """pip requirements installed with the project (``-e``), exact versions."""
    who: str
    """Whose stack this is (the docs' table)."""
    interpreter: str = ""
    """One interpreter's absolute path, where the patch release matters (a system Python);
    else the leg's Python is found by :attr:`python`."""
    framework: tuple[str, ...] = ()
    """A framework leg: the framework's requirements, exact (``verl[verl-core]==0.9.1``),
    installed with the pins (which are what the framework resolves to with them)."""
    tests: tuple[str, ...] = ()
    """What the leg's suite is (pytest paths); empty: the whole suite."""


LEGS: tuple[Leg, ...] = (
    Leg("roll-2.6", "3.10", ("torch==2.6.0", "transformers==4.51.3", "numpy==1.26.4", "ray==2.48.0"),
        "ROLL's torch 2.6 set"),
    Leg("roll-2.8", "3.10", ("torch==2.8.0", "transformers==4.57.0", "numpy==1.26.4", "ray==2.48.0"),
        "ROLL's torch 2.8 set (requirements_torch280_vllm.txt)"),
    Leg("torch-2.10", "3.12", ("torch==2.10.0", "transformers==5.2.0", "numpy==1.26.4", "ray==2.60.0"),
        "ROLL's torch 2.10 set (transformers 5.2, numpy < 2)"),
    Leg("torch-2.11", "3.11", ("torch==2.11.0", "transformers==5.25.0", "numpy==2.4.6", "ray==2.60.0"),
        "verl's torch; the GPU machine's"),
    Leg("default", "3.11", ("torch==2.13.0", "transformers==5.25.0", "numpy==2.4.6", "ray==2.60.0"),
        "make test (a CPU build of torch)"),
    Leg("debian-3.11.2", "3.11", ("torch==2.13.0", "transformers==5.25.0", "numpy==2.4.6", "ray==2.60.0"),
        "Debian 12's system Python, 3.11.2 (images built on Debian 12)", interpreter="/usr/bin/python3.11"),
    Leg("newest", "3.13", ("torch==2.14.1", "transformers==5.25.0", "numpy==2.5.5", "ray==2.60.0"),
        "the newest of each that pip installs here"),
    Leg("torchtitan", "3.11", ("torch==2.13.0", "torchtitan==0.3.0", "datasets==4.7.0", "transformers==5.2.0",
                               "numpy==2.4.6", "ray==2.60.0"),
        "torchtitan 0.3.0 from PyPI (datasets < 4.8 as it asks, hence huggingface_hub < 2 and transformers 5.2): "
        "the suite, and torchtitan's own Trainer checkpointing through roll-ckpt (tests/integration_torchtitan)"),
    # verl 0.9.1 from PyPI (verl-core: its FSDP engine, trainers, Ray); torch 2.13 is the CPU build
    # here (verl asks for torch; pip keeps the pin), the others are what pip resolves verl to.
    Leg("verl", "3.11", ("torch==2.13.0", "transformers==5.10.4", "numpy==2.4.6", "ray==2.60.0"),
        "verl 0.9.1 (its FSDP2 engine, CheckpointHandler, PPO trainer) with roll-ckpt-verl",
        framework=("verl[verl-core]==0.9.1",), tests=("tests/integration_verl", "tests/compat/test_seams.py")),
)

RANGE: tuple[Leg, ...] = tuple(leg for leg in LEGS if not leg.framework)
"""The legs of the supported range: each runs the whole suite; their pins are the bounds."""

DEFAULT = "default"
CI_LEG = "roll-2.8"
"""The leg ``.ci/run`` runs beside ``make test``: the users' own stack."""


def by_name(name: str) -> Leg:
    for leg in LEGS:
        if leg.name == name:
            return leg
    raise SystemExit(f"no leg '{name}'; the legs: {', '.join(leg.name for leg in LEGS)}")
