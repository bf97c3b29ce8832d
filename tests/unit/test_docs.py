"""The documentation keeps up with the code: every configuration key is on the
configuration page, the README's test command is what CI runs, and every link between
the pages reaches a file and a heading that exist."""

import re
from collections import Counter

from framework.config import GenerateConfig, RunConfig, setting_names
from tests.helpers import REPO


keys = setting_names


def test_every_configuration_key_is_on_the_configuration_page():
    page = (REPO / "docs" / "configuration.md").read_text()
    named = set(re.findall(r"`([a-z_][\w.]*)`", page))
    missing = [k for k in keys(RunConfig) if k not in named]
    assert missing == [], f"docs/configuration.md lacks {missing}"
    assert len(keys(RunConfig)) > 60  # the walk reaches the nested groups
    generate = [k for k in keys(GenerateConfig) if k not in named]
    assert generate == [], f"docs/configuration.md lacks the generate settings {generate}"


def test_the_readme_test_command_is_what_ci_runs():
    readme, ci = (REPO / "README.md").read_text(), (REPO / ".ci" / "run").read_text()
    command = "pip install -e '.[test,aot]' && python -m pytest -q"
    assert command in readme and command in ci
    assert "pip install -e . && python -m framework.run recipe=llama_small_3d" in readme


_LINK = re.compile(r"\]\(([^)\s#]*)(?:#([^)\s]+))?\)")  # [text](path#anchor)


def _anchors(page: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped,
    spaces as hyphens, a repeated heading's with -1, -2, ... (code blocks skipped)."""
    found, seen, code = set(), Counter(), False
    for line in page.splitlines():
        code = code != line.startswith("```")
        heading = re.match(r"#{1,6} (.*)", line)
        if code or line.startswith("```") or not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        found.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
        seen[slug] += 1
    return found


def test_every_link_between_the_pages_reaches_a_file_and_a_heading():
    broken = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for path, anchor in _LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", path):  # (https:, mailto:)
                continue
            target = (page.parent / path) if path else page
            name = f"{page.relative_to(REPO)}: ({path}#{anchor})"
            if not target.exists():
                broken.append(f"{name}: no such file")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target.read_text()):
                broken.append(f"{name}: no such heading")
    assert broken == [], "\n".join(broken)
    assert _anchors("## A `b` (c, d): e\n## A `b` (c, d): e\n```\n# x\n```") == {
        "a-b-c-d-e", "a-b-c-d-e-1"}
