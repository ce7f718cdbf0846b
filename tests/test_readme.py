"""The README's embedded-API example runs as written (against a freshly exported demo bundle)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_embedded_api_example_runs(demo_bundle, capsys):
    text = README.read_text()
    section = text[text.index("## Embedded API"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert 'Pipeline.load("build/demo")' in code
    exec(compile(code.replace('"build/demo"', repr(str(demo_bundle))), "README.md", "exec"), {})
    assert len(capsys.readouterr().out) > 0  # the stream loop printed the continuation


def test_readme_starts_with_the_two_commands():
    first = README.read_text().split("```")[1]
    assert "make demo" in first and "make test" in first
