"""The docs against the code they describe: every ``tritoff.<name>`` named exists, and takes the keywords a call in a
Python example or inline code gives it; every ``engine.<name>`` exists; the options table of ``tritoff.enable`` names
its parameters, and the exports table every export; every ``tritoff <command> --option`` (in a shell block, continued
lines joined, in a Python comment, or in inline code) is an option of that command; every ``bench/`` script named
exists and takes the options given to it; and every relative link leads to a file, and heading, that exists. A
renamed option or function fails here rather than in a user's first command."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import inspect
import re
import shlex
from pathlib import Path

import pytest

import tritoff
from tritoff.cli import build_parser
from tritoff.engine import Engine

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL, PYTHON = {"bash", "sh", "shell", "console", "zsh"}, {"python", "py"}
# a command: ``tritoff``, or a path ending in it (``.venv/bin/tritoff``), then its arguments (a bare ``tritoff`` or
# ``~/.cache/tritoff`` is a name)
COMMAND = re.compile(r"^(?:\S*/)?tritoff\s+\S")
INLINE = re.compile(r"`([^`]+)`")


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _ids(paths):
    return [str(p.relative_to(ROOT)) for p in paths]


def _blocks(text: str) -> tuple[list[tuple[str, str]], str]:
    """The fenced code blocks as (language, body), and the text outside them."""
    blocks, prose, fence, lang, body = [], [], None, "", []
    for line in text.splitlines():
        opening = re.match(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)", line)
        if fence is None and opening:
            fence, lang, body = opening.group(1), opening.group(2).lower(), []
        elif fence is not None and line.strip().startswith(fence) and not line.strip().strip(fence[0]):
            blocks.append((lang, "\n".join(body)))
            fence = None
        elif fence is not None:
            body.append(line)
        else:
            prose.append(line)
    return blocks, "\n".join(prose)


def _shell_lines(body: str) -> list[str]:
    """A shell block's logical lines: a trailing backslash, or an indented line under a command, continues it."""
    lines: list[str] = []
    for raw in body.splitlines():
        line = re.sub(r"^\s*\$\s+", "", raw)  # a prompt
        if lines and (lines[-1].endswith("\\") or (raw[:1].isspace() and line.strip() and not raw.strip()[:1] == "#")):
            lines[-1] = lines[-1].rstrip("\\").rstrip() + " " + line.strip()
        else:
            lines.append(line.strip())
    return lines


def _commands(text: str) -> list[str]:
    """``tritoff ...`` commands: in shell blocks (each part of ``a && b``), and in inline code spans."""
    blocks, prose = _blocks(text)
    commands = []
    for lang, body in blocks:
        if lang in SHELL:
            for line in _shell_lines(body):
                commands += [part.strip() for part in re.split(r"&&|;|\|\|", line) if COMMAND.match(part.strip())]
        elif lang in PYTHON:  # a command in a comment: "# then: tritoff convert ..."
            commands += [m.strip() for m in re.findall(r"#\s*(?:\w+:\s*)?(.*)", body) if COMMAND.match(m.strip())]
    for span in INLINE.findall(prose):
        span = " ".join(span.split())  # a span wrapped over two lines
        if COMMAND.match(span):
            commands.append(span)
    return commands


def _words(command: str) -> list[str]:
    try:
        words = shlex.split(command, comments=True)
    except ValueError:  # an apostrophe in prose-like text
        words = command.split("#")[0].split()
    return words


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = build_parser()
    return parser, next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


def _headings(text: str) -> set[str]:
    """The anchors GitHub makes of a file's headings: rendered text (links, code and emphasis marks dropped), lower
    case, punctuation other than hyphens and underscores dropped, spaces to hyphens, ``-N`` after a repeat."""
    anchors: dict[str, int] = {}
    for line in _blocks(text)[1].splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        rendered = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))
        rendered = re.sub(r"(?<!\w)_+|_+(?!\w)|[*`]", "", rendered)
        slug = re.sub(r"[^\w\- ]", "", rendered.lower()).replace(" ", "-")
        count = anchors.get(slug)
        anchors[slug] = 0 if count is None else count + 1
        if count is not None:
            anchors[f"{slug}-{count + 1}"] = 0
    return set(anchors)


def _check_calls(tree: ast.AST, where: str) -> None:
    """Every ``from tritoff import X`` and ``tritoff.X(..., keyword=...)`` in ``tree`` names what exists."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "tritoff":
            for alias in node.names:
                assert alias.name in tritoff.__all__, f"{where}: tritoff has no {alias.name} to import"
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value
        if isinstance(owner, ast.Name) and owner.id == "tritoff":
            assert node.func.attr in tritoff.__all__, f"{where}: tritoff.{node.func.attr} does not exist"
            parameters = inspect.signature(getattr(tritoff, node.func.attr)).parameters
            for keyword in node.keywords:
                assert keyword.arg is None or keyword.arg in parameters, (
                    f"{where}: tritoff.{node.func.attr}() takes no {keyword.arg}="
                )


@pytest.mark.parametrize("path", DOCS, ids=_ids(DOCS))
def test_python_examples_call_what_exists(path):
    blocks, prose = _blocks(_read(path))
    for lang, block in blocks:
        if lang in PYTHON:
            _check_calls(ast.parse(block), path.name)  # an example that does not parse is a broken example
    for span in INLINE.findall(prose):  # `tritoff.enable(pipe, store=...)`
        if span.startswith("tritoff."):
            try:
                tree = ast.parse(" ".join(span.split()), mode="eval")
            except SyntaxError:  # prose, not an expression
                continue
            _check_calls(tree, f"{path.name} (`{span}`)")


@pytest.mark.parametrize("path", DOCS, ids=_ids(DOCS))
def test_tritoff_names_exist(path):
    for name in set(re.findall(r"(?<![\w./-])tritoff\.([A-Za-z_]\w*)", _read(path))):
        assert name in tritoff.__all__ or importlib.util.find_spec(f"tritoff.{name}"), (
            f"{path.name}: tritoff.{name} does not exist"
        )


def test_the_usage_tables_name_the_parameters_and_the_exports():
    """The options table of ``tritoff.enable`` lists its parameters, each that exists; the exports table lists every
    export."""
    usage = _read(ROOT / "docs/usage.md")

    def first_column(after: str) -> list[list[str]]:
        """The names in backquotes in the first column of the first table after the heading ``after``."""
        lines = usage[usage.index(after) :].splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("|"))
        end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
        return [re.findall(r"`([A-Za-z_]\w*)", row.split("|")[1]) for row in lines[start + 2 : end]]

    options = [names[0] for names in first_column("### Options of `tritoff.enable(")]
    assert set(options) == set(inspect.signature(tritoff.enable).parameters) - {"options"}
    exported = {name for names in first_column("### The rest of the Python API") for name in names}
    assert exported == set(tritoff.__all__) - {"__version__"}


@pytest.mark.parametrize("path", DOCS, ids=_ids(DOCS))
def test_engine_attributes_named_exist(path):
    # the class's methods and properties, and what its methods set on the instance
    known = set(dir(Engine)) | set(re.findall(r"self\.(\w+)\s*[:=]", inspect.getsource(Engine)))
    for name in set(re.findall(r"(?<![/\w.])engine\.(\w+)", _read(path))) - {"py"}:  # engine.py: the file
        assert name in known, f"{path.name}: engine.{name} does not exist"


@pytest.mark.parametrize("path", DOCS, ids=_ids(DOCS))
def test_commands_use_options_that_exist(path):
    top, subcommands = _parsers()
    for command in _commands(_read(path)):
        words = _words(command)[1:]
        if words and words[0].startswith("-"):  # tritoff --help
            assert words[0].split("=")[0] in _options(top), f"{path.name}: tritoff has no {words[0]} ({command})"
            continue
        assert words and words[0] in subcommands, f"{path.name}: tritoff has no command {words[:1]} ({command})"
        parser = subcommands[words[0]]
        if any(a.nargs == argparse.REMAINDER for a in parser._actions):  # bench: the rest goes to the script
            which = next(a for a in parser._actions if a.dest == "which").choices
            assert words[1:] and set(words[1].split("|")) <= set(which), f"{path.name}: no benchmark {command}"
            continue
        options = _options(parser)
        for word in words[1:]:
            option = word.strip("[]").split("=")[0]
            if option.startswith("--"):
                assert option in options, f"{path.name}: `tritoff {words[0]}` has no {option} ({command})"


@pytest.mark.parametrize("path", DOCS, ids=_ids(DOCS))
def test_bench_scripts_named_exist_and_take_their_options(path):
    blocks, prose = _blocks(_read(path))
    lines = [line for lang, body in blocks if lang in SHELL for line in _shell_lines(body)]
    lines += [" ".join(span.split()) for span in INLINE.findall(prose)]
    for name in set(re.findall(r"\bbench/([a-z_]+\.(?:py|sh))\b", _read(path))):  # not bench/NAME.py
        assert (ROOT / "bench" / name).exists(), f"{path.name}: bench/{name} does not exist"
    for line in lines:
        for part in re.split(r"&&|;|\|\|", line):
            run = re.match(r"^\s*(?:\S*python3?\s+|\S+=\S+\s+)*bench/([a-z_]+)\.(?:py|sh)(.*)$", part)
            if not run:
                continue
            twin = ROOT / "bench" / f"{run.group(1)}.py"  # a .sh script runs its .py twin, where it has one
            script = _read(twin if twin.exists() else ROOT / "bench" / f"{run.group(1)}.sh")
            for word in _words(run.group(2)):
                option = word.strip("[]").split("=")[0]
                if option.startswith("--"):
                    assert f'"{option}"' in script, f"{path.name}: bench/{run.group(1)} takes no {option} ({part})"


def test_the_extraction_sees_what_the_docs_hold():
    """The commands and headings the checks above read are found (a pattern that matched nothing would pass)."""
    commands = [_words(c)[1] for c in _commands(_read(ROOT / "README.md"))]
    assert {"demo", "plan", "convert", "run"} <= set(commands)
    usage = _read(ROOT / "docs/usage.md")
    reference = [c for c in _commands(usage) if c.startswith("tritoff run MODEL --prompt")]
    assert reference and "--spill-dir" in reference[0]  # the command-line reference's continued lines are joined
    assert "torchcompile" in _headings(usage)


def test_the_extraction_handles_what_markdown_allows():
    text = (
        "# Title\n## Title\n## Fast _path_ [here](x.md) ##\n"
        "```c++\nint x;\n```\n"
        "```bash\n$ tritoff plan M \\\n  --budget 8GB\ncd x && .venv/bin/tritoff demo --steps 2\n```\n"
        "Run `tritoff run MODEL\n--store DIR` once; `tritoff --help`; don't use `it's`.\n"
    )
    assert _headings(text) == {"title", "title-1", "fast-path-here"}
    assert _commands(text) == [
        "tritoff plan M --budget 8GB",
        ".venv/bin/tritoff demo --steps 2",
        "tritoff run MODEL --store DIR",
        "tritoff --help",
    ]


@pytest.mark.parametrize("path", DOCS, ids=_ids(DOCS))
def test_relative_links_resolve(path):
    prose = INLINE.sub("", _blocks(_read(path))[1])
    for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose):
        if re.match(r"[a-zA-Z][\w+.-]*:", target):  # https:, mailto:, ...
            continue
        file, _, anchor = target.partition("#")
        base = ROOT if file.startswith("/") else path.parent
        linked = (base / file.lstrip("/")).resolve() if file else path
        assert linked.exists(), f"{path.name}: link to {target}: no such file"
        if anchor and linked.suffix == ".md":
            assert anchor in _headings(_read(linked)), f"{path.name}: link to {target}: no such heading"
