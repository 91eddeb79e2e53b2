"""The docs against the code they describe: every ``tritoff.<name>(...)`` a Python example calls exists and takes the
keywords it is given, every ``engine.<name>`` exists, every ``tritoff <command> --option`` is an option of that
command, and every relative link leads to a file (and heading) that exists. A renamed option or function fails here
rather than in a user's first command."""

from __future__ import annotations

import argparse
import ast
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
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)


def _ids(paths):
    return [str(p.relative_to(ROOT)) for p in paths]


def _python_blocks(text: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang == "python"]


def _commands(text: str) -> list[str]:
    """``tritoff ...`` command lines: in shell code blocks, and in inline code spans."""
    lines = [
        line.strip()
        for lang, body in FENCE.findall(text)
        if lang in ("bash", "sh")
        for line in body.splitlines()
        if line.strip().startswith("tritoff ")
    ]
    prose = FENCE.sub("", text)
    return lines + [span for span in re.findall(r"`([^`\n]+)`", prose) if span.startswith("tritoff ")]


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("path", DOCS, ids=_ids(DOCS))
def test_python_examples_call_what_exists(path):
    for block in _python_blocks(path.read_text()):
        tree = ast.parse(block)  # an example that does not parse is a broken example
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = node.func.value
            if isinstance(owner, ast.Name) and owner.id == "tritoff":
                assert node.func.attr in tritoff.__all__, f"{path.name}: tritoff.{node.func.attr} does not exist"
                parameters = inspect.signature(getattr(tritoff, node.func.attr)).parameters
                for keyword in node.keywords:
                    assert keyword.arg is None or keyword.arg in parameters, (
                        f"{path.name}: tritoff.{node.func.attr}() takes no {keyword.arg}="
                    )


@pytest.mark.parametrize("path", DOCS, ids=_ids(DOCS))
def test_engine_attributes_named_exist(path):
    # the class's methods and properties, and what its methods set on the instance
    known = set(dir(Engine)) | set(re.findall(r"self\.(\w+)\s*[:=]", inspect.getsource(Engine)))
    for name in set(re.findall(r"(?<![/\w])engine\.(\w+)", path.read_text())) - {"py"}:  # engine.py: the file
        assert name in known, f"{path.name}: engine.{name} does not exist"


@pytest.mark.parametrize("path", DOCS, ids=_ids(DOCS))
def test_commands_use_options_that_exist(path):
    subcommands = _subcommands()
    for command in _commands(path.read_text()):
        words = shlex.split(command, comments=True)
        assert words[1] in subcommands, f"{path.name}: tritoff has no command {words[1]!r} ({command})"
        parser = subcommands[words[1]]
        if any(a.nargs == argparse.REMAINDER for a in parser._actions):  # bench: the rest goes to the script
            continue
        options = {o for a in parser._actions for o in a.option_strings}
        for word in words[2:]:
            option = word.strip("[]").split("=")[0]
            if option.startswith("--"):
                assert option in options, f"{path.name}: `tritoff {words[1]}` has no {option} ({command})"


def test_every_documented_command_is_found():
    """The extraction above sees the commands the README gives (a regex that matched nothing would pass)."""
    commands = _commands((ROOT / "README.md").read_text())
    assert {shlex.split(c, comments=True)[1] for c in commands} >= {"plan", "convert", "run"}


@pytest.mark.parametrize("path", DOCS, ids=_ids(DOCS))
def test_relative_links_resolve(path):
    text = FENCE.sub("", path.read_text())
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{path.name}: link to {target}: no such file"
        if anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", FENCE.sub("", linked.read_text()), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{path.name}: link to {target}: no such heading"
