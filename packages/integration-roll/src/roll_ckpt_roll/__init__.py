"""roll-ckpt as ROLL's checkpoint layer, with nothing of ROLL edited.

One line at the top of ROLL's entry script (``examples/start_rlvr_pipeline.py`` and the others),
before ROLL's ``init()``::

    import roll_ckpt_roll; roll_ckpt_roll.enable()

or no line at all: ``python -m roll_ckpt_roll examples/start_rlvr_pipeline.py --config_name ...``.

:func:`enable` replaces the few ROLL methods that save and resume (:mod:`roll_ckpt_roll.patches`
lists each and what it does instead) in the driver and, through Ray's
``worker_process_setup_hook``, in every Ray worker process the driver's ``ray.init`` starts.
ROLL's checkpoints need no line: the ``roll`` format (:mod:`roll_ckpt_roll.roll_format`) is found
by roll-ckpt's entry points, so ``resume_from_checkpoint``, ``roll-ckpt ls/verify/inspect`` and
``roll-ckpt export --format roll`` read them wherever roll-ckpt-roll is installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["enable", "in_worker", "ROLL_COMMIT"]

from .roll_format import ROLL_COMMIT

_HOOK = "roll_ckpt_roll.in_worker"


def in_worker() -> None:
    """Ray's ``worker_process_setup_hook``: the replacements in a Ray worker process."""
    from .patches import install

    install()


def _chained(theirs: Any) -> Any:
    def hook() -> None:
        in_worker()
        if callable(theirs):
            theirs()
        else:  # "module.function", as Ray takes it
            import importlib

            module, _, name = str(theirs).rpartition(".")
            getattr(importlib.import_module(module), name)()

    return hook


def enable() -> None:
    """Make roll-ckpt ROLL's checkpoint layer in this process and in the Ray workers it starts.

    Call it before ``ray.init`` (ROLL's ``init()``): the hook rides the job's runtime
    environment, which ``ray.init`` fixes. Idempotent.
    """
    import ray

    from roll_ckpt.plugin import RollCkptError

    from .patches import install

    install()
    if getattr(ray.init, "__roll_ckpt__", False):
        return
    if ray.is_initialized():
        raise RollCkptError("roll_ckpt_roll.enable() came after ray.init(): the Ray workers ROLL starts would save "
                            "their checkpoints ROLL's way. Call it at the top of the entry script, or start the "
                            "script with: python -m roll_ckpt_roll SCRIPT [ARGS...]")
    original = ray.init

    def init(*args: Any, **kwargs: Any) -> Any:
        runtime_env = dict(kwargs.get("runtime_env") or {})
        theirs = runtime_env.get("worker_process_setup_hook")
        runtime_env["worker_process_setup_hook"] = _HOOK if theirs in (None, _HOOK) else _chained(theirs)
        kwargs["runtime_env"] = runtime_env
        return original(*args, **kwargs)

    init.__roll_ckpt__ = True  # type: ignore[attr-defined]
    init.__wrapped__ = original  # type: ignore[attr-defined]
    ray.init = init
