"""``python -m course_lib site`` (``make site``): the whole course as a static website, read without installing.

Built with nbconvert's HTML exporter (already a dependency of JupyterLab) and a small generated index, not
Jupyter Book: the course is nine notebooks and one syllabus, which needs no book toolchain (Jupyter Book 2
brings a Node.js build); nbconvert renders exactly what the notebooks stored, offline, in seconds.

    site/index.html                  the front door: how to start (clone, ``make lab``, ``make doctor``,
                                     what a downloaded lab needs), the total time, and the syllabus: each
                                     lab's title, aim and time, with its two links
    site/solutions/NN_name.html      each solution with its stored outputs (run `make solutions` first) and
                                     a table of contents
    site/docs/NAME.html              each ``docs/NAME.md`` (instructors, grading, clusters, GPUs, ...)
    site/labs/NN_name.ipynb          each lab, to download and run

Every page stands alone: CSS and images are inlined, no script is fetched (no require.js, MathJax,
Mermaid or widget manager from a CDN -- the labs write no LaTeX), so it opens from a file or any static host.
Every page's navigation names the start, the docs pages and (on a lab) the previous and next labs.

A solution page shows what a reader needs, not the notebook's machinery (:func:`_static`): a widget is its
static view (the picture it stored beside itself, or a line saying it is interactive); a progress bar or
clock, which only said a cell was alive, is dropped; the authoring markers (``### BEGIN SOLUTION``,
``### HINT: ...``) are dropped from the code; a prediction the solution left unwritten shows only what was
measured. Links between notebooks (``01_data_parallel.ipynb``) and to the docs (``docs/grading.md``)
point to the pages. Prose is held to ~80 characters a line; code keeps the page's width.

Longer than ~300 lines: the site is one concept (notebooks and docs to static pages); its parts -- what a page
leaves out, its navigation and contents, the index's Start block -- are small and only make sense together.
"""
from __future__ import annotations

import copy
import html
import re
import shutil
import time
from pathlib import Path

import nbformat

from course_lib.authoring.lab_time import STATED

__all__ = ["build_site", "cmd_site", "learner_minutes", "DOC_ORDER"]

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
_NAV_CSS = """nav.course-nav{display:flex;flex-wrap:wrap;gap:.3em 1.2em;padding:.6em 1em;margin:0 0 1em;
background:#f3f5f8;border-bottom:1px solid #d0d7de;font:14px system-ui,sans-serif}
nav.course-nav a{color:#0b5cad;text-decoration:none}nav.course-nav a:hover{text-decoration:underline}"""
#: ~80-90 characters of prose a line (``ch`` is a digit's width; prose averages ~0.8 of it): headings, paragraphs and
#: lists of the markdown cells. Code cells, outputs and tables keep the page's width.
PROSE_WIDTH = "72ch"
_CSS = _NAV_CSS + f"""
.jp-RenderedMarkdown :is(p,li,blockquote,h1,h2,h3,h4,h5,h6,dl){{max-width:{PROSE_WIDTH}}}
nav.course-toc{{border:1px solid #d0d7de;border-radius:6px;padding:.4em 1em;margin:.5em 0 1em
var(--jp-cell-prompt-width,64px);max-width:{PROSE_WIDTH};
font:14px/1.45 system-ui,sans-serif;background:#fbfcfd}}nav.course-toc summary{{font-weight:600;cursor:pointer}}
nav.course-toc ol{{margin:.3em 0;padding-left:.2em;list-style:none}}nav.course-toc ol ol{{padding-left:1.4em}}
nav.course-toc a{{color:#0b5cad;text-decoration:none}}nav.course-toc p{{margin:.4em 0}}"""
_INDEX_CSS = _NAV_CSS + f"""
body{{font:16px/1.5 system-ui,sans-serif;margin:0;color:#222}}main{{max-width:{PROSE_WIDTH};margin:1em auto 3em;
padding:0 1em}}.lab{{border:1px solid #d0d7de;border-radius:6px;padding:.4em 1em;margin:1em 0}}
.lab h2{{font-size:1.15em;margin:.4em 0}}.links a{{margin-right:1.2em}}
pre{{background:#f6f8fa;border:1px solid #d0d7de;border-radius:6px;padding:.6em 1em;overflow-x:auto;font-size:14px}}
code{{font-size:.92em}}table{{border-collapse:collapse;margin:1em 0;font-size:.95em}}
td,th{{border:1px solid #d0d7de;padding:.25em .6em;vertical-align:top;text-align:left}}
#start{{background:#f3f8ff;border:1px solid #b6d4fe;border-radius:6px;padding:.2em 1em;margin:1em 0}}
a.anchor-link{{display:none}}main.doc{{max-width:62em}}
main.doc :is(p,li,h1,h2,h3,blockquote){{max-width:{PROSE_WIDTH}}}"""
#: docs/NAME.md pages in the navigation, in this order (any other docs page follows, by name)
DOC_ORDER = ("instructors", "grading", "clusters", "gpus", "benchmarks", "tests")
#: widget models that only show a cell is alive (tqdm's bar, the labs' clocks): dropped from the pages
_PROGRESS_MODELS = ("FloatProgressModel", "IntProgressModel")
_PROGRESS_TEXT = re.compile(r"\|[ \u2580-\u259f#]{5,}\|")      # a text bar, where no widget state was saved
_MARKER = re.compile(r"###\s*(?:(?:BEGIN|END)\s+(?:SOLUTION|HIDDEN)\s*$|HINT:)")
#: checks.prediction's line when the learner wrote no prediction: the page keeps what was measured
_UNSCORED = re.compile(r"no prediction written \([^)]*\); ")
_STRAY = re.compile(r"<function [\w.<>]+ at 0x[0-9a-f]+>")
#: what a lab downloaded alone lacks (the site says it beside every download)
NEEDS_REPO = ("A lab's first cell imports course_lib, the course's library, which is in the repository, not in the "
              ".ipynb: run alone, the lab stops there and says so (\"this lab needs the course's repository\").")
_LEARNER_TIME = re.compile(r"\*\*Time:\*\*\s*~?\s*(\d+(?:\.\d+)?)\s*(min|h)\b([^.]*)")


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


def learner_minutes(time_line: str, where: str = "a lab") -> int:
    """The minutes of work a lab's ``**Time:** ~75 min (...)`` (or ``~2 h``) line states (the index adds them up)."""
    m = _LEARNER_TIME.search(time_line)
    if m is None:
        raise ValueError(f"{where}: its first cell states no learner time; write a paragraph that starts "
                         f"'**Time:** ~75 min (four exercises).' (found {time_line[:80]!r})")
    return round(float(m[1]) * (60 if m[2] == "h" else 1))


def _card_time(time_line: str, where: str) -> str:
    """A syllabus card's time: the learner's minutes and the notebook's run time, without the measurement notes
    (which machine, which command) that the lab's own first cell keeps for its authors."""
    minutes, rest = learner_minutes(time_line, where), _LEARNER_TIME.search(time_line)[3].strip()
    text = f"<strong>Time:</strong> ~{minutes} min{' ' + html.escape(rest) if rest else ''}"
    run = STATED.search(time_line.replace("\n", " "))
    if run:
        text += f"; run untouched, the notebook takes {run[1]}–{run[2]} {run[3]} on 2 CPU cores"
    return f"<p class='time'>{text}.</p>"


def _duration(minutes: int) -> str:
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"


def _is_progress(view: dict, state: dict) -> bool:
    """Whether a widget output is a progress bar or clock: its saved model (or a child's) is a progress model;
    where no state was saved, its text form is a bar (``|████      |``)."""
    if view.get("model_id") not in state:
        return False
    todo = [state[view["model_id"]]]
    while todo:
        model = todo.pop()
        if model.get("model_name") in _PROGRESS_MODELS:
            return True
        todo += [state.get(str(c).removeprefix("IPY_MODEL_"), {}) for c in model.get("state", {}).get("children", [])]
    return False


def _link_pages(source: str, names: set[str], docs: set[str], prefix: str = "../") -> str:
    """Markdown links to the course's notebooks and docs, pointed at their pages (``prefix``: from the page to the
    site's root); other links are left as written."""
    source = re.sub(r"\]\((?:\.\./)?(?:labs/|solutions/)?(\d\d_[\w-]+)\.ipynb(#[^)]*)?\)",
                    lambda m: f"]({prefix}solutions/{m[1]}.html{m[2] or ''})" if m[1] in names else m[0], source)
    source = re.sub(r"\]\((?:\.\./)?(?:docs/)?([\w-]+)\.md(#[^)]*)?\)",
                    lambda m: f"]({prefix}docs/{m[1]}.html{m[2] or ''})" if m[1] in docs else m[0], source)
    return re.sub(r"\]\((?:\.\./)?README\.md(#[^)]*)?\)", lambda m: f"]({prefix}index.html{m[1] or ''})", source)


def _static(nb, names: set[str], docs: set[str] = frozenset()) -> nbformat.NotebookNode:
    """A copy to publish: widget outputs as their static views, progress displays dropped, the authoring markers
    dropped from the code, an unwritten prediction's line reduced to what was measured, links pointed at pages."""
    nb = copy.deepcopy(nb)
    state = nb.metadata.pop("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    for cell in nb.cells:
        cell.source = "".join(line for line in cell.source.splitlines(keepends=True)
                              if not _MARKER.match(line.strip()))
        if cell.cell_type == "markdown":
            cell.source = _link_pages(cell.source, names, docs, prefix="../")
            continue
        kept = []
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET in data:
                if _is_progress(data[WIDGET], state) or (data[WIDGET].get("model_id") not in state
                                                          and _PROGRESS_TEXT.search(data.get("text/plain", ""))):
                    continue
                data.pop(WIDGET)
                if not any(k.startswith("image/") for k in data):
                    out["data"] = {"text/html": WIDGET_NOTE, "text/plain": "(interactive widget)"}
            elif set(data) == {"text/plain"} and _STRAY.fullmatch(data["text/plain"].strip()):
                continue                          # a function's repr: what `interact(f)` returns, not a result
            if out.get("output_type") == "stream":
                out["text"] = _UNSCORED.sub("", out["text"])
            kept.append(out)
        cell.outputs = kept
    return nb


def _site_links(prefix: str, docs: list[tuple[str, str]], current: str | None = None) -> list[str]:
    """Course home, Start and every docs page, as every page's navigation names them."""
    links = [f"<a href='{prefix}index.html'>Course home</a>", f"<a href='{prefix}index.html#start'>Start</a>"]
    for stem, label in docs:
        links.append(f"<a href='{prefix}docs/{stem}.html' class='doc'"
                     f"{' aria-current=page' if stem == current else ''}>{html.escape(label)}</a>")
    return links


def _nav(pages: list[tuple[str, str]], i: int, docs: list[tuple[str, str]] = ()) -> str:
    stem, title = pages[i]
    links = _site_links("../", list(docs))
    if i > 0:
        links.append(f"<a href='{pages[i - 1][0]}.html' rel='prev' title='{html.escape(pages[i - 1][1], quote=True)}'>"
                     f"← {html.escape(_short(pages[i - 1][1]))}</a>")
    if i + 1 < len(pages):
        links.append(f"<a href='{pages[i + 1][0]}.html' rel='next' title='{html.escape(pages[i + 1][1], quote=True)}'>"
                     f"{html.escape(_short(pages[i + 1][1]))} →</a>")
    links.append(f"<a href='../labs/{stem}.ipynb' download title='{html.escape(NEEDS_REPO, quote=True)}'>"
                 "Download the lab (.ipynb)</a>")
    return "<nav class='course-nav'>" + "".join(links) + "</nav>"


_HEADING = re.compile(r"<h([23]) id=\"([^\"]+)\"[^>]*>(.*?)</h\1>", re.S)


def _toc(body: str) -> str:
    """A lab page's table of contents: its ## sections, each with its ### parts (exercises), as links to the
    heading ids nbconvert wrote; and how to run the lab."""
    tree: list[tuple[str, str, list]] = []
    for m in _HEADING.finditer(body):
        text = re.sub(r"<a class=\"anchor-link\".*?</a>", "", m[3], flags=re.S)
        text = re.sub(r"<(?!/?code\b)[^>]*>", "", text).strip()
        if m[1] == "2" or not tree:
            tree.append((m[2], text, []))
        else:
            tree[-1][2].append((m[2], text))
    items = []
    for anchor, text, subs in tree:
        sub = "".join(f"<li><a href=\"#{a}\">{t}</a></li>" for a, t in subs)
        items.append(f"<li><a href=\"#{anchor}\">{text}</a>{f'<ol>{sub}</ol>' if sub else ''}</li>")
    return ("<nav class='course-toc' aria-label='Contents'><details open><summary>Contents</summary>"
            f"<ol>{''.join(items)}</ol></details><p>To run this lab: clone the course, then <code>make lab</code> "
            f"(<a href='../index.html#start'>Start</a>). {html.escape(NEEDS_REPO, quote=False)}</p></nav>")


def _with_toc(body: str) -> str:
    """The page with its table of contents after the first cell (the lab's title, aim, objectives and time)."""
    cells = [m.start() for m in re.finditer(r'<div class="jp-Cell ', body)]
    at = cells[1] if len(cells) > 1 else body.index("</main>")
    return body[:at] + _toc(body) + body[at:]


def _doc_title(text: str, where: Path) -> str:
    m = re.search(r"^# (.+)$", text, re.M)
    if m is None:
        raise ValueError(f"{where}: a docs page starts with a '# Title' line (the navigation's label)")
    return m[1].strip().replace("`", "")


def _page(title: str, nav: str, body: str, kind: str = "index") -> str:
    """A page of the site's own (the index, a docs page): a docs page is wider, for its code and tables, but its
    prose keeps the index's width."""
    return (f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            "<meta name='viewport' content='width=device-width, initial-scale=1.0'><link rel='icon' href='data:,'>"
            f"<style>{_INDEX_CSS}</style></head><body>{nav}<main class='{kind}'>{body}</main>{nav}</body></html>")


def _start(repo: str | None, total: int, n_labs: int) -> str:
    """The index's Start block: get the repository, the two commands, ``make doctor``, what a downloaded lab needs."""
    if repo:
        shown = html.escape(repo)
        where = (f"<a href='{shown}'>{shown}</a>" if re.match(r"https?://", repo) else f"<code>{shown}</code>")
        get = (f"<li>Get the course's repository, {where}:<pre>git clone {shown} fsdp-course\ncd fsdp-course</pre>"
               "</li>")
    else:
        get = ("<li>Get the course's repository (the folder with <code>Makefile</code>, <code>course_lib/</code> "
               "and <code>labs/</code>; this site was built from it) and open a terminal in it.</li>")
    return (
        "<section id='start'><h2>Start</h2><ol>" + get +
        "<li>Start the labs (Python 3.10+ and <code>make</code> are all it needs):<pre>"
        "make lab     # install into .venv, open JupyterLab on labs/\n"
        "make test    # the same install, then every test and every lab</pre>"
        "<code>make lab</code> prints a URL with a token: open it in your browser.</li>"
        "<li>Is the machine ready? <code>make doctor</code> prints Python, torch and JAX versions, CPU cores, "
        "GPUs, the backend 4 ranks would use and why, and JAX's devices.</li></ol>"
        "<p><strong>A downloaded lab needs the repository.</strong> "
        f"{html.escape(NEEDS_REPO, quote=False)} Open it from "
        "<code>labs/</code> in JupyterLab started by <code>make lab</code>.</p>"
        f"<p><strong>Time:</strong> {n_labs} labs, about {_duration(total)} of work in all ({total} min: the sum "
        "of the times the labs state below), plus a few minutes of running each.</p></section>")


def _index(entries: list[tuple[str, str, str, str, bool]], course: str, docs: list[tuple[str, str]] = (),
           repo: str | None = None) -> str:
    from nbconvert.filters import markdown2html
    total = sum(learner_minutes(e[3], f"solutions/{e[0]}.ipynb") for e in entries)
    out = [f"<h1>{html.escape(course)}</h1>",
           "<p>A hands-on course on sharded training: data parallel from scratch, FSDP in PyTorch and JAX, hybrid "
           "sharding and distributed checkpointing, on real collectives. The same notebooks run on a laptop's CPU "
           "and on a multi-GPU machine. Each lab below has its solution to read, with the outputs it printed, and "
           "the lab itself to download and run in JupyterLab.</p>", _start(repo, total, len(entries))]
    if docs:
        out.append("<p>For instructors, clusters and GPUs: " + ", ".join(
            f"<a href='docs/{stem}.html'>{html.escape(label)}</a>" for stem, label in docs) + ".</p>")
    out.append("<h2>Syllabus</h2>")
    for stem, title, aim, time_line, has_lab in entries:       # title: HTML (_title_html)
        links = [f"<a href='solutions/{stem}.html'>Read the solution</a>"]
        if has_lab:
            links.append(f"<a href='labs/{stem}.ipynb' download title='{html.escape(NEEDS_REPO, quote=True)}'>"
                         "Download the lab (.ipynb)</a>")
        out.append(f"<section class='lab' id='lab{stem[:2]}'><h2>{title}</h2>{markdown2html(aim)}"
                   f"{_card_time(time_line, f'solutions/{stem}.ipynb')}<p class='links'>{''.join(links)}</p></section>")
    nav = "<nav class='course-nav'>" + "".join(_site_links("", list(docs))) + "</nav>"
    return _page(course, nav, "\n".join(out))


def build_site(solutions: Path, labs: Path, out: Path, pattern: str = "[0-9][0-9]_*.ipynb",
               course: str = "FSDP course: sharded training, from scratch to FSDP2 and JAX",
               docs: Path | None = None, repo: str | None = None) -> list[Path]:
    """Write the site into ``out`` (emptied first); return the pages written: the index, one per solution, then
    one per ``docs/*.md`` (when ``docs`` is given). ``repo``: the address ``git clone`` takes, for the Start block."""
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter
    from nbconvert.filters import markdown2html
    paths = sorted(Path(solutions).glob(pattern))
    if not paths:
        raise FileNotFoundError(f"no notebooks match {Path(solutions) / pattern}")
    mds = sorted(Path(docs).glob("*.md"), key=lambda p: (DOC_ORDER.index(p.stem) if p.stem in DOC_ORDER
                                                         else len(DOC_ORDER), p.stem)) if docs else []
    doc_texts = [p.read_text(encoding="utf-8") for p in mds]
    doc_nav = [(p.stem, _short(_doc_title(t, p), 28)) for p, t in zip(mds, doc_texts)]
    doc_names = {p.stem for p in mds}
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
        body, _ = exporter.from_notebook_node(_static(nb, names, doc_names), resources={
            "metadata": {"name": pages[i][1]}, "course_nav": _nav(pages, i, doc_nav), "course_css": _CSS})
        page = out / "solutions" / f"{path.stem}.html"
        page.write_text(_with_toc(body), encoding="utf-8")
        lab = Path(labs) / path.name
        if lab.exists():
            shutil.copy(lab, out / "labs" / path.name)
        written.append(page)
        entries.append((path.stem, _title_html(nb), *_summary(nb), lab.exists()))
    (out / "index.html").write_text(_index(entries, course, doc_nav, repo), encoding="utf-8")
    if mds:
        (out / "docs").mkdir()
    for (stem, _label), path, text in zip(doc_nav, mds, doc_texts):
        nav = "<nav class='course-nav'>" + "".join(_site_links("../", doc_nav, current=stem)) + "</nav>"
        page = out / "docs" / f"{stem}.html"
        page.write_text(_page(_doc_title(text, path), nav, markdown2html(_link_pages(text, names, doc_names)),
                              kind="doc"), encoding="utf-8")
        written.append(page)
    return [out / "index.html", *written]


def _git_origin(root: Path) -> str | None:
    """``git remote get-url origin`` of the checkout, or None (no git, no remote)."""
    import subprocess
    try:
        done = subprocess.run(["git", "-C", str(root), "remote", "get-url", "origin"], capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def cmd_site(args) -> int:
    start = time.perf_counter()
    repo = args.repo or _git_origin(Path(args.solutions).resolve().parent)
    pages = build_site(args.solutions, args.labs, args.out, args.pattern, docs=args.docs, repo=repo)
    labs = sum(1 for p in pages if p.parent.name == "solutions")
    print(f"wrote {len(pages)} pages ({labs} labs, {len(pages) - labs - 1} docs) under {args.out} in "
          f"{time.perf_counter() - start:.1f} s; open {args.out / 'index.html'}")
    if repo is None:
        print("no repository address (no --repo, no git remote 'origin'): the Start block says to get the "
              "repository without naming its address; pass --repo URL to name it")
    return 0
