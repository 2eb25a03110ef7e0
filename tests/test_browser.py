"""Lessons in JupyterLab in a real browser (headless Chromium driven by Playwright).

Skipped where Chromium or Playwright is missing: `apt-get install chromium` and
`pip install playwright` (the browser itself comes from Debian; nothing is downloaded at run time;
`.ci/run` installs it). Screenshots go to each test's tmp_path, never into the repository.
"""

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHROMIUM = os.environ.get("PIPELAB_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright for browser tests")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium: apt-get install chromium")

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def jupyterlab(tmp_path_factory):
    """A JupyterLab server on localhost serving a copy of the notebooks."""
    root = tmp_path_factory.mktemp("lab")
    for name in os.listdir(os.path.join(ROOT, "notebooks")):
        if name.endswith(".ipynb"):
            shutil.copy(os.path.join(ROOT, "notebooks", name), root / name)
    port = _free_port()
    jupyter = os.path.join(os.path.dirname(sys.executable), "jupyter")
    server = subprocess.Popen(
        [jupyter, "lab", "--no-browser", "--allow-root", f"--port={port}", "--ServerApp.ip=127.0.0.1",
         "--IdentityProvider.token=", "--ServerApp.password=", "--LabApp.expose_app_in_browser=True",
         f"--ServerApp.root_dir={root}", f"--LabApp.workspaces_dir={root / 'workspaces'}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status", timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                pytest.fail("JupyterLab did not start")
            time.sleep(0.5)
    yield url
    server.terminate()
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()


@pytest.fixture()
def page():
    """A fresh headless Chromium page."""
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        yield page
        browser.close()


def run_all_cells(page, url: str, notebook: str, shots, timeout_s: float = 180, until=None,
                  through: str | None = None) -> None:
    """Open a notebook in JupyterLab, run every cell (or, with `through`, the cells up to the last
    one whose source contains it), wait until the headline is shown (or the locator `until(page)`
    is attached, and the kernel is idle again)."""
    page.goto(f"{url}/lab/tree/{notebook}?reset")  # ?reset: a fresh workspace, only this notebook open
    page.wait_for_function("window.jupyterapp !== undefined", timeout=60_000)
    page.wait_for_function("([name]) => window.jupyterapp.shell.currentWidget?.context?.path === name",
                           arg=[notebook], timeout=60_000)
    # Run only once the notebook's kernel is connected and idle, or the command does nothing.
    page.wait_for_function(
        "window.jupyterapp.shell.currentWidget?.sessionContext?.session?.kernel?.status === 'idle'",
        timeout=60_000)
    if through is None:
        page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
    else:  # select the cell after it, then "Run All Above Selected Cell"
        found = page.evaluate("""([text]) => {
            const notebook = window.jupyterapp.shell.currentWidget.content;
            const sources = notebook.widgets.map(cell => cell.model.sharedModel.getSource());
            const last = sources.map(s => s.includes(text)).lastIndexOf(true);
            if (last < 0 || last + 1 >= sources.length) return false;
            notebook.activeCellIndex = last + 1;
            window.jupyterapp.commands.execute('notebook:run-all-above');
            return true;
        }""", [through])
        assert found, f"{notebook} has no cell with {through!r} followed by another cell"
    try:
        if until is None:
            page.get_by_text("Headline:").wait_for(state="attached", timeout=timeout_s * 1000)
        else:
            until(page).wait_for(state="attached", timeout=timeout_s * 1000)
            page.wait_for_function(
                "window.jupyterapp.shell.currentWidget?.sessionContext?.session?.kernel?.status === 'idle'",
                timeout=timeout_s * 1000)
    except Exception:
        shot = shots / f"failed-{notebook}.png"
        page.screenshot(path=str(shot))
        print(f"screenshot of the failed run: {shot}")
        raise


def _image_sources(locator) -> list[str]:
    return [locator.nth(i).get_attribute("src") for i in range(locator.count())]


def _wait_for_new_image(page, box, before: str) -> None:
    """Wait until the widget box shows an image whose source differs from `before`."""
    page.wait_for_function(
        "([el, before]) => { const img = el.querySelector('img'); return img && img.src !== before; }",
        arg=[box.element_handle(), before], timeout=60_000)


def test_lesson_00_runs_in_jupyterlab(jupyterlab, page, tmp_path):
    run_all_cells(page, jupyterlab, "00_workers_and_timelines.ipynb", tmp_path)
    assert page.locator(".jp-OutputArea-output img").count() >= 3  # sweep, Gantt, utilization
    assert page.get_by_text("sum of ranks = 1").count() >= 1
    page.screenshot(path=str(tmp_path / "lesson00-jupyterlab.png"))


def test_split_size_slider_redraws_when_moved_with_the_keyboard(jupyterlab, page, tmp_path):
    """Lesson 03's explorer: focus the split-size slider, press an arrow key; its label shows the
    next split size and the pipelined forward re-runs, so the timeline image changes.

    It runs the lesson up to the explorer and waits for it, not the headline: the rest of the lesson
    after it is tests/test_notebooks.py's to check. Each move re-runs three timed rounds."""
    def explorers(p):
        return p.locator(".widget-vbox").filter(has=p.locator(".widget-hslider"))

    run_all_cells(page, jupyterlab, "03_split_pipelining.ipynb", tmp_path, until=lambda p: explorers(p).first,
                  through="widgets.split_size_explorer(")
    explorer = explorers(page).last
    explorer.scroll_into_view_if_needed()
    image, label = explorer.locator("img"), explorer.locator(".widget-readout").first
    handle = explorer.locator(".noUi-handle").first
    image.first.wait_for(state="visible", timeout=60_000)
    before_label, before_image = label.inner_text(), image.first.get_attribute("src")
    # The slider starts at the best split; from the largest one there is no "right", so go left.
    at_end = handle.get_attribute("aria-valuenow") == handle.get_attribute("aria-valuemax")
    handle.focus()
    page.keyboard.press("ArrowLeft" if at_end else "ArrowRight")
    page.wait_for_function("([el, before]) => el.innerText !== before",
                           arg=[label.element_handle(), before_label], timeout=10_000)
    _wait_for_new_image(page, explorer, before_image)
    after_label = label.inner_text()
    assert after_label != before_label and after_label.strip().isdigit()
    assert image.first.get_attribute("src") != before_image
    page.screenshot(path=str(tmp_path / "lesson03-split-size-slider.png"))


def test_schedule_explorer_redraws_when_the_schedule_changes(jupyterlab, page, tmp_path):
    """Lesson 07's explorer is a live ipywidget: picking another schedule redraws the timeline.

    The lesson runs up to the explorer (the rest, torch's engine and the exercises, is
    tests/test_notebooks.py's to check), so the kernel is free to answer the widget."""
    def explorers(p):
        return p.locator(".widget-vbox").filter(has=p.locator("select"))

    run_all_cells(page, jupyterlab, "07_schedules_1f1b_interleaved_zero_bubble.ipynb", tmp_path, timeout_s=300,
                  until=lambda p: explorers(p).first, through="widgets.schedule_explorer(")
    explorer = explorers(page).last
    explorer.scroll_into_view_if_needed()
    image = explorer.locator("img")
    image.first.wait_for(state="visible", timeout=60_000)
    before = _image_sources(image)
    explorer.locator("select").first.select_option("gpipe")
    _wait_for_new_image(page, explorer, before[0])
    assert _image_sources(image) != before
    page.screenshot(path=str(tmp_path / "lesson07-schedule-explorer.png"))
