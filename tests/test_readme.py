"""The README's embedded-API example runs as written (against a freshly exported demo bundle)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_embedded_api_example_runs(demo_bundle, capsys):
    text = README.read_text()
    section = text[text.index("## Embedded API"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert 'Pipeline.load("build/demo")' in blocks[0] and len(blocks) == 2 and "pipe.server(" in blocks[1]
    scope = {}
    for code in blocks:  # the pipeline example, then the server example on its pipe
        exec(compile(code.replace('"build/demo"', repr(str(demo_bundle))), "README.md", "exec"), scope)
        assert len(capsys.readouterr().out) > 0  # the stream loops printed their continuations


def test_readme_starts_with_the_two_commands():
    first = README.read_text().split("```")[1]
    assert "make demo" in first and "make test" in first


def test_readme_is_short_and_links_every_docs_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    pages = {p.name for p in (README.parent / "docs").glob("*.md")}
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", text))
    assert pages == linked, f"docs pages not linked from README: {sorted(pages - linked)}"


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings (lowercased, punctuation dropped, spaces to hyphens, repeats
    numbered), code blocks left out, and its explicit ones (`<a id="...">`)."""
    anchors, seen, fenced = set(), {}, False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        anchors |= set() if fenced else set(re.findall(r'<a id="([^"]+)"></a>', line))
        heading = None if fenced else re.match(r"#{1,6} (.+)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_relative_links_in_readme_and_docs_resolve():
    root = README.parent
    broken = []
    for page in [README, *sorted((root / "docs").glob("*.md"))]:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text()):
            if "://" in target:
                continue
            dest = page.parent / target if target else page
            if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest)):
                broken.append(f"{page.relative_to(root)}: {target}" + (f"#{anchor}" if anchor else ""))
    assert not broken, broken
