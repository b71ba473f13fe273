"""The documentation site builds with warnings as errors, and documents every config key,
every command-line option and every public name.

The checks walk the code themselves (the config dataclasses from ``Config``'s type hints,
the argparse parser, ``__all__``) rather than trusting the generator's own list, so a key
the generator missed fails here, and each looks for the key in the built HTML.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import html
import inspect
import os
import re
import shutil
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HOOKS = REPO / "docs" / "_hooks"
sys.path.insert(0, str(HOOKS))

import config_keys  # noqa: E402  the generator's list of required keys, checked below
import sources  # noqa: E402  the one place that names the roll-ckpt modules the docs read

BUILD_TIMEOUT_S = 120
pytestmark = pytest.mark.timeout(2 * BUILD_TIMEOUT_S + 60)


def build(config: Path, out: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(out)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                          cwd=config.parent, env=env)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = build(REPO / "mkdocs.yml", out)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    return out


def page_text(site: Path, page: str) -> str:
    return (site / page / "index.html").read_text()


def plain(text: str) -> str:
    """Text as a reader sees it: tags dropped, entities decoded, whitespace collapsed."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", text)).split())


def compact(text: str) -> str:
    """Text for comparing a docstring with its rendering: reST roles, backticks, whitespace gone."""
    return re.sub(r"[\s`~]|:\w+:(?=`)", "", text)


def rendered(page: str) -> str:
    return compact(html.unescape(re.sub(r"<[^>]+>", "", page)))


def opening(doc: str, words: int = 6) -> str:
    return compact(" ".join(doc.split()[:words]))


def code_spans(text: str) -> set[str]:
    return {html.unescape(re.sub(r"<[^>]+>", "", m)) for m in re.findall(r"<code>(.*?)</code>", text, re.S)}


# ---- the config keys, walked here independently of docs/_hooks/config_keys.py

def field_docs(cls: type) -> dict[str, str]:
    """``{field: attribute docstring}`` read from the class's source."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    out = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            out[node.target.id] = str(after.value.value).strip()  # type: ignore[union-attr]
    return out


def undocumented(cls: type) -> list[str]:
    """Fields with no docstring; a field holding a section may rely on its class's docstring."""
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    missing = []
    for f in dataclasses.fields(cls):
        section = [c for c in (hints[f.name], *typing.get_args(hints[f.name]))
                   if isinstance(c, type) and dataclasses.is_dataclass(c)]
        if not docs.get(f.name) and not (section and (section[0].__doc__ or "").strip()):
            missing.append(f"{cls.__name__}.{f.name}")
    return missing


def config_fields() -> dict[str, tuple[type, str]]:
    """``{dotted key: (class, field)}`` for every field reachable from ``Config``."""
    out: dict[str, tuple[type, str]] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out[prefix + f.name] = (cls, f.name)
            for c in (hints[f.name], *typing.get_args(hints[f.name])):
                if isinstance(c, type) and dataclasses.is_dataclass(c):
                    walk(c, f"{prefix}{f.name}.")

    walk(sources.config().Config, "")
    return out


def config_classes() -> set[type]:
    """Every config dataclass: those reachable from ``Config`` and those the config module names."""
    found = {cls for cls, _ in config_fields().values()}
    module = sources.config()
    found |= {v for k, v in vars(module).items()
              if k.endswith("Config") and isinstance(v, type) and dataclasses.is_dataclass(v)}
    return found


def test_the_checks_catch_an_undocumented_field() -> None:
    @dataclasses.dataclass
    class Probe:
        documented: int = 0
        """Says what it is."""
        bare: int = 0

    assert undocumented(Probe) == ["Probe.bare"]


def test_the_config_walk_finds_every_section() -> None:
    names = {cls.__name__ for cls in config_classes()}
    assert {"Config", "CheckpointConfig", "BackupConfig", "PreemptionConfig", "InitialLoadConfig", "LocalTierConfig",
            "HFWeightsConfig", "StrategyConfig"} <= names
    assert "checkpoint_config.backup.retries" in config_fields()


def test_every_field_of_every_config_dataclass_has_a_docstring() -> None:
    missing = [name for cls in sorted(config_classes(), key=lambda c: c.__name__) for name in undocumented(cls)]
    assert not missing, f"config fields without a docstring (the reference's meaning): {missing}"


def test_every_plugin_owned_key_has_a_description() -> None:
    records = sources.plugin_config_keys()
    assert "offload_backend" in records  # roll-ckpt-fsdp2's, installed by make venv
    bare = [key for key, r in records.items() if not r.description.strip()]
    assert not bare, f"plugin config keys without a description: {bare}"


def test_the_configuration_reference_lists_every_key_with_its_meaning(site: Path) -> None:
    page = page_text(site, "reference/configuration")
    shown, text = code_spans(page), rendered(page)
    for key, (cls, name) in config_fields().items():
        assert key in shown, f"{key} ({cls.__name__}.{name}) is not in the configuration reference"
        doc = field_docs(cls).get(name)
        if doc:  # its opening words, as rendered (reST roles and ``literals`` become code)
            assert opening(doc) in text, f"the meaning of {key} is not in the reference: {doc[:60]!r}"
    for key, record in sources.plugin_config_keys().items():
        assert key in shown, f"plugin key {key} is not in the configuration reference"
        assert opening(record.description) in text, f"the meaning of plugin key {key} is not in the reference"


def test_the_s3_storage_options_are_documented_and_listed(site: Path) -> None:
    policy = sources.s3_retry_policy()
    assert not undocumented(policy), f"RetryPolicy fields without a docstring: {undocumented(policy)}"
    page = page_text(site, "reference/configuration")
    shown, text = code_spans(page), rendered(page)
    for f in dataclasses.fields(policy):
        key = f"checkpoint_config.storage_options.{f.name}"
        assert key in shown, f"{key} is not in the configuration reference"
        assert opening(field_docs(policy)[f.name]) in text


def test_the_reference_gives_computed_defaults_and_roll_names(site: Path) -> None:
    text = plain(page_text(site, "reference/configuration"))
    # defaults computed by the validation code, not the dataclasses' placeholders
    assert "${output_dir}/checkpoints/${exp_name}" in text
    assert "/dev/shm/roll-ckpt/${exp_name}" in text
    # ROLL's defaults, read from roll_ckpt's ROLL defaults table
    for dotted, (value, where) in sources.roll_defaults().ROLL_DEFAULTS.items():
        assert where in text, f"ROLL's default of {dotted} ({where}) is not in the reference"
    assert "<worker>.strategy_args.strategy_config.async_save_ckpt" in text


@pytest.mark.parametrize("section", sorted(config_keys.SECTION_MINIMAL))
def test_keys_the_reference_calls_required_are_required(section: str) -> None:
    minimal = config_keys.SECTION_MINIMAL[section]
    load = sources.config().load_config
    _, _, name = section.rpartition(".")
    load({"checkpoint_config": {name: minimal}})  # the minimal section is accepted
    for key in minimal:
        with pytest.raises(sources.config_error()) as err:
            load({"checkpoint_config": {name: {k: v for k, v in minimal.items() if k != key}}})
        assert key in str(err.value)


# ---- the command line

def cli_commands(parser: argparse.ArgumentParser) -> dict[str, tuple[str, list[argparse.Action]]]:
    """``{prog: (help, [options])}`` for the parser and each sub-command."""
    def options(p: argparse.ArgumentParser) -> list[argparse.Action]:
        return [a for a in p._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]

    out = {parser.prog: (parser.description or "", options(parser))}
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help or "" for a in sub._choices_actions}
    for name, p in sub.choices.items():
        out[p.prog] = (helps.get(name, ""), options(p))
    return out


def undocumented_cli(parser: argparse.ArgumentParser) -> list[str]:
    missing = []
    for prog, (help_text, actions) in cli_commands(parser).items():
        if not help_text.strip():
            missing.append(prog)
        missing += [f"{prog} {a.option_strings or a.dest}" for a in actions if not (a.help or "").strip()]
    return missing


def test_the_checks_catch_an_undocumented_option() -> None:
    parser = argparse.ArgumentParser(prog="x", description="d")
    sub = parser.add_subparsers()
    p = sub.add_parser("cmd", help="does things")
    p.add_argument("--bare")
    sub.add_parser("silent")
    assert undocumented_cli(parser) == ["x cmd ['--bare']", "x silent"]


def test_every_command_and_option_has_help() -> None:
    missing = undocumented_cli(sources.cli_parser())
    assert not missing, f"commands or options without help text: {missing}"


def test_the_cli_reference_lists_every_command_and_option(site: Path) -> None:
    page = page_text(site, "reference/cli")
    sections = {m.group(1): m.group(0)
                for m in re.finditer(r'<h2 id="([^"]+)".*?(?=<h2 id=|</article>)', page, re.S)}
    commands = cli_commands(sources.cli_parser())
    assert "roll-ckpt demo" in commands  # a plugin's command is listed too
    for prog, (help_text, actions) in commands.items():
        anchor = prog.replace(" ", "-")
        assert anchor in sections, f"{prog} has no section in the CLI reference"
        shown, text = code_spans(sections[anchor]), rendered(sections[anchor])
        assert opening(help_text) in text, f"{prog}'s help is not in its section"
        for a in actions:
            names = ", ".join(a.option_strings) or str(a.metavar or a.dest)
            assert names in shown, f"{prog} {names} is not in the CLI reference"
            assert opening(a.help or "") in text, f"{prog} {names}: its help is not shown"


# ---- the API, the benchmark's files, the strict build itself

def test_the_api_reference_documents_every_public_name(site: Path) -> None:
    page = page_text(site, "reference/api")
    ids = set(re.findall(r'id="([\w.]+)"', page))
    for package in sources.API_PACKAGES:
        names = [n for n in getattr(sources.module(package), "__all__", []) if not n.startswith("__")]
        missing = [n for n in names if f"{package}.{n}" not in ids]
        assert not missing, f"{package}: public names with no entry in the API reference: {missing}"
    assert "roll_ckpt.CheckpointManager.resume" in ids  # members, from the docstrings
    assert any(i.endswith(".roll_ckpt_backends") for i in ids)  # the hook specs


def test_the_benchmark_page_shows_the_plots_that_exist(site: Path) -> None:
    """The plots kept in docs/benchmark/ (bench/results/ is build output) are on the page."""
    plots = sorted(p.name for p in (REPO / "docs" / "benchmark").glob("*.png"))
    assert plots
    page = page_text(site, "benchmark")
    shown = {(site / "benchmark" / src).resolve() for src in re.findall(r'<img[^>]* src="([^"]+)"', page)}
    for name in plots:
        assert (site / "benchmark" / name).is_file()
        assert (site / "benchmark" / name).resolve() in shown, f"the benchmark page does not show {name}"


def test_no_page_links_into_the_benchmarks_build_output() -> None:
    """bench/results/ is ignored by git: what a page or the README shows of it is in docs/benchmark/."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    linked = [f"{p.relative_to(REPO)}: {t}" for p in pages
              for t in re.findall(r"\]\(([^)]+)\)", p.read_text()) if "bench/results" in t]
    assert not linked, linked


def test_a_broken_link_fails_the_strict_build(tmp_path: Path) -> None:
    # The build above passing means something only if the same build fails on a warning.
    copy = tmp_path / "repo"
    copy.mkdir()
    shutil.copy(REPO / "mkdocs.yml", copy / "mkdocs.yml")
    shutil.copytree(REPO / "docs", copy / "docs")
    (copy / "packages").symlink_to(REPO / "packages")
    with open(copy / "docs" / "status.md", "a") as f:
        f.write("\nSee [nothing](no-such-page.md).\n")
    done = build(copy / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert "no-such-page.md" in done.stdout + done.stderr


# ---- the README: a front page, every link of it leading somewhere

def test_the_readme_is_a_front_page() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines (at most 250: the manual is the site, docs/)"


def test_every_relative_link_of_the_readme_exists() -> None:
    text = (REPO / "README.md").read_text()
    links = [t.split("#")[0] for t in re.findall(r"\]\(([^)]+)\)", text) if "://" not in t and not t.startswith("#")]
    assert links
    missing = [t for t in links if t and not (REPO / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_the_readme_example_config_loads() -> None:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    assert blocks, "the README shows no YAML config"
    import yaml

    cfg = sources.config().load_config(yaml.safe_load(blocks[0]))
    assert cfg.checkpoint_config.output_dir.endswith(f"/checkpoints/{cfg.exp_name}")
    assert cfg.resume_target == "latest" and cfg.async_save
