"""The report's Markdown as one self-contained HTML page: the page is rendered from the Markdown, so the two
say the same thing.

Only the Markdown that specrt writes is understood: headings, paragraphs, `-` lists, pipe tables, fenced
code, and inline code, bold, links and images. Images are embedded: an SVG plot inline (from the plots
the report drew), a PNG as a data: URI, so that the page opens with no network and no files beside it.
"""

from __future__ import annotations

import base64
import re
from html import escape
from pathlib import Path

STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }
h1 { border-bottom: 2px solid #ddd; padding-bottom: .3em; }
h2 { border-bottom: 1px solid #eee; padding-bottom: .2em; margin-top: 2em; }
table { border-collapse: collapse; margin: .8em 0; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; }
th { background: #f4f4f4; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
code { background: #f3f3f3; padding: 1px 4px; border-radius: 3px; font-size: 12px; }
pre { background: #f6f8fa; padding: .7em; overflow-x: auto; }
figure { margin: 1em 0; }
figure img { max-width: 100%; }
nav ul { columns: 2; }
"""

_INLINE = re.compile(r"`([^`]+)`|\*\*(.+?)\*\*|!\[([^\]]*)\]\(([^)]+)\)|\[([^\]]+)\]\(([^)]+)\)")


class Renderer:
    def __init__(self, plots: dict[str, str], base: Path):
        """plots: image source -> SVG text (inlined); base: where other image sources are read from."""
        self.plots, self.base = plots, base

    def image(self, alt: str, src: str) -> str:
        if src in self.plots:
            return f'<figure>{self.plots[src]}<figcaption>{escape(alt)}</figcaption></figure>'
        path = (self.base / src) if not Path(src).is_absolute() else Path(src)
        if path.suffix == ".png" and path.is_file():
            data = base64.b64encode(path.read_bytes()).decode()
            return f'<figure><img alt="{escape(alt)}" src="data:image/png;base64,{data}"><figcaption>{escape(alt)}</figcaption></figure>'
        return f"<em>[{escape(alt)}: {escape(src)} not found]</em>"

    def inline(self, text: str) -> str:
        out, pos = [], 0
        for m in _INLINE.finditer(text):
            out.append(escape(text[pos:m.start()]))
            code, bold, alt, src, label, href = m.groups()
            if code is not None:
                out.append(f"<code>{escape(code)}</code>")
            elif bold is not None:
                out.append(f"<strong>{self.inline(bold)}</strong>")
            elif src is not None:
                out.append(self.image(alt, src))
            else:
                out.append(f'<a href="{escape(href)}">{self.inline(label)}</a>')
            pos = m.end()
        out.append(escape(text[pos:]))
        return "".join(out)

    def table(self, rows: list[str]) -> str:
        def cells(line):
            return [c.strip() for c in line.strip().strip("|").split("|")]

        head, align, body = cells(rows[0]), cells(rows[1]), [cells(r) for r in rows[2:]]
        right = [a.endswith(":") for a in align]
        html = ["<table><thead><tr>" + "".join(f"<th>{self.inline(h)}</th>" for h in head) + "</tr></thead><tbody>"]
        for r in body:
            html.append("<tr>" + "".join(f'<td{" class=num" if i < len(right) and right[i] else ""}>{self.inline(c)}</td>'
                                          for i, c in enumerate(r)) + "</tr>")
        return "\n".join(html + ["</tbody></table>"])

    def blocks(self, md: str) -> str:
        lines, out, i = md.splitlines(), [], 0
        while i < len(lines):
            line = lines[i]
            if line.startswith("```"):
                j = i + 1
                while j < len(lines) and not lines[j].startswith("```"):
                    j += 1
                out.append(f"<pre><code>{escape(chr(10).join(lines[i + 1:j]))}</code></pre>")
                i = j + 1
            elif m := re.match(r"(#{1,6}) (.*)", line):
                level, text = len(m.group(1)), m.group(2)
                anchor = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
                out.append(f'<h{level} id="{anchor}">{self.inline(text)}</h{level}>')
                i += 1
            elif line.startswith("|"):
                j = i
                while j < len(lines) and lines[j].startswith("|"):
                    j += 1
                out.append(self.table(lines[i:j]))
                i = j
            elif line.startswith("- "):
                items = []
                while i < len(lines) and (lines[i].startswith("- ") or (lines[i].startswith("  ") and items)):
                    if lines[i].startswith("- "):
                        items.append(lines[i][2:])
                    else:
                        items[-1] += " " + lines[i].strip()
                    i += 1
                out.append("<ul>" + "".join(f"<li>{self.inline(t)}</li>" for t in items) + "</ul>")
            elif not line.strip():
                i += 1
            else:
                para = []
                while i < len(lines) and lines[i].strip() and not re.match(r"(#{1,6} |\||- |```)", lines[i]):
                    para.append(lines[i])
                    i += 1
                text = " ".join(para)
                alone = re.fullmatch(r"!\[[^\]]*\]\([^)]+\)", text)  # a figure, not inside a paragraph
                out.append(self.inline(text) if alone else f"<p>{self.inline(text)}</p>")
        return "\n".join(out)


def to_html(md: str, title: str, plots: dict[str, str], base: Path) -> str:
    body = Renderer(plots, base).blocks(md)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{STYLE}</style></head>'
            f"<body>\n{body}\n</body></html>\n")
