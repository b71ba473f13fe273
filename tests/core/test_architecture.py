"""The layout shows the architecture: contracts in one module, core knows nothing of its
plugins, no import cycle (the benchmark package included), private torch APIs in one compat
module (the benchmark too goes through it), no module using another's private names, small modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "packages" / "core" / "src" / "roll_ckpt"
PLUGIN_SOURCES = [REPO / "packages" / d / "src" for d in ("backend-fs", "strategy-fsdp2", "demo", "integration-roll",
                                                        "integration-torchtitan", "integration-verl")]
PLUGIN_PACKAGES = ("roll_ckpt_fs", "roll_ckpt_fsdp2", "roll_ckpt_demo", "roll_ckpt_roll", "roll_ckpt_torchtitan",
                   "roll_ckpt_verl")
BENCH = REPO / "bench"
MAX_LINES = 450


def _modules(src: Path, package: str) -> dict[str, Path]:
    out = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    assert out, f"no modules under {src}"
    return out


CORE_MODULES = _modules(CORE, "roll_ckpt")


def _imports(module: str, path: Path, modules: dict[str, Path] | None = None) -> set[str]:
    """Every module ``module`` imports, anywhere in it: top level, in functions, under TYPE_CHECKING."""
    found: set[str] = set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in (modules or CORE_MODULES) else target)
    return found


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    return {m: {d for d in _imports(m, p, modules) if d in modules and d != m} for m, p in modules.items()}


def _core_graph() -> dict[str, set[str]]:
    return _graph(CORE_MODULES)


def _first_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


@pytest.mark.parametrize("package", ["roll_ckpt", *PLUGIN_PACKAGES, "bench"])
def test_no_import_cycle(package: str) -> None:
    if package == "roll_ckpt":
        modules = CORE_MODULES
    elif package == "bench":
        modules = _modules(BENCH, "bench")
    else:
        src = next(s for s in PLUGIN_SOURCES if (s / package).is_dir())
        modules = _modules(src / package, package)
    cycle = _first_cycle(_graph(modules))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


# The core's rooms, lowest first: a module may import the base modules and rooms below its
# own (and modules of its own room), never one above. ``save`` and ``load`` share no module:
# both build on the DCP I/O (``dcp``), and the exporter (``hf``) reads through it too.
BASE = {"roll_ckpt.errors", "roll_ckpt.contracts", "roll_ckpt.hookspecs"}
REGISTRY = "roll_ckpt.plugins"  # from config up: plugins' keys validated, backends opened through it
LAYERS = ["runtime", "format", "dcp", "config", "tiers", "hf", "load", "save", "strategies"]
ASSEMBLY = {"roll_ckpt", "roll_ckpt.plugins", "roll_ckpt._builtin", "roll_ckpt.manager", "roll_ckpt.views",
            "roll_ckpt.plugin"}
ABOVE_ALL = ("cli", "testing")


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and f"roll_ckpt.{parts[1]}" not in BASE | ASSEMBLY) else ""


def test_every_core_module_is_in_a_room() -> None:
    loose = [m for m in CORE_MODULES if m not in BASE | ASSEMBLY and _room(m) not in LAYERS + list(ABOVE_ALL)]
    assert not loose, f"modules outside the rooms {LAYERS + list(ABOVE_ALL)}: {loose}"


def test_the_rooms_import_only_downwards() -> None:
    graph = _core_graph()
    wrong = []
    for module, deps in graph.items():
        room = _room(module)
        if room in ABOVE_ALL or module in ASSEMBLY:
            continue
        for dep in deps:
            if dep in BASE:
                continue
            if module in BASE:
                wrong.append(f"{module} -> {dep} (a base module imports nothing of the core's)")
            elif dep == REGISTRY and LAYERS.index(room) >= LAYERS.index("config"):
                continue
            elif dep in ASSEMBLY or _room(dep) in ABOVE_ALL:
                wrong.append(f"{module} -> {dep}")
            elif LAYERS.index(_room(dep)) > LAYERS.index(room):
                wrong.append(f"{module} ({room}) -> {dep} ({_room(dep)})")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_save_and_load_do_not_import_each_other() -> None:
    graph = _core_graph()
    crossing = [f"{m} -> {d}" for m, deps in graph.items() for d in deps
                if {_room(m), _room(d)} == {"save", "load"}]
    assert not crossing, crossing


ROLL_ADAPTATION = {"roll_ckpt.config.roll_defaults", "roll_ckpt.config.roll_keys"}
"""ROLL's config adaptation: how a ROLL pipeline config is recognized, ROLL's defaults, its keys
mapped onto roll-ckpt's and its worker sections (issue 37: outside the save/load core)."""


def test_only_the_config_reads_rolls_config_adaptation() -> None:
    """ROLL's config adaptation is the config's own business: only the schema that validates a
    config and the report that shows where each value came from read it. The saver, the
    resumer, the DCP I/O, the strategies, the tiers and the manager get a ``Config``."""
    graph = _core_graph()
    readers = {m for m, deps in graph.items() if deps & ROLL_ADAPTATION and m not in ROLL_ADAPTATION}
    assert readers == {"roll_ckpt.config.schema", "roll_ckpt.config.report"}, readers


def test_contracts_import_no_implementation() -> None:
    deps = _imports("roll_ckpt.contracts", CORE_MODULES["roll_ckpt.contracts"])
    assert not {d for d in deps if d.startswith(("roll_ckpt", "torch"))}, deps


def test_core_never_imports_a_plugin_nor_names_its_config() -> None:
    for module, path in CORE_MODULES.items():
        deps = _imports(module, path)
        assert not {d for d in deps if d.startswith(PLUGIN_PACKAGES)}, f"{module} imports a plugin: {deps}"
        assert "offload_backend" not in path.read_text(), f"{module} names a plugin's config key"


SEAMS = ("roll_ckpt.runtime.torch_compat", "roll_ckpt.contracts")
"""One module by design (every version-dependent torch API in one place; every contract
between core and its plugins in one place, as pluggy's hook specs): not held to the cap."""


PUBLIC = {"roll_ckpt", "roll_ckpt.plugin"}
"""What a plugin may import from core: the user API and the plugin author's API."""
EXAMPLE_BACKEND = REPO / "tests" / "plugins" / "example_backend" / "src"


@pytest.mark.parametrize("src", [*PLUGIN_SOURCES, EXAMPLE_BACKEND], ids=lambda p: p.parent.name)
def test_plugins_import_only_the_public_api_of_core(src: Path) -> None:
    """The project's own plugins and the example backend build on ``roll_ckpt`` and
    ``roll_ckpt.plugin`` alone: what a third party's plugin can use is what ours use."""
    private = []
    for path in sorted(src.rglob("*.py")):
        package = path.relative_to(src).parts[0]
        module = ".".join(path.relative_to(src).with_suffix("").parts)
        for dep in _imports(module, path):
            if (dep == "roll_ckpt" or dep.startswith("roll_ckpt.")) and dep not in PUBLIC and \
                    not dep.startswith(package):
                private.append(f"{path.relative_to(REPO)}: {dep}")
    assert not private, "plugins importing core's private modules:\n" + "\n".join(private)


def test_the_plugin_api_names_what_it_exports() -> None:
    import roll_ckpt.plugin as api

    missing = [name for name in api.__all__ if not hasattr(api, name)]
    assert not missing, f"roll_ckpt.plugin.__all__ names what it does not have: {missing}"


ROLES = {"roll_ckpt.save.pipeline": 750, "roll_ckpt.save.staging": 500, "roll_ckpt.strategies.dcp": 700, "roll_ckpt.dcp.writer": 850,
         "roll_ckpt.dcp.reader": 600, "roll_ckpt.dcp.checked": 600, "roll_ckpt.format.commit": 550, "roll_ckpt.format.manifest": 500,
         "roll_ckpt.format.layout": 500, "roll_ckpt.hf.export": 760}
"""Modules that hold one role whole, by design, and their own cap (issue 37: a path a reader
follows in a few files, as torch_checkpointing's): the saver (staging's launch, the write, the
commit, failures and stats, what the network did to a save), staging (the copy policies), the ``dcp`` strategy
and its I/O (state dicts and their cache, optimizers' state, the load's targets and hand-over; ``DCPIO``:
the write, the load, what saves keep across saves), DCP's writer
(planner, writer, fixed layouts, increments), DCP's reader (the checked read, the job's load,
the targets), what a load reads, checked (files whole or piece by piece, ``.metadata``'s
restricted unpickler), the commit protocol (pending folder, rename, owners and holds), the manifest
(its format, digests, and a checkpoint verified against it), the layout under ``output_dir``
(names, run folders, what each folder is: ours, another framework's, unusable, a step not committed), the exporter
(Hugging Face folders, one safetensors file, the folder in every checkpoint)."""


def test_core_modules_stay_small() -> None:
    big = {m: n for m, p in CORE_MODULES.items()
           if m not in SEAMS and (n := len(p.read_text().splitlines())) > ROLES.get(m, MAX_LINES)}
    assert not big, f"modules over {MAX_LINES} lines (a role's own cap: {ROLES}): {big}"


PRIVATE_IMPORT_EXCEPTIONS: dict[str, str] = {}
"""``"module: name"`` -> why ``module`` may use another core module's private ``name`` (none today)."""


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_core_uses(module: str, path: Path) -> list[str]:
    """Another core module's private names that ``module`` uses: ``from roll_ckpt.x import _y``
    (a private module of a package is the package's own: ``roll_ckpt.plugins`` may import
    ``roll_ckpt._builtin``, nothing outside ``roll_ckpt.cli`` ``roll_ckpt.cli._common``), and
    ``x._y`` where ``x`` names an imported core module (``import roll_ckpt.x as x``, ``from . import x``)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    tree = ast.parse(path.read_text())
    modules: dict[str, str] = {}  # local name -> core module
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "roll_ckpt":
                    if any(_is_private(part) and not module.startswith(".".join(alias.name.split(".")[:i]) + ".")
                           for i, part in enumerate(alias.name.split(".")) if i):
                        found.append(f"import {alias.name}")
                    if alias.asname:
                        modules[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                target = ".".join(package[: len(package) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "roll_ckpt":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in CORE_MODULES:
                    modules[alias.asname or alias.name] = sub
                    if _is_private(alias.name) and not module.startswith(target + "."):
                        found.append(f"from {target} import {alias.name}")
                elif _is_private(alias.name):
                    found.append(f"from {target} import {alias.name}")
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
            continue
        chain, value = [], node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in modules:
            owner = ".".join([modules[value.id], *reversed(chain)])
            if owner in CORE_MODULES and owner != module:
                found.append(f"{owner}.{node.attr} (line {node.lineno})")
    return found


def test_no_core_module_uses_another_modules_private_names() -> None:
    """A name with a leading underscore is its module's own: what another module needs is
    public (``tiers.replication`` and ``tiers.space`` use ``retention.live_foreign_runs``)."""
    uses = [f"{m}: {u}" for m, p in CORE_MODULES.items() for u in _private_core_uses(m, p)]
    wrong = [u for u in uses if u not in PRIVATE_IMPORT_EXCEPTIONS]
    assert not wrong, "private names used across core modules:\n" + "\n".join(wrong)
    stale = sorted(set(PRIVATE_IMPORT_EXCEPTIONS) - set(uses))
    assert not stale, f"exceptions no longer needed: {stale}"


def test_the_private_names_check_sees_both_forms(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("from ..format.layout import _hidden, scan\nfrom ..format import layout as lay\n"
                      "from . import _own\nfrom .. import _builtin\nlay._x()\nlay.scan()\n")
    uses = _private_core_uses("roll_ckpt.tiers.m", source)
    assert uses == ["from roll_ckpt.format.layout import _hidden", "from roll_ckpt.tiers import _own",
                    "roll_ckpt.format.layout._x (line 5)"], uses


def _private_torch_uses(path: Path) -> list[str]:
    """``from torch... import _x``, ``import torch._x``, ``torch._C``/``serialization._x``, ``._local_tensor``,
    and ``X._y`` for any ``X`` the file imports from torch (``SavePlanner._cached_all_plans``)."""
    tree = ast.parse(path.read_text())
    from_torch = {"torch", "ser", "serialization"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            from_torch.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            from_torch.update(a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("torch"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            if any(part.startswith("_") for part in node.module.split(".")) or \
                    any(a.name.startswith("_") for a in node.names):
                found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names
                      if a.name.startswith("torch") and any(p.startswith("_") for p in a.name.split("."))]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
            if name in from_torch or node.attr == "_local_tensor":
                found.append(f"line {node.lineno}: {name}.{node.attr}")
    return found


def test_private_torch_apis_live_in_the_compat_module_only() -> None:
    """In core, the plugins and the benchmark (``bench/``): every private torch API through ``torch_compat``."""
    sources = list(CORE_MODULES.values()) + [p for src in PLUGIN_SOURCES for p in src.rglob("*.py")]
    sources += sorted(BENCH.rglob("*.py"))
    assert len(sources) > len(CORE_MODULES) + 20, "the benchmark's modules are scanned too"
    offenders = {str(p.relative_to(REPO)): uses for p in sources
                 if p.name != "torch_compat.py" and (uses := _private_torch_uses(p))}
    assert not offenders, offenders
    assert _private_torch_uses(CORE / "runtime" / "torch_compat.py"), "the compat module is where they are"


def test_every_compat_accessor_names_the_torch_versions_it_was_checked_on() -> None:
    tree = ast.parse((CORE / "runtime" / "torch_compat.py").read_text())
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")):
        doc = ast.get_docstring(fn) or ""
        assert "torch 2." in doc or "since torch" in doc, f"{fn.name} does not say which torch it was checked on"


def test_a_missing_private_api_is_an_error_naming_the_torch_version(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    import torch.serialization as ser

    from roll_ckpt.runtime.torch_compat import TorchCompatError, save_tensor_without_crc

    monkeypatch.delattr(ser, "_save")
    import re

    with pytest.raises(TorchCompatError, match=re.escape(f"torch {torch.__version__} lacks torch.serialization._save")):
        save_tensor_without_crc(torch.zeros(2), __import__("io").BytesIO())


def test_the_writer_patches_nothing_in_torch() -> None:
    """The CRC-32 is skipped in our writer only: torch's own setting is untouched by a save."""
    import io

    import torch
    import torch.serialization as ser

    from roll_ckpt.runtime.torch_compat import save_tensor_without_crc

    before = ser.get_crc32_options
    save_tensor_without_crc(torch.arange(4.0), buf := io.BytesIO())
    assert ser.get_crc32_options is before and ser.get_crc32_options() is True
    assert torch.equal(torch.load(io.BytesIO(buf.getvalue()), weights_only=True), torch.arange(4.0))


def _swallows_everything(handler: ast.ExceptHandler) -> bool:
    """An ``except BaseException`` (or bare ``except``) that neither raises nor keeps the exception."""
    caught = handler.type
    names = {"<bare>"} if caught is None else {e.id for e in (caught.elts if isinstance(caught, ast.Tuple) else [caught])
                                                 if isinstance(e, ast.Name)}
    if not names & {"BaseException", "<bare>"}:
        return False
    body = [n for stmt in handler.body for n in ast.walk(stmt)]
    raises = any(isinstance(n, ast.Raise) for n in body)
    kept = handler.name is not None and any(isinstance(n, ast.Name) and n.id == handler.name for n in body)
    return not raises and not kept


def test_no_handler_swallows_a_ctrl_c() -> None:
    """DCP raises ``CheckpointException``, a ``BaseException``, so handlers must catch that
    wide; each one raises again or keeps the exception for the caller to raise. If it passes
    instead, a Ctrl-C or a ``SystemExit`` in that window is lost."""
    found = []
    for path in [*CORE.rglob("*.py"), *(p for src in PLUGIN_SOURCES for p in src.rglob("*.py")), *BENCH.rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ExceptHandler) and _swallows_everything(node):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found == []
