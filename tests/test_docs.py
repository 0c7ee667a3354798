"""The documentation against the code (the one test file that reads docs/ and README.md).

1. Runnable blocks. A fenced `python` or `bash` block in README.md or docs/ (any depth) whose line
   right above the opening fence is `<!-- run -->` runs, each in a fresh process in an empty
   temporary directory with the CPU backend, and must exit 0. In bash blocks `longmoe` and
   `python` are this interpreter's (`python -m longmoe`), and the script runs under
   `set -euo pipefail`. Unmarked blocks are never run.
2. docs/cli.md against the parsers and the run config: every flag it names exists on the
   subcommand it is named for, every flag of every subcommand is named there, every subcommand is
   named, and the run-config table names every field of every section of
   `longmoe.train.config.RunConfig` (and no field that does not exist).

How docs/cli.md is read (CONTRIBUTING.md, "Docs"): a `## longmoe CMD ...` heading opens the
section of that (sub)command. In the section of a command group (`bench`, `tune`) a table row
whose first cell names subcommands (`moe-rows`, or several) gives those subcommands' flags; a
flag elsewhere in a group's section applies to each of its subcommands. In a code block a flag
belongs to the `longmoe CMD` invocation on its line (continued on indented lines), and
`longmoe GROUP a | b` names subcommands. In the run-config table each section's fields are the
backticked names that start the items of its list (items split by `,` and `;`; parentheses and
`: ...` after a name hold values, not fields; the list ends at the first full stop).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARKER = "<!-- run -->"
LANGS = {"python": "py", "py": "py", "bash": "sh", "sh": "sh"}
BLOCK_TIMEOUT_S = 300
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
SECTION_NAMES = ("model", "parallel", "impl", "data", "loss", "optim", "train")
DOTTED = re.compile(r"(?<![\w./-])(" + "|".join(SECTION_NAMES) + r")\.([a-z_][a-z0-9_]*)")
BASH_PRELUDE = """set -euo pipefail
longmoe() { "$LONGMOE_DOC_PYTHON" -m longmoe "$@"; }
python() { "$LONGMOE_DOC_PYTHON" "$@"; }
python3() { "$LONGMOE_DOC_PYTHON" "$@"; }
"""


# ---------------------------------------------------------------------------------------------
# Markdown blocks


@dataclasses.dataclass
class Block:
    path: Path
    line: int        # 1-based line of the opening fence
    lang: str
    text: str
    marked: bool

    @property
    def id(self) -> str:
        return f"{shown(self.path)}:{self.line}"


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def doc_files() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def fenced_blocks(path: Path) -> tuple[list[Block], list[str]]:
    """Every fenced block of one file, and the problems of its markers (a marker not followed
    by a fence)."""
    lines = path.read_text().splitlines()
    blocks, problems, i = [], [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if lines[i].strip() == MARKER and not (i + 1 < len(lines) and
                                                   FENCE.match(lines[i + 1])):
                problems.append(f"{shown(path)}:{i + 1}: {MARKER} is not followed by "
                                "a fenced block")
            i += 1
            continue
        indent, fence, lang = m.groups()
        j = i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence[0] * len(fence)) and
                                      set(lines[j].strip()) == {fence[0]}):
            j += 1
        body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1:j]]
        marked = i > 0 and lines[i - 1].strip() == MARKER
        blocks.append(Block(path, i + 1, lang.lower(), "\n".join(body) + "\n", marked))
        i = j + 1
    return blocks, problems


def all_blocks() -> tuple[list[Block], list[str]]:
    blocks, problems = [], []
    for path in doc_files():
        b, p = fenced_blocks(path)
        blocks += b
        problems += p
    return blocks, problems


def test_markers_mark_runnable_blocks():
    blocks, problems = all_blocks()
    problems += [f"{b.id}: a runnable block must be python or bash, not {b.lang or 'untyped'}"
                 for b in blocks if b.marked and b.lang not in LANGS]
    assert not problems, "\n".join(problems)
    assert any(b.marked for b in blocks), "no runnable block found: the marker was not read"


def _runnable():
    return [pytest.param(b, id=b.id) for b in all_blocks()[0] if b.marked and b.lang in LANGS]


@pytest.mark.parametrize("block", _runnable())
def test_runnable_block(block: Block, tmp_path: Path):
    kind = LANGS[block.lang]
    script = tmp_path / f"doc_block.{kind}"
    script.write_text(block.text if kind == "py" else BASH_PRELUDE + block.text)
    env = {**os.environ, "LONGMOE_BACKEND": "cpu", "LONGMOE_DOC_PYTHON": sys.executable}
    env.pop("PYTHONPATH", None)
    cmd = [sys.executable, script.name] if kind == "py" else ["bash", script.name]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=BLOCK_TIMEOUT_S)
    tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-25:])
    assert p.returncode == 0, f"{block.id} exited {p.returncode}:\n{tail}"


# ---------------------------------------------------------------------------------------------
# docs/cli.md: the command tree


def command_tree() -> dict[tuple[str, ...], dict]:
    """(subcommand path) -> {"flags": long flags, "children": subcommand names}."""
    from longmoe.cli import build_parser
    tree: dict[tuple[str, ...], dict] = {}

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]):
        flags = {s for a in parser._actions for s in a.option_strings
                 if s.startswith("--") and s != "--help"}
        children: dict[str, argparse.ArgumentParser] = {}
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                children.update(a.choices)
        tree[path] = {"flags": flags, "children": set(children)}
        for name, sub in children.items():
            walk(sub, path + (name,))

    walk(build_parser(), ())
    return tree


def leaves(tree, path: tuple[str, ...]) -> list[tuple[str, ...]]:
    if not tree[path]["children"]:
        return [path]
    return [leaf for c in sorted(tree[path]["children"]) for leaf in leaves(tree, path + (c,))]


def resolve(tree, words: list[str]) -> tuple[tuple[str, ...], int]:
    """The longest subcommand path the words start with, and how many words it took."""
    path: tuple[str, ...] = ()
    for n, w in enumerate(words):
        if w not in tree[path]["children"]:
            return path, n
        path += (w,)
    return path, len(words)


def cells(row: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def cli_mentions(tree, text: str):
    """[(line, subcommand path, flags)] as docs/cli.md names them, and the problems found
    while reading (a heading or invocation naming no subcommand, an unknown alternative)."""
    mentions, problems = [], []
    section = None           # the path of the current `## longmoe ...` section
    in_code, current = False, None
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            in_code, current = not in_code, None
            continue
        if in_code:
            m = re.search(r"(?:^|\s)longmoe\s+(.*)", line)
            if m:
                words = m.group(1).split()
                path, k = resolve(tree, words)
                if not path:
                    problems.append(f"cli.md:{n}: `longmoe {words[0] if words else ''}` is no "
                                    "subcommand")
                    current = None
                    continue
                paths = [path]
                while k + 1 < len(words) and words[k] == "|":
                    alt = path[:-1] + (words[k + 1],)
                    if alt in tree:
                        paths.append(alt)
                    else:
                        problems.append(f"cli.md:{n}: `{' '.join(alt)}` is no subcommand")
                    k += 2
                current = paths
                mentions += [(n, p, set(FLAG.findall(m.group(1)))) for p in paths]
            elif current and line[:1].isspace():
                mentions += [(n, p, set(FLAG.findall(line))) for p in current]
            else:
                current = None
            continue
        h = re.match(r"^(#+)\s+(.*)", line)
        if h:
            if len(h.group(1)) <= 2:
                m = re.search(r"longmoe\s+([^`]*)", h.group(2))
                section = None
                if m:
                    section, _ = resolve(tree, m.group(1).split())
                    if not section:
                        problems.append(f"cli.md:{n}: heading names no subcommand")
                        section = None
                    else:
                        mentions.append((n, section, set(FLAG.findall(m.group(1)))))
            continue
        if section is None:
            continue
        flags = set(FLAG.findall(line))
        children = tree[section]["children"]
        if children and line.lstrip().startswith("|"):
            first = re.findall(r"`([^`]+)`", cells(line)[0])
            if first and all(name in children for name in first):
                rest = line.split("|", 2)[2] if line.count("|") >= 2 else ""
                mentions += [(n, section + (name,), set(FLAG.findall(rest))) for name in first]
                continue
        if flags or not children:
            targets = leaves(tree, section) if children else [section]
            mentions += [(n, p, flags) for p in targets]
    return mentions, problems


def test_cli_md_names_every_flag_and_subcommand():
    tree = command_tree()
    text = (ROOT / "docs" / "cli.md").read_text()
    mentions, problems = cli_mentions(tree, text)
    named: dict[tuple[str, ...], set[str]] = {}
    for n, path, flags in mentions:
        named.setdefault(path, set()).update(flags)
        for f in sorted(flags - tree[path]["flags"]):
            problems.append(f"cli.md:{n}: `longmoe {' '.join(path)}` has no flag {f}")
    for leaf in leaves(tree, ()):
        cmd = f"`longmoe {' '.join(leaf)}`"
        if leaf not in named:
            problems.append(f"cli.md does not name {cmd}")
            continue
        missing = sorted(tree[leaf]["flags"] - named[leaf])
        if missing:
            problems.append(f"cli.md does not name {cmd}'s {', '.join(missing)}")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# docs/cli.md: the run config


def listed_names(cell: str) -> list[str]:
    """The backticked names that start the items of a field list (see the module docstring)."""
    spans: list[str] = []

    def hide(m):
        spans.append(m.group(1))
        return f"\0{len(spans) - 1}\0"

    text = re.sub(r"`([^`]*)`", hide, cell)
    top, depth = [], 0
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(depth - 1, 0)
        elif depth == 0:
            top.append(ch)
    listed = re.split(r"\.(?:\s|$)", "".join(top))[0]
    names = []
    for item in re.split(r"[,;]", listed):
        m = re.match(r"\s*\0(\d+)\0", item)
        if m:
            names.append(spans[int(m.group(1))])
    return names


def run_config_fields() -> dict[str, set[str]]:
    from longmoe.config import ModelConfig
    from longmoe.train.config import RunConfig
    out = {f.name: {g.name for g in dataclasses.fields(f.default_factory)}
           for f in dataclasses.fields(RunConfig) if f.name != "model"}
    out["model"] = {g.name for g in dataclasses.fields(ModelConfig)} | {"preset", "hf_config"}
    return out


def test_cli_md_names_every_config_field():
    """Every field of every section but `model` is listed; `model` takes any ModelConfig field
    (the page says so), so its listed names need only exist. Every `section.field` written
    anywhere on the page exists."""
    text = (ROOT / "docs" / "cli.md").read_text()
    fields = run_config_fields()
    assert set(fields) == set(SECTION_NAMES), "a run-config section this test does not know"
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines)
                  if ln.startswith("|") and [c.lower() for c in cells(ln)] == ["section", "fields"]),
                 None)
    assert start is not None, "cli.md: no `| section | fields |` table"
    listed: dict[str, list[str]] = {}
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        first, rest = cells(ln)[0], "|".join(re.split(r"(?<!\\)\|", ln.strip().strip("|"))[1:])
        listed[first.strip("`")] = listed_names(rest)
    problems = [f"cli.md: the run-config table has no `{s}` row" for s in SECTION_NAMES
                if s not in listed]
    problems += [f"cli.md: the run-config table's `{s}` row is no section" for s in listed
                 if s not in fields]
    for section, names in listed.items():
        if section not in fields:
            continue
        problems += [f"cli.md: `{section}.{n}` is no config field" for n in names
                     if n not in fields[section]]
        if section != "model":
            problems += [f"cli.md: the run-config table does not name `{section}.{n}`"
                         for n in sorted(fields[section] - set(names))]
    for n, ln in enumerate(lines, 1):
        for section, name in DOTTED.findall(ln):
            if name not in fields[section]:
                problems.append(f"cli.md:{n}: `{section}.{name}` is no config field")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# The readers themselves, on small made-up pages (a reader that sees nothing passes everything)


def test_readers_see_what_they_should(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("text\n<!-- run -->\n```python\nprint(1)\n```\n```bash\nls\n```\n"
                    "<!-- run -->\n\nno fence\n")
    blocks, problems = fenced_blocks(page)
    assert [(b.line, b.lang, b.marked, b.text) for b in blocks] == [
        (3, "python", True, "print(1)\n"), (6, "bash", False, "ls\n")]
    assert len(problems) == 1 and ":9:" in problems[0]

    assert listed_names("`a` (`x`, `y`), `b`: `z` or `w`; `c` (one. two). Then `d`, `e`") == \
        ["a", "b", "c"]

    tree = command_tree()
    doc = ("## `longmoe bench ...`\n\nEach writes `--out`.\n\n| command | flags |\n|---|---|\n"
           "| `linear-ce`, `moe-rows` | `--iters`, `--nope` |\n\n"
           "```\nlongmoe tune chunks | calibrate | bogus\n   [--model M]\n"
           "torchrun --standalone \\\n   --nnodes 2 -m longmoe train --config x\n```\n")
    mentions, problems = cli_mentions(tree, doc)
    got = {(p, frozenset(f)) for _, p, f in mentions}
    assert (("bench", "packing"), frozenset({"--out"})) in got
    assert (("bench", "moe-rows"), frozenset({"--iters", "--nope"})) in got
    assert (("tune", "calibrate"), frozenset({"--model"})) in got
    assert (("train",), frozenset({"--config"})) in got
    assert not any("--standalone" in f or "--nnodes" in f for _, _, f in mentions)
    assert problems == ["cli.md:10: `tune bogus` is no subcommand"]
