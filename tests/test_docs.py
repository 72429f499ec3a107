"""The user docs against the code: every public name in the API reference, every relative link
resolving, the line budgets, and the README's example and the getting-started step of
docs/usage.md running as written."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import cpindex

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
README_MAX_LINES = 120
DOCS_MAX_LINES = 1600  # all of docs/*.md together

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: Counter[str] = Counter()
    out = set()
    for line in _prose(page.read_text()):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = _slug(m.group(1))
            out.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
            seen[base] += 1
    return out


def _api_reference() -> str:
    text = (ROOT / "docs" / "usage.md").read_text()
    m = re.search(r"^## API reference\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, "docs/usage.md has no '## API reference' section"
    return m.group(1)


def _mentioned(name: str, text: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", text) is not None


def test_every_public_name_is_in_the_api_reference():
    ref = _api_reference()
    missing = [n for n in cpindex.__all__ if not _mentioned(n, ref)]
    assert not missing, f"cpindex.__all__ missing from docs/usage.md's API reference: {missing}"


def test_every_public_indexcp_member_is_in_the_api_reference():
    ref = _api_reference()
    members = [n for n in dir(cpindex.IndexCP) if not n.startswith("_")]
    assert members
    missing = [n for n in members if not _mentioned(n, ref)]
    assert not missing, f"IndexCP members missing from docs/usage.md's API reference: {missing}"


def _links() -> list[tuple[Path, str]]:
    out = []
    for page in PAGES:
        for line in _prose(page.read_text()):
            for target in LINK.findall(line):
                if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, mailto:, ...
                    out.append((page, target))
    return out


@pytest.mark.parametrize(
    ("page", "target"),
    _links(),
    ids=lambda v: str(v.relative_to(ROOT)) if isinstance(v, Path) else v,
)
def test_relative_links_resolve(page: Path, target: str):
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    assert dest.exists(), f"{page.relative_to(ROOT)}: {target}: no such file"
    if anchor:
        assert dest.suffix == ".md", f"{page.relative_to(ROOT)}: {target}: anchor into a non-page"
        assert anchor in _anchors(dest), (
            f"{page.relative_to(ROOT)}: {target}: no heading with anchor #{anchor} in "
            f"{dest.relative_to(ROOT)}"
        )


def test_line_budgets():
    readme = len((ROOT / "README.md").read_text().splitlines())
    docs = {p.name: len(p.read_text().splitlines()) for p in DOCS}
    assert readme <= README_MAX_LINES, f"README.md has {readme} lines (at most {README_MAX_LINES})"
    assert sum(docs.values()) <= DOCS_MAX_LINES, (
        f"docs/*.md have {sum(docs.values())} lines together (at most {DOCS_MAX_LINES}): {docs}"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_getting_started_step_runs_as_written(tmp_path):
    """docs/usage.md's first Python block as written, a world of one process on the CPU, its
    last selection checked against the reference; then the graph-capture and drop-in blocks
    that the page adds to it."""
    text = (ROOT / "docs" / "usage.md").read_text()
    m = re.search(r"^## Getting started\n.*?```python\n(.*?)```", text, re.S | re.M)
    assert m, "docs/usage.md: no Python block under '## Getting started'"
    code = m.group(1)
    assert "\ncp.close()" in code
    check = (  # the last layer's blocks, as the reference selects them (one rank: all heads)
        "want = cpindex.reference.select_blocks(iq, cache, block_table, seq_lens, init_blocks=0,"
        " local_blocks=1, width=block_table.shape[1], query_len=T, topk=16)\n"
        "assert torch.equal(ids, want), (ids, want)\n"
    )
    extra = _block(text, "Graph capture") + _block(text, "Swapping in for the seed")
    _run_one_rank(tmp_path, code.replace("\ncp.close()", "\n" + check + extra + "cp.close()", 1))


def _block(text: str, section: str) -> str:
    """The first Python block of usage.md's section ``section`` (one added to the
    getting-started script before its ``cp.close()``, as the page says)."""
    m = re.search(rf"^## {re.escape(section)}.*?\n.*?```python\n(.*?)```", text, re.S | re.M)
    assert m, f"docs/usage.md: no Python block under '## {section}'"
    return m.group(1)


def test_the_readme_example_runs_as_written(tmp_path):
    """README.md's Python block as written, a world of one process on the CPU."""
    text = (ROOT / "README.md").read_text()
    m = re.search(r"^## Use\n.*?```python\n(.*?)```", text, re.S | re.M)
    assert m, "README.md: no Python block under '## Use'"
    _run_one_rank(tmp_path, m.group(1))


def _run_one_rank(tmp_path: Path, code: str) -> None:
    """Runs ``code`` as rank 0 of a one-process gloo world, CPU only; it must print 'rank 0:'."""
    script = tmp_path / "step.py"
    script.write_text(code)
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    env.update(MASTER_PORT=str(_free_port()), CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "rank 0:" in run.stdout
