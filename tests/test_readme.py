"""The README's Python example runs as written (on the bundled model)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_example_runs_as_written(capsys) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    exec(compile(blocks[0], str(README), "exec"), {"__name__": "readme_example"})
    printed = capsys.readouterr().out
    assert "[stop]" in printed or "[length]" in printed  # the stream reached its final output


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def test_every_relative_link_in_the_docs_resolves() -> None:
    """README.md, docs/*.md and docs/design/*.md link only to files (and headings) that
    exist."""
    root = README.parent
    broken = []
    docs = root / "docs"
    for page in [README, *sorted(docs.glob("*.md")), *sorted((docs / "design").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not ours to check
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(root)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{page.relative_to(root)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
