"""The docs hold together: README.md is a short front door (at most 300 lines) whose index links
every page under docs/; every relative link in README.md and docs/*.md resolves (the file, and
the #anchor to a heading of it); no page keeps lab-notebook narrative (history goes into
CHANGELOG.md); and every ``specdec-llm ...`` command shown in a ```bash block names a real
subcommand with real options, checked by its ``--help`` through click's CliRunner (typer's
``typer.testing.CliRunner``: typer carries its own click) on the command typer builds from the
app: no model loads, no worker, no store."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
REQUIRED = (
    "architecture",
    "speedup",
    "benchmarks",
    "pairs",
    "distillation",
    "jobs",
    "operations",
    "store-and-reports",
    "langchain",
)
MAX_README_LINES = 300
# what a page of current figures does not say (a change's story belongs in CHANGELOG.md)
NARRATIVE = ("before this change", "previous round", "(next step)", "not yet explained", "before this round")

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")
BASH_BLOCK = re.compile(r"^```bash[ \t]*\n(.*?)^```", re.M | re.S)
OPTION = re.compile(r"^\[?(--[a-z][a-z0-9-]*)")
ENV_PREFIX = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")


def _prose(text: str) -> str:
    """The text without code: fenced blocks and inline code spans."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces -> '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for line in FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug, n = _slug(m.group(1)), 0
            while (slug if n == 0 else f"{slug}-{n}") in found:
                n += 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def _links(path: Path) -> list[str]:
    return LINK.findall(_prose(path.read_text(encoding="utf-8")))


def _relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto: ... are not checked here


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; at most {MAX_README_LINES}"


def test_required_pages_exist_and_readme_links_every_page():
    linked = {
        (README.parent / t.split("#", 1)[0]).resolve() for t in _links(README) if _relative(t) and not t.startswith("#")
    }
    for name in REQUIRED:
        assert (DOCS / f"{name}.md").is_file(), f"docs/{name}.md is missing"
    for page in PAGES:
        assert page.resolve() in linked, f"README.md does not link {page.relative_to(ROOT)}"


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = []
    for target in _links(path):
        if not _relative(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{path.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_lab_notebook_narrative(path):
    text = path.read_text(encoding="utf-8").lower()
    found = [phrase for phrase in NARRATIVE if phrase in text]
    assert not found, f"{path.relative_to(ROOT)} says {found}: keep the current figure, move the story to CHANGELOG.md"


def _command_lines(path: Path) -> list[str]:
    """The ``specdec-llm ...`` lines of a file's ```bash blocks (an ``ENV=value`` prefix allowed)."""
    lines = []
    for block in BASH_BLOCK.findall(path.read_text(encoding="utf-8")):
        for line in block.splitlines():
            words = line.split()
            while words and ENV_PREFIX.match(words[0]):
                words.pop(0)
            if words and words[0] == "specdec-llm":
                lines.append(" ".join(words))
    return lines


def _tokens(line: str) -> list[str]:
    line = re.split(r"\s#", line, maxsplit=1)[0].rstrip(" \\&")
    try:
        return shlex.split(line)
    except ValueError:
        return line.split()


README_COMMANDS = _command_lines(README)
DOCS_COMMANDS = sorted({line for page in PAGES for line in _command_lines(page)} - set(README_COMMANDS))


@pytest.fixture(scope="module")
def cli() -> typer.Typer:
    from specdec_llm.cli import app

    return app


def _check_command(app: typer.Typer, line: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # the app's callback sets these with setdefault: keep this process's environment as it was
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    words = _tokens(line)[1:]
    path, command = [], typer.main.get_command(app)
    while words and words[0] in getattr(command, "commands", {}):  # a group: descend into its subcommand
        path.append(words[0])
        command = command.commands[words.pop(0)]
    assert path, f"{line!r}: no such specdec-llm subcommand ({words[:1]})"
    assert not hasattr(command, "commands"), f"{line!r}: `specdec-llm {' '.join(path)}` needs a subcommand"
    known = {"--help"} | {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
    unknown = sorted({m.group(1) for w in words if (m := OPTION.match(w))} - known)
    assert not unknown, f"{line!r}: `specdec-llm {' '.join(path)}` has no option {unknown}"
    result = CliRunner().invoke(app, [*path, "--help"], prog_name="specdec-llm")
    assert result.exit_code == 0, f"specdec-llm {' '.join(path)} --help: exit {result.exit_code}\n{result.output}"
    assert "Usage" in result.output


def test_readme_shows_commands():
    assert len(README_COMMANDS) >= 5, README_COMMANDS


@pytest.mark.parametrize("line", README_COMMANDS)
def test_readme_command_parses(cli, line, monkeypatch):
    _check_command(cli, line, monkeypatch)


@pytest.mark.parametrize("line", DOCS_COMMANDS)
def test_docs_command_parses(cli, line, monkeypatch):
    _check_command(cli, line, monkeypatch)


CORPUS_FIGURES = re.compile(
    r"In all: (?P<shards>[\d,]+) shards, (?P<records>[\d,]+) records, (?P<prompt_tokens>[\d,]+) prompt and\s+"
    r"(?P<answer_tokens>[\d,]+) answer tokens \((?P<tokens>[\d,]+) in all\), (?P<mb>[\d.]+) MB"
)


def test_data_readme_figures_are_the_corpus_shards():
    """data/README.md's figures of the committed corpus (shards, records, tokens, size) are
    those its shards hold now, for the one target directory it names."""
    from specdec_llm.training.corpus import Corpus

    text = (ROOT / "data" / "README.md").read_text(encoding="utf-8")
    targets = [d for d in sorted((ROOT / "data" / "corpus").iterdir()) if d.is_dir()]
    assert len(targets) == 1, "data/README.md describes one target's corpus: describe each directory"
    assert f"fingerprint `{targets[0].name}`" in text
    found = CORPUS_FIGURES.search(text)
    assert found, "data/README.md: no 'In all: N shards, N records, ... MB' sentence"
    said = {key: float(v.replace(",", "")) for key, v in found.groupdict().items()}
    s = Corpus(targets[0]).summary()
    assert s["by_mode"] == {"greedy": s["records"]}, "data/README.md says greedy answers only"
    assert said == {
        "shards": s["shards"],
        "records": s["records"],
        "prompt_tokens": s["prompt_tokens"],
        "answer_tokens": s["answer_tokens"],
        "tokens": s["prompt_tokens"] + s["answer_tokens"],
        "mb": round(s["bytes"] / 1e6, 2),
    }


@pytest.mark.parametrize("command", ["generate", "submit", "run"])
def test_drafter_help_names_every_registered_drafter(cli, command, monkeypatch):
    """``--drafter``'s help lists the registry's drafters when it is shown, one registered
    after the CLI was built included (no list written by hand)."""
    from specdec_llm.engine.drafting.registry import known, register_drafter, unregister_drafter

    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")  # (the app's callback sets them)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    register_drafter("helpcheck", lambda context: None)  # (never built: only its name is read)
    try:
        result = CliRunner().invoke(cli, [command, "--help"], env={"COLUMNS": "100"})
    finally:
        unregister_drafter("helpcheck")
    assert result.exit_code == 0, result.output
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())
    names = [*known(), "helpcheck"]
    assert f"or one of them: {', '.join(names)} (" in text


CHANGELOG = ROOT / "CHANGELOG.md"
MAX_CHANGELOG_LINE = 160
RELEASE = re.compile(r"^## \[(?P<version>\d+\.\d+\.\d+)\] - (?P<date>\d{4}-\d{2}-\d{2})$")
KINDS = ("### Added", "### Changed", "### Fixed")


def _changelog_sections() -> list[tuple[str, list[str]]]:
    """CHANGELOG.md's ``## `` sections: (heading, the lines under it)."""
    sections: list[tuple[str, list[str]]] = []
    for line in CHANGELOG.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            sections.append((line, []))
        elif sections:
            sections[-1][1].append(line)
    return sections


def test_changelog_lines_are_short():
    """One line per change, at most 160 characters: a change's story goes in docs/benchmarks.md."""
    long = [
        f"line {n}: {len(line)} characters"
        for n, line in enumerate(CHANGELOG.read_text(encoding="utf-8").splitlines(), 1)
        if len(line) > MAX_CHANGELOG_LINE
    ]
    assert long == [], f"CHANGELOG.md: shorten these to {MAX_CHANGELOG_LINE} characters or fewer"


def test_changelog_sections_are_versioned_with_added_changed_fixed():
    """``## [Unreleased]`` (optional, first), then ``## [X.Y.Z] - YYYY-MM-DD`` newest first; under
    each only ``### Added``, ``### Changed`` and ``### Fixed`` (in that order), each a list of
    one-line ``- `` entries."""
    sections = _changelog_sections()
    headings = [h for h, _ in sections]
    if headings and headings[0] == "## [Unreleased]":
        headings = headings[1:]
    releases = [RELEASE.match(h) for h in headings]
    assert all(releases), f"CHANGELOG.md: headings not '## [X.Y.Z] - YYYY-MM-DD': {headings}"
    keys = [(tuple(int(x) for x in m["version"].split(".")), m["date"]) for m in releases if m]
    assert keys == sorted(keys, reverse=True) and len(set(keys)) == len(keys), "versions and dates: newest first"
    for heading, lines in sections:
        kinds = [line for line in lines if line.startswith("#")]
        assert kinds and set(kinds) <= set(KINDS), f"{heading}: use {', '.join(KINDS)}, not {kinds}"
        assert kinds == sorted(kinds, key=KINDS.index) and len(set(kinds)) == len(kinds), heading
        entries = [line for line in lines if line and not line.startswith("#")]
        assert all(line.startswith("- ") for line in entries), f"{heading}: one '- ' line per change"


def test_pyproject_version_is_the_newest_release():
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    newest = next(m for h, _ in _changelog_sections() if (m := RELEASE.match(h)))
    assert version == newest["version"], (
        f"pyproject.toml says {version}, CHANGELOG.md's newest release is {newest['version']}: make them one"
    )
