"""The static course site, built (Labs 00-02 and the docs pages, to stay quick) and opened in headless Chromium
over HTTP: every page loads, the syllabus and the prev / next / home links navigate, no link or image is broken, no
request fails, the console stays clean and no paragraph runs past ~100 characters a line. Screenshots of the index
and a solution page go to test-artifacts/site/. Those tests are skipped where /usr/bin/chromium or Playwright is
missing (``make system-deps``; never ``playwright install``).

Without a browser, the whole site (every lab) is built and read as HTML: the front door (the Start block with its
commands, the total time, the docs pages in every page's navigation) and what a solution page leaves out (progress
displays, authoring markers, unwritten predictions' wording, stray function reprs), with a table of contents on
every lab page.
"""
from __future__ import annotations

import functools
import re
import http.server
import os
import threading
from pathlib import Path
from urllib.parse import urljoin, urlparse

import pytest

from course_lib.apps.site import DOC_ORDER, WIDGET, WIDGET_NOTE, build_site

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"),            # in the site's order
              key=lambda p: (DOC_ORDER.index(p.stem) if p.stem in DOC_ORDER else 99, p.stem))
REPO = "https://example.org/fsdp-course.git"      # an address for the Start block (the checkout has no remote)
ARTIFACTS = ROOT / "test-artifacts" / "site"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
PATTERN = "0[0-2]_*.ipynb"

pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    pages = build_site(ROOT / "solutions", ROOT / "labs", out, PATTERN, docs=ROOT / "docs", repo=REPO)
    return out, pages


def _labs(pages):
    return [p for p in pages if p.parent.name == "solutions"]


def test_the_build_writes_one_page_per_solution_and_every_lab(site):
    out, pages = site
    stems = [p.stem for p in sorted((ROOT / "solutions").glob(PATTERN))]
    assert [p.name for p in pages] == ["index.html"] + [f"{s}.html" for s in stems] + [f"{d.stem}.html" for d in DOCS]
    assert sorted(p.stem for p in (out / "labs").iterdir()) == stems
    for page in _labs(pages):
        text = page.read_text(encoding="utf-8")
        assert WIDGET not in text and "<script src=" not in text and "cdn.jsdelivr" not in text
        assert "data:image/png;base64," in text and "Download the lab (.ipynb)" in text


@pytest.fixture(scope="module")
def server(site):
    out, _ = site
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass
    handler = functools.partial(Quiet, directory=str(out))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()


@pytest.mark.browser
def test_every_page_loads_links_work_and_the_console_is_clean(site, server):
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} missing: run `make system-deps` (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    out, pages = site
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 900})
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
            page.on("response", lambda r: problems.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)

            seen, todo, external = set(), [server + "index.html"], set()
            while todo:                                     # crawl everything the index reaches
                url = todo.pop(0)
                if url in seen:
                    continue
                seen.add(url)
                if url.endswith(".ipynb"):                  # a download: fetched, not rendered
                    resp = page.request.get(url)
                    assert resp.status == 200 and resp.json()["nbformat"] == 4, url
                    continue
                assert page.goto(url, wait_until="load").status == 200, url
                broken = page.evaluate("[...document.images].filter(i => !i.complete || !i.naturalWidth).length")
                assert broken == 0, f"{url}: {broken} broken image(s)"
                for href in page.eval_on_selector_all("a[href]", "as => as.map(a => a.getAttribute('href'))"):
                    target = urljoin(url, href).split("#")[0]
                    if urlparse(target).netloc != urlparse(server).netloc:
                        external.add(target)
                    elif target not in seen:
                        todo.append(target)
            labs = _labs(pages)
            assert {u.removeprefix(server) for u in seen} == {
                "index.html", *(f"solutions/{p.name}" for p in labs), *(f"labs/{p.stem}.ipynb" for p in labs),
                *(f"docs/{d.stem}.html" for d in DOCS)}
            assert all(u.startswith("https://") for u in external), external
            assert REPO in external                                    # the Start block links the repository

            for url in sorted(seen):                        # ~80 characters of prose a line, ~100 at most
                if url.endswith(".html"):
                    page.goto(url, wait_until="load")
                    widest = page.evaluate(CHARS_PER_LINE)
                    assert widest and widest[0] <= 100, f"{url}: {widest[0]:.0f} characters a line in {widest[1]!r}"

            page.goto(server + "index.html")
            page.screenshot(path=str(ARTIFACTS / "01-index.png"), full_page=True)
            page.click("text=Read the solution >> nth=1")              # syllabus -> Lab 01
            assert page.url.endswith(f"solutions/{pages[2].name}")
            page.click("nav.course-nav >> nth=0 >> a[rel=next]")       # -> Lab 02
            assert page.url.endswith(f"solutions/{pages[3].name}")
            page.wait_for_load_state("load")     # the URL changes when the navigation commits, before the page is parsed
            assert page.locator("p.course-widget").count() >= 1       # a widget without a picture says so
            page.screenshot(path=str(ARTIFACTS / "02-solution-page.png"))
            page.click("nav.course-nav >> nth=0 >> a[rel=prev]")
            assert page.url.endswith(f"solutions/{pages[2].name}")
            page.click("nav.course-nav >> nth=0 >> text=Course home")
            assert page.url.endswith("index.html")
        finally:
            browser.close()
    assert problems == []


#: the most characters per line of any paragraph or list item of prose on the page, and its start: a paragraph's
#: length over the lines it is laid out on (its text rects' distinct tops, a code span's shifted top ignored)
CHARS_PER_LINE = """() => {
  let worst = [0, ''];
  for (const el of document.querySelectorAll('.jp-RenderedMarkdown p, .jp-RenderedMarkdown li, main > p, main li')) {
    const text = el.textContent.trim();
    if (text.length < 40) continue;
    const range = document.createRange(); range.selectNodeContents(el);
    const tops = [...range.getClientRects()].map(r => r.top).sort((a, b) => a - b);
    let lines = 0, last = -1e9;
    for (const t of tops) { if (t - last > 8) { lines += 1; last = t; } }
    const per = text.length / Math.max(lines, 1);
    if (per > worst[0]) worst = [per, text.slice(0, 60)];
  }
  return worst;
}"""


@pytest.fixture(scope="module")
def whole_site(tmp_path_factory):
    """Every lab, the docs, no browser: what each page says and leaves out is read off the HTML."""
    out = tmp_path_factory.mktemp("whole_site")
    pages = build_site(ROOT / "solutions", ROOT / "labs", out, docs=ROOT / "docs", repo=REPO)
    return out, pages


def _widget_outputs():
    """(lab stem, is a progress display, its text form) for every widget output the solutions stored without a
    picture, read from the notebooks' saved widget state (independently of the site's own reading)."""
    import nbformat
    found = []
    for path in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
        for cell in nb.cells:
            for out in cell.get("outputs", []):
                data = out.get("data", {})
                if WIDGET in data and not any(k.startswith("image/") for k in data):
                    model = state[data[WIDGET]["model_id"]]
                    kids = [state[c.removeprefix("IPY_MODEL_")]["model_name"]
                            for c in model["state"].get("children", [])]
                    found.append((path.stem, any(k.endswith("ProgressModel") for k in kids), data["text/plain"]))
    return found


def test_the_index_is_a_front_door(whole_site):
    """The Start block (the repository, `make lab`, `make test`, `make doctor`, what a downloaded lab needs), the
    course's total time as the sum of the minutes the labs state, and every docs page in every page's navigation."""
    import nbformat
    out, pages = whole_site
    index = (out / "index.html").read_text(encoding="utf-8")
    start = index[index.index("id='start'"):index.index("</section>", index.index("id='start'"))]
    for needle in ("make lab", "make test", "make doctor", f"git clone {REPO}", f"href='{REPO}'",
                   "this lab needs the course's repository"):
        assert needle in start, needle
    minutes = 0
    for path in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")):
        first = nbformat.read(path, as_version=4).cells[0].source
        minutes += int(re.search(r"\*\*Time:\*\* ~(\d+) min", first)[1])
    assert f"({minutes} min: the sum" in start and f"{minutes // 60} h {minutes % 60:02d} min" in start
    assert "measured:" not in index and "bench labs" not in index       # the cards keep the authors' notes out
    assert DOCS and len(DOCS) >= 6
    for page in pages:
        nav = re.search(r"<nav class=.course-nav.>(.*?)</nav>", page.read_text(encoding="utf-8"), re.S)
        assert nav, page.name
        for doc in DOCS:
            assert f"docs/{doc.stem}.html" in nav[1], (page.name, doc.name)
        assert "index.html#start" in nav[1], page.name
    assert [p.stem for p in pages if p.parent.name == "docs"] == ["instructors", "grading", "clusters", "gpus",
                                                                  "benchmarks", "tests"]


def test_a_solution_page_leaves_out_what_only_the_notebook_needs(whole_site):
    """No progress bar or clock (not even labelled interactive), no authoring marker, no 'no prediction written',
    no stray `<function ...>` repr; a table of contents and prose held to ~85 characters a line on every lab page."""
    out, pages = whole_site
    widgets = _widget_outputs()
    assert sum(p for _, p, _ in widgets) >= 8, widgets       # the premise: the solutions store progress displays
    texts = {p.stem: p.read_text(encoding="utf-8") for p in _labs(pages)}
    everything = "\n".join(texts.values())
    note = re.sub(r"<[^>]+>", "", WIDGET_NOTE)                # nbconvert re-quotes the note's HTML
    assert everything.count(note) == sum(not p for _, p, _ in widgets)   # only the truly interactive ones say so
    for stem, progress, plain in widgets:
        if progress:
            assert plain.split("|")[0].strip() not in texts[stem], (stem, plain)
    for banned in ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN", "### HINT", "no prediction written",
                   "&lt;function ", "<function "):
        assert banned not in everything, banned
    assert "🎯" in everything and "measured" in everything    # an unwritten prediction keeps its measurement
    for stem, text in texts.items():
        toc = re.search(r"<nav class='course-toc'.*?</nav>", text, re.S)
        assert toc, stem
        anchors = re.findall(r'href="#([^"]+)"', toc[0])
        assert len(anchors) >= 5 and all(f'id="{a}"' in text for a in anchors), stem
        width = re.search(r"\.jp-RenderedMarkdown :is\(p,li[^)]*\)\{max-width:(\d+)ch\}", text)
        assert width and 60 <= int(width[1]) <= 80, stem       # ~80-90 characters of prose (the browser test measures)


def test_titles_read_as_text_and_links_are_cut_at_a_word():
    """Lab 04's title has `fully_shard` in backticks: the syllabus shows it as code, page titles and prev/next links
    as plain text, and a long title is cut at a word boundary with an ellipsis, never mid-word."""
    import nbformat

    from course_lib.apps import site as s
    nb = nbformat.read(ROOT / "solutions" / "04_fsdp2.ipynb", as_version=4)
    assert "`" not in s._title(nb) and "fully_shard" in s._title(nb)
    assert "<code>fully_shard</code>" in s._title_html(nb) and "`" not in s._title_html(nb)
    titles = [s._title(nbformat.read(p, as_version=4)) for p in sorted((ROOT / "solutions").glob("0*.ipynb"))]
    pages = [(f"{i:02d}_x", t) for i, t in enumerate(titles)]
    for i, (_, title) in enumerate(pages):
        short = s._short(title)
        assert len(short) <= 40 and "`" not in short
        if short != title:
            kept = short.removesuffix("…")
            assert title.startswith(kept) and title[len(kept)] in " ,;:—–-(", (title, short)
        nav = s._nav(pages, i)
        assert "`" not in nav


def test_static_drops_a_function_repr_and_a_bar_whose_state_was_not_saved():
    """What `interact(show)` returns (`<function show at 0x...>`) and a progress bar stored without widget state
    (its text form) are dropped; an ordinary result, a stream and a widget with a picture are kept."""
    import nbformat

    from course_lib.apps import site as s
    v4 = nbformat.v4
    bar = {WIDGET: {"model_id": "gone", "version_major": 2, "version_minor": 0},
           "text/plain": "measuring 15 steps each:  40%|████      | 2/5 [00:03<00:05, 1.7s/config]"}
    picture = {WIDGET: {"model_id": "gone2", "version_major": 2, "version_minor": 0}, "image/png": "iVBORw0KGgo=",
               "text/plain": "a widget with its picture"}
    nb = v4.new_notebook(cells=[v4.new_code_cell("widgets.interact(show)\n### BEGIN SOLUTION\nx = 1\n### END SOLUTION",
                                                 outputs=[
        v4.new_output("execute_result", data={"text/plain": "<function show at 0x7f3a2c1b9d30>"}, execution_count=1),
        v4.new_output("display_data", data=bar),
        v4.new_output("display_data", data=picture),
        v4.new_output("stream", name="stdout", text="🎯 bytes: no prediction written (set it in the cell above "
                                                   "before running); measured 768 B.\n"),
        v4.new_output("execute_result", data={"text/plain": "42"}, execution_count=2)])])
    out = s._static(nb, set()).cells[0]
    assert out.source == "widgets.interact(show)\nx = 1\n"
    assert [o.output_type for o in out.outputs] == ["display_data", "stream", "execute_result"]
    assert "image/png" in out.outputs[0].data and WIDGET not in out.outputs[0].data
    assert out.outputs[1].text == "🎯 bytes: measured 768 B.\n" and out.outputs[2].data["text/plain"] == "42"


def test_the_total_time_reads_each_labs_time_or_names_the_lab_that_states_none():
    from course_lib.apps.site import learner_minutes
    assert learner_minutes("**Time:** ~75 min (four exercises). Run untouched, ...") == 75
    assert learner_minutes("**Time:** ~1.5 h (six exercises).") == 90
    with pytest.raises(ValueError, match=r"solutions/07_x\.ipynb: its first cell states no learner time"):
        learner_minutes("Time: a while", "solutions/07_x.ipynb")
