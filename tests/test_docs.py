"""The docs stay true to the tree: package maps name every module, links resolve, nothing cites outside files.

Generic by design: the checks walk the packages and the Markdown files, so a module added, moved or
removed (or a page added to docs/) is checked without editing this file.
"""

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGES = sorted(p.parent for p in (ROOT / "jaxgen").rglob("__init__.py") if "__pycache__" not in p.parts)
MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _members(package: Path) -> list[str]:
    """The modules (by file stem) and subpackages of one package, `__init__` left out."""
    modules = [p.stem for p in package.glob("*.py") if p.stem != "__init__"]
    subpackages = [p.name for p in package.iterdir() if (p / "__init__.py").is_file()]
    return sorted(modules + subpackages)


def _named(name: str, text: str) -> bool:
    """`name`, `name.py` or `name/` as a word of `text` (so `config.json` does not count as `config`)."""
    return re.search(rf"(?:^|[\s,(`]){re.escape(name)}(?:\.py|/)?(?=$|[\s,)`:;])", text, re.MULTILINE) is not None


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_package_docstring_maps_every_module(package):
    """Each package's `__init__.py` docstring names every module and subpackage in it."""
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    missing = [name for name in _members(package) if not _named(name, docstring)]
    assert not missing, f"{package.relative_to(ROOT)}/__init__.py's docstring does not name {missing}"


def _without_fences(text: str) -> str:
    """Markdown with fenced code blocks removed (a `# comment` in a shell block is no heading)."""
    return re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.MULTILINE | re.DOTALL)


def _without_code(text: str) -> str:
    """Markdown with code blocks and inline code removed: links are only looked for in prose."""
    return re.sub(r"`[^`\n]*`", "", _without_fences(text))


def _anchors(markdown: Path) -> set[str]:
    """GitHub's anchor for each heading: lower case, punctuation dropped, spaces as hyphens."""
    slugs = set()
    for heading in re.findall(r"^#+\s+(.+?)\s*#*$", _without_fences(markdown.read_text()), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        slugs.add(slug)
    return slugs


def _links(markdown: Path) -> list[str]:
    targets = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", _without_code(markdown.read_text()))
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: ...


@pytest.mark.parametrize("markdown", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(markdown):
    """Every relative link in README.md and docs/*.md names an existing file, and its `#anchor` a heading."""
    broken = []
    for target in _links(markdown):
        path, _, anchor = target.partition("#")
        file = (markdown.parent / path).resolve() if path else markdown
        if not file.exists():
            broken.append(f"{target} (no file {file})")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target} (no heading with anchor #{anchor} in {file.name})")
    assert not broken, f"{markdown.relative_to(ROOT)}: broken links: {broken}"


def test_markdown_files_exist():
    """The docs this test checks are there (a renamed folder would make the link check pass vacuously)."""
    assert (ROOT / "README.md").is_file()
    assert len(MARKDOWN) > 5, f"expected README.md and the pages of docs/, found {MARKDOWN}"


# Built from pieces so that this file does not cite what it forbids.
OUTSIDE = re.compile("NOTES-jax" + "-cpu|(?<![\\w-])shared" + "/")
SCANNED = ["jaxgen", "tests", "bench", "configs", "docs", ".ci"]
SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".txt", ".json", ".cfg", ""}


def _project_files():
    yield from (p for p in ROOT.iterdir() if p.is_file() and p.suffix in SUFFIXES and not p.name.startswith("."))
    for folder in SCANNED:
        for p in sorted((ROOT / folder).rglob("*")):
            if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts:
                yield p


def test_nothing_cites_a_file_outside_the_repository():
    """Code, tests, benchmarks, configs and docs state facts in their own words, never by a path outside the repo."""
    hits = []
    for p in _project_files():
        for number, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{p.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not hits, "cites a file outside the repository:\n" + "\n".join(hits)


# --- the two maps no package docstring holds: README's Layout block and docs/architecture.md -------------

MAPPED_FROM_LINES = 100  # a module this long is a place a reader looks for; it must be on both maps
JAXGEN = ROOT / "jaxgen"


def _mapped_paths() -> list[str]:
    """Every subpackage of jaxgen (`inference/structured/`) and every module of MAPPED_FROM_LINES lines or more
    (`inference/engine.py`), as paths relative to jaxgen/."""
    paths = {f"{p.relative_to(JAXGEN).as_posix()}/" for p in PACKAGES if p != JAXGEN}
    for p in JAXGEN.rglob("*.py"):
        long = len(p.read_text().splitlines()) >= MAPPED_FROM_LINES
        if long and p.stem != "__init__" and "__pycache__" not in p.parts:
            paths.add(p.relative_to(JAXGEN).as_posix())
    return sorted(paths)


def _on_map(path: str, text: str) -> bool:
    """`path` (relative to jaxgen/, `jaxgen/` before it allowed) or its full dotted name (`jaxgen.inference.engine`)
    as a word of `text`: a bare file name (`engine.py`, `errors.py`) names no module, since two packages may
    hold one of that name."""
    dotted = "jaxgen." + path.removesuffix("/").removesuffix(".py").replace("/", ".")
    as_path = rf"(?<![\w./-])(?:jaxgen/)?{re.escape(path)}(?![\w/])"
    return re.search(rf"{as_path}|(?<![\w.]){re.escape(dotted)}(?!\w)", text) is not None


def _layout_block() -> str:
    """The fenced block under README's `## Layout` heading."""
    section = re.search(r"^## Layout\n(.*?)^## ", (ROOT / "README.md").read_text(), re.MULTILINE | re.DOTALL)
    assert section, "README.md has no '## Layout' section"
    block = re.search(r"^```\n(.*?)^```", section.group(1), re.MULTILINE | re.DOTALL)
    assert block, "README.md's Layout section has no fenced block"
    return block.group(1)


def _map(where: str) -> str:
    return _layout_block() if where == "README.md Layout" else (ROOT / "docs" / "architecture.md").read_text()


MAPS = ["README.md Layout", "docs/architecture.md"]


@pytest.mark.parametrize("where", MAPS)
def test_the_maps_name_every_package_and_every_long_module(where):
    """Both maps name every package under jaxgen/ and every module of 100 lines or more by its path relative to
    jaxgen/ (`inference/engine.py`, `model/kernels/`; `jaxgen/` before it allowed) or its full dotted name
    (`jaxgen.inference.engine`). A bare file name does not count: `errors.py` is in inference/ and serving/."""
    paths = _mapped_paths()
    assert len(paths) > 20 and "inference/scheduler.py" in paths, f"expected the tree's packages and modules: {paths}"
    missing = [path for path in paths if not _on_map(path, _map(where))]
    assert not missing, f"{where} does not name {missing}"


def test_on_map_takes_a_path_or_a_full_dotted_name_and_nothing_shorter():
    """The rule of the test above, on hand-written text (so that a loosened regex fails here)."""
    assert _on_map("inference/engine.py", "  inference/engine.py  the executor")
    assert _on_map("inference/engine.py", "`jaxgen/inference/engine.py`, and `jaxgen.inference.engine.Engine`")
    assert _on_map("inference/engine.py", "see jaxgen.inference.engine")
    assert _on_map("model/kernels/", "model/kernels/ holds them")
    for text in ["engine.py", "inference.engine", "tests/inference/engine.py", "inference/engine.pyc", "engine"]:
        assert not _on_map("inference/engine.py", text), text
    assert not _on_map("model/", "model/kernels/"), "a subpackage's path does not name its parent"


def test_the_maps_name_no_module_that_is_gone():
    """Every jaxgen path on either map (`jaxgen/x/y.py`, or `x/y.py`, `x/` where x is a package of jaxgen) exists."""
    top = "|".join(sorted(p.name for p in PACKAGES if p.parent == JAXGEN))
    stale = []
    for where in MAPS:
        found = re.findall(rf"(?<![\w./-])(?:jaxgen/)?((?:{top})/(?:\w+/)*(?:\w+\.py)?)(?![\w/])", _map(where))
        stale += [f"{where}: {path}" for path in found if not (JAXGEN / path).exists()]
    assert not stale, f"the maps name paths that do not exist: {stale}"


# --- documented commands: each run folder is made by one command before another uses it --------------

RUN = r"(?<![\w/.-])runs/[\w.-]+"  # a run folder under runs/ (an absolute /mnt/nfs/runs/x is a placeholder)
DEFAULT_CONFIG = {"train": "configs/default.yaml", "rl": "configs/rl-arithmetic.yaml"}


def _commands(markdown: Path) -> list[str]:
    """The commands of the fenced code blocks, in order: continued lines joined, comments cut, one per `&&`."""
    blocks = re.findall(r"^```\w*\n(.*?)^```", markdown.read_text(), re.MULTILINE | re.DOTALL)
    out = []
    for line in "\n".join(blocks).replace("\\\n", " ").splitlines():
        line = re.sub(r"(^|\s)#.*", "", line)
        out += [" ".join(part.split()) for part in re.split(r"&&|;|(?<!&)&(?!&)", line) if part.strip()]
    return out


def _writes(command: str) -> list[str]:
    """What `command` creates: train.py's and rl.py's run folder, convert.py's output, the file or folder
    of --out, --trace-dir, --write-corpus."""
    import yaml

    found = re.search(r"python (train|rl)\.py\b(.*)", command)
    if found and "--help" not in found[2]:
        run_dir = re.search(r"--run-dir (\S+)", found[2])
        if run_dir:
            return [run_dir[1]]
        config = re.search(r"--config (\S+)", found[2])
        path = ROOT / (config[1] if config else DEFAULT_CONFIG[found[1]])
        return [f"runs/{(yaml.safe_load(path.read_text()) or {}).get('name', path.stem)}"]
    made = re.search(r"python convert\.py \S+ (\S+)", command)
    return [made[1]] if made else re.findall(r"--(?:out|trace-dir|write-corpus) (\S+)", command)


def _run_folder(path: str) -> str | None:
    found = re.match(RUN, path)
    return found[0] if found else None


def _documented_runs() -> tuple[dict[str, set[str]], list[str]]:
    """({run folder: the distinct commands that write it}, the uses of a run folder no earlier command of the
    same page (or of README.md, which every page follows) made)."""
    writers: dict[str, set[str]] = {}
    readme: set[str] = set()
    unmade = []
    for markdown in MARKDOWN:
        made = set(readme)
        for command in _commands(markdown):
            outputs = _writes(command)
            used = re.sub(r"--(?:run-dir|out|trace-dir|write-corpus) \S+", "", command)
            if outputs and "convert.py" in command:
                used = used.replace(outputs[0], "")
            unmade += [f"{markdown.name}: {command!r} uses {run}" for run in re.findall(RUN, used) if run not in made]
            for output in filter(None, map(_run_folder, outputs)):
                writers.setdefault(output, set()).add(command)
                made.add(output)
        if markdown.name == "README.md":
            readme = made
    return writers, unmade


def test_documented_commands_make_every_run_folder_they_use_and_share_none():
    """Followed in order (README.md, then any page), every `runs/X` a documented command reads was made by an
    earlier one, and no two different commands train into the same run folder (the second would resume, or
    be refused as another run, instead of doing what its page says)."""
    writers, unmade = _documented_runs()
    assert "runs/default" in writers and "runs/rl-arithmetic" in writers  # the parse sees the README's commands
    assert not unmade, unmade
    shared = {run: sorted(commands) for run, commands in writers.items() if len(commands) > 1}
    assert not shared, shared
