"""Real-browser test of both widgets: JupyterLab 4 + headless Debian Chromium driven by Playwright.

Starts JupyterLab on a free localhost port (token auth, a temporary root dir holding
``tests/fixtures/widgets_browser.ipynb``), opens the notebook, runs every cell, asserts that both
widgets rendered their SVG, changes controls in each and asserts the view changed (the ownership widget's
"slices of" list and table follow a what-if change of strategy and world size; the traffic timeline names
every box and has time ticks). JupyterLab runs with ``make lab``'s own options (read from ``make -n lab``), and
the learner's page shows none of nbgrader's UI (menu, Create Assignment sidebar, Validate button). Screenshots go to
``test-artifacts/browser/`` (gitignored). Skipped where ``/usr/bin/chromium`` or Playwright is missing
(``make system-deps`` installs chromium; never ``playwright install``, which downloads a browser).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "widgets_browser.ipynb"
ARTIFACTS = ROOT / "test-artifacts" / "browser"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SERVER_START_S = 150    # JupyterLab's first cold start can take over a minute on a busy 2-core machine
WIDGETS_S = 150         # kernel start + course_lib.run cold start + two widget renders

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(420)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_lab_options() -> list[str]:
    """The ``--LabApp.*`` and ``--ServerApp.jpserver_extensions`` options of ``make lab`` (what a learner's JupyterLab
    runs with), from ``make -n lab``; relative paths made absolute (the test's server runs elsewhere)."""
    out = subprocess.run(["make", "-s", "-n", "lab"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    line = next(l for l in out.replace("\\\n", " ").splitlines() if "-m jupyter lab" in l)
    opts = [a for a in shlex.split(line) if a.startswith(("--LabApp.", "--ServerApp.jpserver_extensions"))]
    return [re.sub(r"^(--LabApp.app_settings_dir=)(?!/)(.*)$", lambda m: m[1] + str(ROOT / m[2]), a) for a in opts]


def _get(url: str, timeout: float = 5.0, method: str = "GET", body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


@pytest.fixture
def jupyter_server(tmp_path):
    """(base url, token) of a JupyterLab serving a temp dir with the fixture notebook; stopped after."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} missing: run `make system-deps` (apt-get install chromium)")
    pytest.importorskip("playwright.sync_api")
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy(FIXTURE, root / FIXTURE.name)
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "ws"))
    # no "get Jupyter news?" toast over the screenshots
    news = tmp_path / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text('{"fetchNews": "false", "checkForUpdates": false}')
    log = open(tmp_path / "server.log", "w")
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
           "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
           "--ServerApp.terminals_enabled=False", "--LabApp.extension_manager=readonly", *make_lab_options()]
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # CI containers run as root
        cmd.append("--allow-root")
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {proc.returncode}:\n{(tmp_path / 'server.log').read_text()}")
            try:
                _get(f"{base}/api/status?token={token}")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"jupyter lab did not answer in {SERVER_START_S} s:\n"
                                       f"{(tmp_path / 'server.log').read_text()}")
                time.sleep(0.5)
        # start the notebook's kernel through the REST API: the page attaches to it (no kernel dialog)
        _get(f"{base}/api/sessions?token={token}", timeout=60, method="POST",
             body={"path": FIXTURE.name, "name": FIXTURE.name, "type": "notebook", "kernel": {"name": "python3"}})
        yield base, token, tmp_path
    finally:
        try:  # shut kernels down through the server first: they run in their own sessions
            for k in _get(f"{base}/api/kernels?token={token}") or []:
                _get(f"{base}/api/kernels/{k['id']}?token={token}", timeout=30, method="DELETE")
        except Exception:
            pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        log.close()
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / "server.log", ARTIFACTS / "jupyter-server.log")


def _wait_for_idle_kernel(page, timeout_s: float = WIDGETS_S):
    """Until the status bar says the notebook's kernel is idle. The fixture started the kernel through the
    REST API, so Lab attaches to it; should Lab still ask which kernel to use, accept its choice."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dialog = page.locator(".jp-Dialog .jp-mod-accept")
        if dialog.count():
            dialog.first.click()
        if page.locator(".jp-StatusBar-Item", has_text=re.compile(r"\|\s*Idle")).count():
            return
        page.wait_for_timeout(500)
    raise TimeoutError(f"the notebook's kernel was not idle within {timeout_s} s")


def _select(page, widget: str, label: str, option_label: str):
    """Pick ``option_label`` in the ipywidgets Dropdown described ``label`` inside ``widget``."""
    page.locator(f"{widget} .widget-dropdown:has(label:text-is('{label}')) select").select_option(label=option_label)


def test_widgets_render_and_react_in_jupyterlab(jupyter_server):
    from playwright.sync_api import sync_playwright
    base, token, tmp_path = jupyter_server
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp_path / "chromium-profile"), executable_path=CHROMIUM,
                                                   headless=True, args=CHROMIUM_ARGS,
                                                   viewport={"width": 1024, "height": 1000})
        try:
            page = ctx.new_page()
            page.set_default_timeout(WIDGETS_S * 1000)
            page.goto(f"{base}/lab/tree/{FIXTURE.name}?token={token}", wait_until="domcontentloaded")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=SERVER_START_S * 1000)
            _wait_for_idle_kernel(page)
            # `make lab` is the learner's JupyterLab: none of the instructor's nbgrader UI, no nbgrader server
            # extension answering or logging ("No nbgrader_config.py"), and nbgrader's lab extension disabled
            menus = page.locator(".lm-MenuBar-itemLabel").all_inner_texts()
            assert "Run" in menus and not any("grader" in m.lower() for m in menus), menus
            shown = page.locator("body").inner_text()
            for ui in ("Create Assignment", "Validate", "Formgrader", "Assignment List", "Course List", "nbgrader"):
                assert ui.lower() not in shown.lower(), f"{ui!r} shown to the learner"
            config = json.loads(page.locator("#jupyter-config-data").text_content())
            assert "@jupyter/nbgrader" in config["disabledExtensions"], config["disabledExtensions"]
            with pytest.raises(urllib.error.HTTPError, match="404"):
                _get(f"{base}/formgrader?token={token}")
            assert "nbgrader" not in (tmp_path / "server.log").read_text().lower()
            page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).first.click()
            page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).first.click()

            own, traf = ".ownership-widget", ".traffic-widget"
            page.wait_for_selector(f"{own} svg.ownership-bars g.slice")
            page.wait_for_selector(f"{traf} svg.traffic-timeline g.collective")
            page.locator(own).scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / "01-ownership-fsdp-4.png"), full_page=True)
            page.locator(own).screenshot(path=str(ARTIFACTS / "01-ownership-widget.png"))

            # ownership: 4 params x 4 ranks, real + padding stretches, rank colours from the palette
            title = page.locator(f"{own} .ownership-title").inner_text()
            assert "fsdp" in title and "4 ranks" in title, title
            n_before = page.locator(f"{own} svg.ownership-bars g.slice").count()
            fills = set(page.locator(f"{own} svg.ownership-bars g.slice rect[fill^='#']").evaluate_all(
                "els => els.map(e => e.getAttribute('fill'))"))
            from course_lib.widgets import rank_color
            assert {rank_color(r) for r in range(4)} <= fills, fills
            assert page.locator(f"{own} svg.memory-bars rect.mem-params").count() == 4

            # change a control: strategy -> hsdp (2 x 2 mesh); the view must redraw
            _select(page, own, "strategy", "hsdp")
            page.wait_for_function(
                "() => document.querySelector('.ownership-widget .ownership-title').innerText.includes('hsdp')")
            title2 = page.locator(f"{own} .ownership-title").inner_text()
            assert "(2, 2)" in title2, title2
            n_after = page.locator(f"{own} svg.ownership-bars g.slice").count()
            assert n_after != n_before, (n_before, n_after)
            # HSDP: every slice has two owners (its replicate pair), drawn as two stripes
            owners = page.locator(f"{own} svg.ownership-bars g.slice").first.get_attribute("data-owners")
            assert owners == "0,2", owners
            hover = page.locator(f"{own} svg.ownership-bars g.slice title").first.text_content()
            assert hover.startswith("wte: ranks 0,2 hold [0:48) = [0:6, 0:8] of (11, 8)"), hover
            page.locator(own).screenshot(path=str(ARTIFACTS / "02-ownership-hsdp-2x2.png"))

            # the "slices of" list and its table follow each what-if change (never a stale table)
            table_rows = f"{own} table.slice-table tr"
            first_owners = page.locator(table_rows).nth(1).locator("td").first.inner_text()
            assert first_owners.replace(" ", "") == "0,2", first_owners      # HSDP: a replicate pair per slice
            _select(page, own, "strategy", "zero2")                            # flat units replace the tensors
            page.wait_for_function(
                "() => [...document.querySelectorAll('.ownership-widget .widget-dropdown select')].some("
                "s => [...s.options].map(o => o.text).join() === 'unit0')")
            sliced = page.locator(f"{own} .widget-dropdown:has(label:text-is('slices of')) select")
            assert sliced.evaluate("s => [...s.options].map(o => o.text)") == ["unit0"]
            # the options and the table are two updates: the table may be drawn a moment after the options
            page.wait_for_function(
                "() => document.querySelectorAll('.ownership-widget table.slice-table tr').length === 5")
            assert page.locator(table_rows).count() == 1 + 4                  # header + one slice per rank
            assert "wte[0:" in page.locator(f"{own} table.slice-table").inner_text()
            readout = page.locator(f"{own} .widget-slider:has(label:text-is('world size')) .widget-readout")
            readout.fill("3")
            readout.press("Enter")
            page.wait_for_function(
                "() => document.querySelectorAll('.ownership-widget table.slice-table tr').length === 4")
            assert "3 ranks" in page.locator(f"{own} .ownership-title").inner_text()
            owners = page.locator(table_rows).evaluate_all("rs => rs.slice(1).map(r => r.cells[0].innerText.trim())")
            assert owners == ["0", "1", "2"], owners
            page.locator(own).screenshot(path=str(ARTIFACTS / "02b-ownership-zero2-3-table.png"))

            # traffic: 12 collectives (2 ranks x 2 steps x 3 ops); step 1 alone shows 6
            page.locator(traf).scroll_into_view_if_needed()
            page.locator(traf).screenshot(path=str(ARTIFACTS / "03-traffic-all-steps.png"))
            assert page.locator(f"{traf} g.collective").count() == 12
            # every box named (short reduce-scatters too), ticks in ms, one collective number everywhere
            assert page.locator(f"{traf} g.collective text.op-label").count() == 12
            ticks = page.locator(f"{traf} text.tick-label").all_text_contents()   # SVG: no innerText
            assert len(ticks) >= 2 and float(ticks[0]) >= 0 and ticks[-1].endswith(" ms"), ticks
            assert "collective 1 of 12" in page.locator(f"{traf} .traffic-detail").inner_text()
            assert "None" not in page.locator(traf).inner_text()
            assert "1.000" in page.locator(f"{traf} table.traffic-compare").inner_text()
            _select(page, traf, "step", "step 1")
            page.wait_for_function("() => document.querySelectorAll('.traffic-widget g.collective').length === 6")
            assert page.locator(f"{traf} g.collective[data-rank='1']").count() == 3
            page.wait_for_function("() => document.querySelector('.traffic-widget .traffic-detail')"
                                   ".innerText.includes('collective 1 of 6')")
            page.locator(traf).screenshot(path=str(ARTIFACTS / "04-traffic-step-1.png"))
            page.screenshot(path=str(ARTIFACTS / "05-notebook-after.png"), full_page=True)
        except Exception:
            try:
                page.screenshot(path=str(ARTIFACTS / "failure.png"), full_page=True)
            except Exception:
                pass
            raise
        finally:
            ctx.close()
