"""``python -m roll_ckpt_verl check``: does ``VERL_ENGINE_VENDOR=roll_ckpt`` take effect here?

verl loads its plugins at ``import verl`` and logs one that fails to load at DEBUG only, then
uses its own engine: this imports verl as a worker does and says which engine verl's registry
picks for the FSDP2 actor and critic, and why not roll-ckpt's when it is not. Exit status 0
when both are roll-ckpt's.
"""

from __future__ import annotations

import os
import sys


def check() -> int:
    os.environ.setdefault("VERL_ENGINE_VENDOR", "roll_ckpt")
    policy = os.environ.get("VERL_USE_EXTERNAL_PLUGINS", "auto").strip().lower()
    if policy == "none" or (policy != "auto" and "roll_ckpt" not in {p.strip() for p in policy.split(",")}):
        print(f"VERL_USE_EXTERNAL_PLUGINS={policy}: verl does not load roll-ckpt's plugin; add roll_ckpt to it")
        return 1
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group="verl.plugins") if ep.name == "roll_ckpt"]
    if not found:
        print("roll-ckpt-verl's verl.plugins entry point (roll_ckpt) is not installed in this environment: "
              'pip install "roll-ckpt[verl]" into the environment verl runs in')
        return 1
    try:
        found[0].load()  # what `import verl` loads, its errors shown here (verl logs them at DEBUG)
        import verl  # noqa: F401
        from verl.workers.engine import EngineRegistry
    except Exception as exc:
        print(f"cannot import verl's engine here: {type(exc).__name__}: {exc}")
        return 1
    ok = True
    for model_type in ("language_model", "value_model"):
        cls = EngineRegistry.get_engine_cls(model_type, "fsdp2")
        ours = cls.__module__ == "roll_ckpt_verl.engine"
        ok &= ours
        print(f"{model_type}/fsdp2: {cls.__module__}.{cls.__name__}{'' if ours else '  (verl own: NOT roll-ckpt)'}")
    print(f"VERL_ENGINE_VENDOR={os.environ['VERL_ENGINE_VENDOR']}: " +
          ("roll-ckpt saves and resumes verl's FSDP2 checkpoints" if ok else
           "set VERL_ENGINE_VENDOR=roll_ckpt in the shell that launches the job"))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args != ["check"]:
        print(__doc__.strip())
        return 2
    return check()


if __name__ == "__main__":
    sys.exit(main())
