"""``python -m course_lib site`` (``make site``): the whole course as a static website, read without installing.

Built with nbconvert's HTML exporter (already a dependency of JupyterLab) and a small generated index, not
Jupyter Book: the course is nine notebooks and one syllabus, which needs no book toolchain (Jupyter Book 2
brings a Node.js build); nbconvert renders exactly what the notebooks stored, offline, in seconds.

    site/index.html                  the syllabus: each lab's title, aim and time, with its two links
    site/solutions/NN_name.html      each solution with its stored outputs (run `make solutions` first)
    site/labs/NN_name.ipynb          each lab, to download and run

Every page stands alone: CSS and images are inlined, no script is fetched (no require.js, MathJax,
Mermaid or widget manager from a CDN -- the labs write no LaTeX), so it opens from a file or any static host.
A widget is shown as its static view: the picture it stored beside itself, or a line saying it is
interactive. Links between notebooks (``01_data_parallel.ipynb``) point to the pages.
"""
from __future__ import annotations

import copy
import html
import re
import shutil
import time
from pathlib import Path

import nbformat

__all__ = ["build_site", "cmd_site"]

WIDGET = "application/vnd.jupyter.widget-view+json"
WIDGET_NOTE = ("<p class='course-widget'><em>An interactive widget: open the lab in JupyterLab to use it.</em></p>")
_TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{% block jupyter_widgets %}{% endblock jupyter_widgets %}
{% block extra_css %}<link rel="icon" href="data:,"><style>{{ resources.course_css }}</style>{% endblock extra_css %}
{%- block body_header -%}{{ super() }}{{ resources.course_nav }}{%- endblock body_header -%}
{% block body_footer %}{{ resources.course_nav }}{{ super() }}{% endblock body_footer %}
"""
_CSS = """nav.course-nav{display:flex;gap:1.2em;padding:.6em 1em;margin:0 0 1em;background:#f3f5f8;
border-bottom:1px solid #d0d7de;font:14px system-ui,sans-serif}nav.course-nav a{color:#0b5cad;text-decoration:none}
nav.course-nav a:hover{text-decoration:underline}"""
_INDEX_CSS = """body{font:16px/1.5 system-ui,sans-serif;max-width:60em;margin:2em auto;padding:0 1em;color:#222}
.lab{border:1px solid #d0d7de;border-radius:6px;padding:.4em 1em;margin:1em 0}.lab h2{font-size:1.15em;margin:.4em 0}
.links a{margin-right:1.2em}"""


def _title(nb) -> str:
    """The lab's title as plain text: the first line of its first cell, without the heading's # and markdown's
    backticks (`fully_shard` reads fully_shard in a page title and a link)."""
    first = nb.cells[0].source.strip().splitlines() if nb.cells else [""]
    return first[0].lstrip("# ").strip().replace("`", "") if first else ""


def _title_html(nb) -> str:
    """The lab's title as HTML: escaped, its `code` spans as <code> (the syllabus's headings)."""
    first = nb.cells[0].source.strip().splitlines() if nb.cells else [""]
    text = html.escape(first[0].lstrip("# ").strip() if first else "")
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", text)


def _short(title: str, limit: int = 40) -> str:
    """``title`` cut to at most ``limit`` characters at a word boundary, with an ellipsis (never mid-word)."""
    if len(title) <= limit:
        return title
    cut = title[:limit - 1].rsplit(" ", 1)[0].rstrip(" ,;:—–-(")
    return cut + "…"


def _summary(nb) -> tuple[str, str]:
    """(first paragraph after the title, the **Time:** line) of a lab's first cell."""
    paras = [p.strip() for p in nb.cells[0].source.split("\n\n")[1:] if p.strip()] if nb.cells else []
    time_line = next((p for p in paras if p.startswith("**Time:**")), "")
    return (paras[0] if paras else ""), time_line


def _static(nb, names: set[str]) -> nbformat.NotebookNode:
    """A copy whose widget outputs are their static views and whose links to labs point to pages."""
    nb = copy.deepcopy(nb)
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = re.sub(r"\]\((?:\.\./)?(?:labs/|solutions/)?(\d\d_[\w-]+)\.ipynb(#[^)]*)?\)",
                                 lambda m: f"]({m.group(1)}.html{m.group(2) or ''})"
                                 if m.group(1) in names else m.group(0), cell.source)
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET in data:
                data.pop(WIDGET)
                if not any(k.startswith("image/") for k in data):
                    out["data"] = {"text/html": WIDGET_NOTE, "text/plain": "(interactive widget)"}
    return nb


def _nav(pages: list[tuple[str, str]], i: int) -> str:
    stem, title = pages[i]
    links = ["<a href='../index.html'>Course home</a>"]
    if i > 0:
        links.append(f"<a href='{pages[i - 1][0]}.html' rel='prev' title='{html.escape(pages[i - 1][1], quote=True)}'>"
                     f"← {html.escape(_short(pages[i - 1][1]))}</a>")
    if i + 1 < len(pages):
        links.append(f"<a href='{pages[i + 1][0]}.html' rel='next' title='{html.escape(pages[i + 1][1], quote=True)}'>"
                     f"{html.escape(_short(pages[i + 1][1]))} →</a>")
    links.append(f"<a href='../labs/{stem}.ipynb' download>Download the lab (.ipynb)</a>")
    return "<nav class='course-nav'>" + "".join(links) + "</nav>"


def _index(entries: list[tuple[str, str, str, str, bool]], course: str) -> str:
    from nbconvert.filters import markdown2html
    out = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(course)}</title>",
           "<meta name='viewport' content='width=device-width, initial-scale=1.0'><link rel='icon' href='data:,'>",
           f"<style>{_INDEX_CSS}</style></head><body><h1>{html.escape(course)}</h1>",
           "<p>A hands-on course on sharded training: data parallel from scratch, FSDP in PyTorch and JAX, hybrid "
           "sharding and distributed checkpointing. Each lab below has its solution to read, with the outputs it "
           "printed, and the lab itself to download and run in JupyterLab.</p><h2>Syllabus</h2>"]
    for stem, title, aim, time_line, has_lab in entries:       # title: HTML (_title_html)
        links = [f"<a href='solutions/{stem}.html'>Read the solution</a>"]
        if has_lab:
            links.append(f"<a href='labs/{stem}.ipynb' download>Download the lab (.ipynb)</a>")
        out.append(f"<section class='lab' id='lab{stem[:2]}'><h2>{title}</h2>{markdown2html(aim)}"
                   f"{markdown2html(time_line)}<p class='links'>{''.join(links)}</p></section>")
    out.append("</body></html>")
    return "\n".join(out)


def build_site(solutions: Path, labs: Path, out: Path, pattern: str = "[0-9][0-9]_*.ipynb",
               course: str = "FSDP course: sharded training, from scratch to FSDP2 and JAX") -> list[Path]:
    """Write the site into ``out`` (emptied first); return the pages written."""
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter
    paths = sorted(Path(solutions).glob(pattern))
    if not paths:
        raise FileNotFoundError(f"no notebooks match {Path(solutions) / pattern}")
    shutil.rmtree(out, ignore_errors=True)
    (out / "solutions").mkdir(parents=True)
    (out / "labs").mkdir()
    exporter = HTMLExporter(template_name="lab", template_file="course_page.html.j2", embed_images=True,
                            extra_loaders=[DictLoader({"course_page.html.j2": _TEMPLATE})])
    notebooks = [nbformat.read(p, as_version=4) for p in paths]
    pages = [(p.stem, _title(nb)) for p, nb in zip(paths, notebooks)]
    names = {p.stem for p in paths}
    written, entries = [], []
    for i, (path, nb) in enumerate(zip(paths, notebooks)):
        body, _ = exporter.from_notebook_node(_static(nb, names), resources={
            "metadata": {"name": pages[i][1]}, "course_nav": _nav(pages, i), "course_css": _CSS})
        page = out / "solutions" / f"{path.stem}.html"
        page.write_text(body, encoding="utf-8")
        lab = Path(labs) / path.name
        if lab.exists():
            shutil.copy(lab, out / "labs" / path.name)
        written.append(page)
        entries.append((path.stem, _title_html(nb), *_summary(nb), lab.exists()))
    (out / "index.html").write_text(_index(entries, course), encoding="utf-8")
    return [out / "index.html", *written]


def cmd_site(args) -> int:
    start = time.perf_counter()
    pages = build_site(args.solutions, args.labs, args.out, args.pattern)
    print(f"wrote {len(pages)} pages and {len(pages) - 1} labs under {args.out} in {time.perf_counter() - start:.1f} s; "
          f"open {args.out / 'index.html'}")
    return 0
