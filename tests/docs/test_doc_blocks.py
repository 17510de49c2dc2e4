"""The README and docs/ do what they say: every ``python`` block runs, every flag they name exists, every link lands,
every troubleshooting line is one the source can print.

Marker convention (an HTML comment on the line right before a block's opening fence):

- none                       the block runs as a script in one process (in a fresh directory)
- ``<!-- run: 1, 2 -->``     it also runs on 2 ranks, ``autopar launch -n 2 block.py`` (``run: 2``: on 2 ranks only,
                             for a block that needs a second rank, such as a 2-stage pipeline)
- ``<!-- not-run: REASON -->`` it is not run; the reason must be given

Identical blocks (the README's examples repeat in docs/) run once. The one-process runs of the README's blocks are in
the fast tier; the rest start launched jobs or take a few seconds each (``procs``, ``slow``)."""
from __future__ import annotations

import ast
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from procutil import PYTHON, ROOT, autopar_cmd, clean_env

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)\s*$")
MARKER = re.compile(r"^<!--\s*([\w-]+)\s*:\s*(.*?)\s*-->\s*$")
WORLDS = {"1": 1, "2": 2}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: tuple[str, str] | None  # (kind, argument) of the comment right before the fence

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def read_blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), None)
        assert end is not None, f"{page.relative_to(ROOT)}:{i + 1}: a code block that never closes"
        mark = MARKER.match(lines[i - 1]) if i else None
        found.append(Block(page, i + 1, m[1], "\n".join(lines[i + 1:end]) + "\n",
                           (mark[1], mark[2]) if mark else None))
        i = end + 1
    return found


ALL = [b for page in PAGES for b in read_blocks(page)]
PYTHON_BLOCKS = [b for b in ALL if b.lang == "python"]


def worlds(block: Block) -> tuple[int, ...]:
    """The world sizes a python block runs on (empty: marked not-run)."""
    if block.marker is None:
        return (1,)
    kind, arg = block.marker
    if kind == "not-run":
        return ()
    return tuple(WORLDS[w.strip()] for w in arg.split(","))


def runs(world: int) -> list[Block]:
    """The distinct blocks that run on ``world`` ranks, first occurrence kept."""
    seen, out = set(), []
    for b in PYTHON_BLOCKS:
        if world in worlds(b) and b.code not in seen:
            seen.add(b.code)
            out.append(b)
    return out


def test_every_python_block_runs_or_says_why():
    assert len(PYTHON_BLOCKS) >= 2, "the README's two examples at least"
    problems = []
    for b in ALL:
        if b.marker is None:
            continue
        kind, arg = b.marker
        if b.lang != "python":
            problems.append(f"{b.where}: a {kind} marker on a {b.lang or 'plain'} block (only python blocks are run)")
        elif kind == "not-run":
            if len(arg) < 8:
                problems.append(f"{b.where}: not-run needs its reason, got {arg!r}")
        elif kind == "run":
            if not arg or any(w.strip() not in WORLDS for w in arg.split(",")):
                problems.append(f"{b.where}: run takes world sizes from {sorted(WORLDS)}, got {arg!r}")
        else:
            problems.append(f"{b.where}: unknown marker {kind!r} (run: 1, 2 | not-run: REASON)")
    for page in PAGES:  # a marker that is not right before a fence marks nothing
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if MARKER.match(line) and not (i + 1 < len(lines) and FENCE.match(lines[i + 1])):
                problems.append(f"{page.relative_to(ROOT)}:{i + 1}: a marker not followed by a code block")
    for b in PYTHON_BLOCKS:
        try:
            ast.parse(b.code)
        except SyntaxError as exc:
            problems.append(f"{b.where}: not valid Python: {exc}")
    assert not problems, "\n".join(problems)


def _env(tmp_path: Path) -> dict[str, str]:
    # the planner's caches and the log directory in the test's own directory; the sources this checkout's
    return clean_env(AUTOPAR_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))


def _script(block: Block, tmp_path: Path) -> Path:
    path = tmp_path / "block.py"
    path.write_text(f"# {block.where}\n" + block.code)
    return path


def _id(block: Block) -> str:
    return block.where


README_RUNS = [b for b in runs(1) if b.page.name == "README.md" and b.page.parent == ROOT]
DOCS_RUNS = [b for b in runs(1) if b not in README_RUNS]


def _run_alone(block: Block, tmp_path: Path) -> None:
    try:
        res = subprocess.run([PYTHON, str(_script(block, tmp_path))], cwd=tmp_path, env=_env(tmp_path),
                             capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.where}: still running after 120 s")
    assert res.returncode == 0, f"{block.where} failed (exit {res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    assert "Traceback" not in res.stderr, f"{block.where}:\n{res.stderr[-3000:]}"


@pytest.mark.parametrize("block", README_RUNS, ids=_id)
def test_readme_block_runs_in_one_process(block, tmp_path):
    _run_alone(block, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("block", DOCS_RUNS, ids=_id)
def test_docs_block_runs_in_one_process(block, tmp_path):
    _run_alone(block, tmp_path)


@pytest.mark.parametrize("block", runs(2), ids=_id)
def test_block_runs_on_two_ranks(block, procs, tmp_path):
    logs = tmp_path / "logs"
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(logs), str(_script(block, tmp_path))),
                    _env(tmp_path), timeout=240, cwd=tmp_path)
    worker_1 = (logs / "worker_1.log").read_text(errors="replace") if (logs / "worker_1.log").exists() else ""
    assert res.returncode == 0, (f"{block.where} failed on 2 ranks (exit {res.returncode}):\n{res.stdout[-2000:]}\n"
                                 f"{res.stderr[-3000:]}\nworker 1:\n{worker_1[-2000:]}")
    assert "Traceback" not in res.stdout + res.stderr + worker_1, block.where
    assert not procs.wait_no_leftovers()


# ---------------------------------------------------------------------------------------------------------------
# Commands and flags the pages name exist

CODE_SPAN = re.compile(r"(`+)(.+?)\1")
COMMAND = re.compile(r"\b(autopar|msrun)\b((?:\s+[^\s`]+)*)")


def _snippets(page: Path) -> list[tuple[int, str]]:
    """(line, text) of every inline code span and every line of a non-python fenced block (continuations joined)."""
    out, in_block, lang = [], False, ""
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        m = FENCE.match(line)
        if m:
            in_block, lang = (not in_block), m[1]
            i += 1
            continue
        if in_block:
            if lang != "python":
                text, n = line, i
                while text.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    text = text.rstrip()[:-1] + " " + lines[i]
                out.append((n + 1, text))
        else:
            out.extend((i + 1, span[2]) for span in CODE_SPAN.finditer(line))
        i += 1
    return out


def _parsers():
    from autopar.cli import main as cli_main
    from autopar.cli import msrun

    def subcommands(parser):
        for action in parser._actions:  # argparse keeps its sub-parsers here
            if hasattr(action, "choices") and isinstance(action.choices, dict):
                return action.choices
        return {}

    def options(parser):
        return {s for a in parser._actions for s in a.option_strings}

    return cli_main.build_parser(), msrun.build_parser(), subcommands, options


def test_every_documented_flag_exists():
    top, msrun_parser, subcommands, options = _parsers()
    commands = subcommands(top)
    problems, checked = [], 0
    for page in PAGES:
        for line, text in _snippets(page):
            for m in COMMAND.finditer(text):
                words = m[2].split()
                where = f"{page.relative_to(ROOT)}:{line}: `{m[0].strip()}`"
                if m[1] == "msrun":
                    parser = msrun_parser
                else:
                    if not words or words[0] not in commands:
                        continue  # prose such as "autopar's" or "autopar launch | msrun" lists
                    parser = commands[words[0]]
                    words = words[1:]
                    subs = subcommands(parser)
                    if subs and words and not words[0].startswith("-"):
                        if words[0] not in subs:
                            problems.append(f"{where}: no sub-command {words[0]!r}")
                            continue
                        parser = subs[words[0]]
                known = options(parser)
                for flag in re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", " ".join(words)):
                    flag = flag.split("=")[0]
                    checked += 1
                    if flag not in known:
                        problems.append(f"{where}: {parser.prog} has no {flag}")
    assert checked > 30, f"only {checked} flags found: is the scan broken?"
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------------------------
# Links land; troubleshooting lines are the source's

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {_slug(m[1]) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}


def test_links_between_pages_land():
    problems = []
    for page in PAGES:
        for m in LINK.finditer(page.read_text()):
            target = m[1]
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                problems.append(f"{page.relative_to(ROOT)}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                problems.append(f"{page.relative_to(ROOT)}: {target}: no heading #{anchor} in {dest.name}")
    assert not problems, "\n".join(problems)


def _source_strings() -> list[str]:
    """Every string the source can print: literals and f-strings (a formatted value as NUL), adjacent parts joined."""
    out = []
    for path in (ROOT / "src" / "autopar").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                out.append("".join(v.value if isinstance(v, ast.Constant) else "\0" for v in node.values))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append(node.value)
    return out


def test_troubleshooting_lines_are_the_sources():
    strings = _source_strings()
    problems, rows = [], 0
    for n, line in enumerate((ROOT / "docs" / "troubleshooting.md").read_text().splitlines(), 1):
        if not line.startswith("| `"):
            continue
        rows += 1
        message = CODE_SPAN.search(line.split(" | ")[0])[2]
        for part in re.split(r"<[^<>]*>|\.\.\.", message):
            part = part.strip()
            if len(part) >= 8 and not any(part in s for s in strings):
                problems.append(f"troubleshooting.md:{n}: {part!r} is in no string of src/autopar")
    assert rows >= 60, rows
    assert not problems, "\n".join(problems)
