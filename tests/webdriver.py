"""Headless Chromium for tests, driven through Debian's `chromedriver` over the W3C WebDriver protocol
(JSON over HTTP, so the standard library is enough: no selenium). `make test`'s setup installs
Debian's `chromium` and `chromium-driver`."""
from __future__ import annotations

import base64
import contextlib
import io
import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from PIL import Image

from conftest import free_port

ELEMENT = "element-6066-11e4-a52e-4f735466cecf"  # the W3C WebDriver key of an element reference

# What a test asserts on: the page heading; the runs table's header cells (ag-grid) by column id, with
# where each is on screen (left, right) and the right edge of the table's scrolled part; the first row's
# pinned cells (its run name); and the page text.
PAGE_FACTS_JS = """
const headers = [...document.querySelectorAll('.ag-header-cell[col-id]')];
const table = document.querySelector('.ag-center-cols-viewport');
return {heading: (document.querySelector('h2') || {}).innerText || null,
        columns: headers.map(h => h.getAttribute('col-id')),
        boxes: Object.fromEntries(headers.map(h => [h.getAttribute('col-id'),
                                                    [h.getBoundingClientRect().left, h.getBoundingClientRect().right]])),
        table_right: table ? Math.min(table.getBoundingClientRect().right, window.innerWidth) : null,
        first_row: (document.querySelector('.ag-pinned-left-cols-container .ag-row[row-index="0"]') || {}).innerText || null,
        column_groups: [...document.querySelectorAll('.ag-header-group-cell')].map(h => h.innerText.trim()),
        text: document.body.innerText};
"""

# Each drawn "<knob> vs. <metric>" chart (Plotly, in MLflow's chart cards): its card's title, its plot element,
# its plot area [left, top, right, bottom], its points' marker boxes, and its toolbar's box (Plotly's modebar,
# which it fades in over the plot on hover) with whether it is shown (opaque), in screen coordinates.
SCATTER_CHARTS_JS = """
const box = element => { const r = element.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
const title = plot => {
  for (let node = plot.parentElement; node; node = node.parentElement)
    if (node.innerText && node.innerText.includes(' vs. ')) return node.innerText.split('\\n')[0];
  return '';
};
return [...document.querySelectorAll('.js-plotly-plot')]
  .map(plot => ({title: title(plot), plot: plot, area: box(plot.querySelector('.nsewdrag')),
                 markers: [...plot.querySelectorAll('.scatterlayer path.point')].map(box),
                 toolbar: plot.querySelector('.modebar') ? box(plot.querySelector('.modebar')) : null,
                 toolbar_shown: [...plot.querySelectorAll('.modebar-group')].some(
                   group => getComputedStyle(group).opacity === '1')}))
  .filter(chart => chart.title.includes(' vs. ') && chart.markers.length);
"""


def browser_binaries() -> tuple[str, str]:
    """Chromium and its chromedriver; an error naming the packages when either is missing."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        raise RuntimeError("the browser check needs Debian's `chromium` and `chromium-driver` "
                           "(`make test` installs them; or `apt-get install chromium chromium-driver`)")
    return chromium, driver


class Browser:
    """One headless Chromium session: open pages, wait for text, read facts, save screenshots."""

    def __init__(self, width: int = 1400, height: int = 900):
        chromium, driver = browser_binaries()
        self.width, self.height = width, height
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        self.driver = subprocess.Popen([driver, f"--port={port}"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
        self.session = None
        try:
            self._wait_for_driver()
            options = {"binary": chromium,
                       "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                                "--hide-scrollbars", f"--window-size={width},{height}"]}
            caps = {"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": options}}}
            self.session = self._call("POST", "/session", caps)["sessionId"]
            self._resize(width, height)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            if self.session:
                self._call("DELETE", f"/session/{self.session}")
        finally:
            self.driver.terminate()
            self.driver.wait(timeout=30)

    def _wait_for_driver(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._call("GET", "/status")
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def _resize(self, width: int, height: int) -> None:
        """Make the viewport (what a screenshot holds) ``width`` x ``height``: the window adds its frame."""
        window = self._session("GET", "/window/rect")
        inner_width, inner_height = self.script("return [window.innerWidth, window.innerHeight]")
        self._session("POST", "/window/rect", {"width": width + window["width"] - inner_width,
                                               "height": height + window["height"] - inner_height})

    def _call(self, method: str, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return json.loads(response.read())["value"]
        except urllib.error.HTTPError as err:
            raise RuntimeError(f"WebDriver {method} {path}: {err.read().decode()[:500]}") from None

    def _session(self, method: str, path: str, body: dict | None = None):
        return self._call(method, f"/session/{self.session}{path}", body)

    def script(self, js: str, *args):
        return self._session("POST", "/execute/sync", {"script": js, "args": list(args)})

    def open(self, url: str) -> None:
        self._session("POST", "/url", {"url": url})

    def wait_for_text(self, *texts: str, timeout: float = 90.0) -> None:
        deadline, previous = time.monotonic() + timeout, None
        while True:
            body = self.script("return document.body ? document.body.innerText : ''")
            missing = [text for text in texts if text not in body]
            if not missing and body == previous:  # shown, and the cells and charts have filled in
                return
            previous = body
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page never showed {missing!r}; it shows: {body[:800]!r}")
            time.sleep(0.5)

    def element_by_xpath(self, xpath: str) -> dict:
        """The first element matching ``xpath`` (a reference to pass to ``script`` or ``hover``)."""
        return self._session("POST", "/element", {"using": "xpath", "value": xpath})

    def hover(self, element: dict, css: str = "") -> None:
        """The pointer moved, as a user's mouse, onto the centre of ``element`` (of its first descendant
        matching ``css`` if given)."""
        if css:
            element = self._session("POST", f"/element/{element[ELEMENT]}/element", {"using": "css selector", "value": css})
        move = {"type": "pointerMove", "origin": element, "x": 0, "y": 0, "duration": 50}
        self._session("POST", "/actions", {"actions": [{"type": "pointer", "id": "mouse", "parameters": {
            "pointerType": "mouse"}, "actions": [move]}]})

    def scroll_to(self, element: dict, below_top: float = 0) -> None:
        """Scrolls ``element``'s scrolling ancestor (a pane of its own, which ``scrollIntoView`` may leave
        short) until the element's top is ``below_top`` px below that ancestor's top (negative: above it)."""
        self.script("""
const [element, offset] = arguments;
for (let node = element.parentElement; node; node = node.parentElement)
  if (/auto|scroll/.test(getComputedStyle(node).overflowY) && node.scrollHeight > node.clientHeight) {
    node.scrollTop += element.getBoundingClientRect().top - node.getBoundingClientRect().top - offset;
    return;
  }
element.scrollIntoView({block: 'start'});
""", element, below_top)

    def click(self, css: str) -> None:
        """A real click (pointer events, as a user's) on the first element matching ``css``."""
        element = self._session("POST", "/element", {"using": "css selector", "value": css})
        self._session("POST", f"/element/{element[ELEMENT]}/click", {})

    def in_frame(self, css: str, js: str):
        """``js`` run in the page inside the frame matching ``css`` (its own document, e.g. a sandboxed one)."""
        frame = self._session("POST", "/element", {"using": "css selector", "value": css})
        self._session("POST", "/frame", {"id": frame})
        try:
            return self.script(js)
        finally:
            self._session("POST", "/frame/parent", {})

    def facts(self, every_column: bool = False) -> dict:
        """The heading, runs-table column ids and group headers, and the page text. ``every_column``
        widens the window first: ag-grid renders only the columns in view."""
        if every_column:
            self._resize(6000, self.height)
            time.sleep(1.5)
        facts = self.script(PAGE_FACTS_JS)
        if every_column:
            self._resize(self.width, self.height)
        return facts

    @contextlib.contextmanager
    def sized(self, width: int, height: int) -> Iterator[None]:
        """The viewport ``width`` x ``height`` for the block (a smaller screen than the session's)."""
        self._resize(width, height)  # shrinking: every box is read where it is drawn now
        try:
            yield
        finally:
            self._resize(self.width, self.height)

    def screenshot(self, path: Path) -> Path:
        """The viewport as a PNG reduced to a 256-colour palette (UI screenshots stay legible and small)."""
        image = Image.open(io.BytesIO(base64.b64decode(self._session("GET", "/screenshot")))).convert("RGB")
        path.parent.mkdir(parents=True, exist_ok=True)
        image.quantize(colors=256).save(path, optimize=True)
        return path
