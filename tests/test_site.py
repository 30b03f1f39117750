"""The static course site, built (Labs 00-02, to stay quick) and opened in headless Chromium over HTTP: every
page loads, the syllabus and the prev / next / home links navigate, no link or image is broken, no request
fails and the console stays clean. Screenshots of the index and a solution page go to test-artifacts/site/.
Skipped where /usr/bin/chromium or Playwright is missing (``make system-deps``; never ``playwright install``).
"""
from __future__ import annotations

import functools
import http.server
import os
import threading
from pathlib import Path
from urllib.parse import urljoin, urlparse

import pytest

from course_lib.apps.site import WIDGET, build_site

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts" / "site"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
PATTERN = "0[0-2]_*.ipynb"

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    pages = build_site(ROOT / "solutions", ROOT / "labs", out, PATTERN)
    return out, pages


def test_the_build_writes_one_page_per_solution_and_every_lab(site):
    out, pages = site
    stems = [p.stem for p in sorted((ROOT / "solutions").glob(PATTERN))]
    assert [p.name for p in pages] == ["index.html"] + [f"{s}.html" for s in stems]
    assert sorted(p.stem for p in (out / "labs").iterdir()) == stems
    for page in pages[1:]:
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
            assert {u.removeprefix(server) for u in seen} == {
                "index.html", *(f"solutions/{p.name}" for p in pages[1:]), *(f"labs/{p.stem}.ipynb" for p in pages[1:])}
            assert all(u.startswith("https://") for u in external), external

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
