"""The docs cite what is in the tree: every repo path, `python -m` module, script and results file that README.md,
docs/*.md, bench/*.md and bench/results/README.md name exists, and the results index names every results file."""

from __future__ import annotations

import fnmatch
import functools
import itertools
import os
import re
from pathlib import Path

from helpers import REPO

RESULTS = REPO / "bench" / "results"
INDEX = RESULTS / "README.md"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "bench").glob("*.md")), INDEX]
SKIPPED_DIRS = {".git", "__pycache__", ".venv", ".pytest_cache", ".ruff_cache", "node_modules"}
ROOTS = "bench|docs|config|tests|kernels|training|generation|weights|storage|data"
PATH = re.compile(rf"(?<![\w/.<>$-])(?:\.\./)?(?:{ROOTS})/[\w./*{{}},-]*[\w*}}/]")
SCRIPT = re.compile(r"(?<![\w/.<>$-])[\w-]+\.(?:py|sh)\b")
MODULE = re.compile(r"python -m ([\w.]+)")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`]+)`")
RESULT_EXTENSIONS = (".json", ".md", ".png", ".log")


def expand_braces(pattern: str) -> list[str]:
    """`h200-context-{1gpu,2gpu}-9fb6b4f.json` -> both names, as a shell expands them."""
    parts = re.split(r"\{([^{}]*)\}", pattern)
    choices = [[part] if i % 2 == 0 else part.split(",") for i, part in enumerate(parts)]
    return ["".join(combination) for combination in itertools.product(*choices)]


def exists(path: Path) -> bool:
    """A path, or a glob with brace alternatives, that names at least one file or folder of the tree."""
    text = path.as_posix().rstrip("/")
    for candidate in expand_braces(text):
        if any(ch in candidate for ch in "*?["):
            if any(Path(candidate).parent.glob(Path(candidate).name)):
                continue
            return False
        if not Path(candidate).exists():
            return False
    return True


def generated(path: str) -> bool:
    """A path that .gitignore names (a prepared dataset, a run's output): what a command writes, not the tree."""
    patterns = [line.strip().strip("/") for line in (REPO / ".gitignore").read_text().splitlines()]
    patterns = [p for p in patterns if p and not p.startswith("#")]
    return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path, p + "/*") for p in patterns)


@functools.cache
def tree_names() -> frozenset[str]:
    """Every file name in the checkout: a bare `script.py` in a doc names one of them."""
    names = set()
    for _, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
        names.update(files)
    return frozenset(names)


def results_prefixes() -> set[str]:
    """The card slugs that start the results names (h100, cpu, ...): a code span starting with one is a result."""
    return {name.split("-")[0] for name in (p.name for p in RESULTS.iterdir()) if re.fullmatch(r"[a-z]+\d*-.+", name)}


def retired_modules(doc: Path) -> set[str]:
    """The `bench.X` tools that the results index's **retired** entry names: its rows keep the commands they ran."""
    found = re.search(r"^- \*\*retired\*\*(.*?)(?=^- |^$)", doc.read_text(), re.S | re.M) if doc == INDEX else None
    return set(re.findall(r"`(bench\.\w+)`", found.group(1))) if found else set()


def line_of(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def outside_fences(text: str) -> str:
    """The text with fenced code blocks blanked (their lines kept, so line numbers hold)."""
    return re.sub(r"^```.*?^```", lambda m: re.sub(r"[^\n]", " ", m.group()), text, flags=re.S | re.M)


def result_name_missing(token: str) -> bool:
    """`h100-train.json`, `h100-ddp*.*`, `h100-fsdp-xl-profile/`: a name, glob or folder in bench/results."""
    names = [p.name for p in RESULTS.iterdir()]
    stems = names + [n.rsplit(".", 1)[0] for n in names if n.endswith(RESULT_EXTENSIONS)]
    for candidate in expand_braces(token.rstrip("/")):
        if not fnmatch.filter(stems, candidate):
            return True
    return False


def citations(doc: Path) -> list[tuple[int, str, Path | None]]:
    """(line, what the doc says, the path it names; None where a results name or module is missing)."""
    text = doc.read_text()
    prose = outside_fences(text)
    found: list[tuple[int, str, Path | None]] = []
    for match in LINK.finditer(prose):
        target = match.group(1).split("#")[0]
        if target and not re.match(r"[a-z]+:", target):
            found.append((line_of(text, match.start()), target, doc.parent / target))
    for match in PATH.finditer(text):
        path = match.group()
        if generated(path):
            continue
        if path.startswith("../"):
            found.append((line_of(text, match.start()), path, doc.parent / path))
        else:
            found.append((line_of(text, match.start()), path, REPO / path))
    retired = retired_modules(doc)
    for match in MODULE.finditer(text):
        module = match.group(1).rstrip(".")
        if module in retired:
            continue
        base = REPO / module.replace(".", "/")
        top = REPO / module.split(".")[0]
        if not (top.is_dir() or top.with_suffix(".py").exists()):
            continue  # another package's module: python -m pytest, torch.distributed.run
        if not any(p.exists() for p in (base.with_suffix(".py"), base / "__main__.py", base / "__init__.py")):
            found.append((line_of(text, match.start()), f"python -m {module}", None))
    for match in SCRIPT.finditer(text):
        if match.group() not in tree_names():
            found.append((line_of(text, match.start()), match.group(), None))
    prefixes = results_prefixes()
    for match in CODE.finditer(prose):
        for token in match.group(1).split():
            token = token.strip(",;:()")
            if token.split("-")[0] in prefixes and "/" not in token.rstrip("/") and result_name_missing(token):
                found.append((line_of(text, match.start()), f"{token} (in bench/results/)", None))
    return found


def test_every_path_script_module_and_results_file_the_docs_cite_is_in_the_tree():
    missing = [
        f"{doc.relative_to(REPO)}:{line}: {what} is not in the tree"
        for doc in DOCS
        for line, what, path in citations(doc)
        if path is None or not exists(path)
    ]
    assert not missing, "\n".join(missing)


def test_the_results_index_names_every_file_in_bench_results():
    """Each file or folder, by its name or its name without the extension (`h100-train.{json,md,png}` or
    `h100-train.*` count for all three)."""
    patterns = [
        name
        for span in CODE.findall(INDEX.read_text())
        for token in span.split()
        for name in expand_braces(token.strip(",;:()").rstrip("/"))
    ]
    unindexed = [
        path.name
        for path in sorted(RESULTS.iterdir())
        if path.name != "README.md"
        and not any(fnmatch.fnmatch(key, p) for key in (path.name, path.name.rsplit(".", 1)[0]) for p in patterns)
    ]
    assert not unindexed, f"bench/results/README.md does not index: {', '.join(unindexed)}"


def test_the_check_finds_a_missing_citation_and_names_the_line(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# t\n\nsee `bench/no_such_bench.py` and `h100-no-such-result.json`, `python -m bench.nope`\n")
    found = {what: line for line, what, path in citations(doc) if path is None or not exists(path)}
    assert found == {
        "bench/no_such_bench.py": 3,
        "h100-no-such-result.json (in bench/results/)": 3,
        "python -m bench.nope": 3,
    }
