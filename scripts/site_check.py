"""Load every page of the built documentation site in headless Chromium and check what a reader sees.

    python scripts/site_check.py SITE_DIR                   # check every page; exit 1 on a problem
    python scripts/site_check.py SITE_DIR --screenshots DIR # also write home.png and attention.png

Per page, at a desktop width and at a phone width:
- the page body does not overflow horizontally (wide code blocks and tables scroll inside
  themselves, the page never scrolls sideways);
- every image has loaded (an ``<img>`` with a natural width: a broken link has none);
- every link into the site resolves: its page exists (HTTP 200 from the server below) and its
  ``#fragment``, if any, names an element of that page.

The site is served from SITE_DIR on 127.0.0.1 by a server in this process (file:// URLs would
make directory links and the search index behave differently). Needs Debian's ``chromium`` and
``chromium-driver`` and the ``selenium`` package; :func:`browser_missing` says what is absent.

And per page at 1400 px (``LEGIBLE``), what a reader can read:
- every diagram's text (each SVG ``<text>``, inline or in an ``<img>``, in every tab) renders at
  least ``MIN_TEXT_PX`` high;
- on the tutorial and example pages, no output block is cut (its text wider than its box)
  while the window has more than ``MARGIN_PX`` of unused width to the block's right;
- no copy button covers a line of a block's text.

The screenshots (the home page and the attention.napkin example page, 1280 x 900) are the ones
committed under tests/golden/site/; tests/test_site_browser.py regenerates them with ``--update-golden``.
Deliberately not here: building the site (``mkdocs build`` does), or judging how pages look.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import html.parser
import http.server
import shutil
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

WIDTHS = {"desktop": (1280, 900), "phone": (390, 844)}
LEGIBLE = (1400, 900)  # the window the legibility checks measure in
MIN_TEXT_PX = 10  # the height a diagram's label must render at, at LEGIBLE
MARGIN_PX = 48  # the page's own padding: unused width beyond this lets a block grow instead of cutting it
BLOCK_PAGES = ("tutorial/", "examples/")  # the pages of output blocks (cost tables, check, cuda --resources)
SCREENSHOTS = {"home.png": "", "attention.png": "examples/attention/"}
# Chromium on Debian, and its driver; the test skips with the reason when one is missing.
CHROMIUM = ("chromium", "chromium-browser")
DRIVER = "chromedriver"


def browser_missing() -> str | None:
    """Why the browser check cannot run here, or None."""
    if not any(shutil.which(name) for name in CHROMIUM):
        return "chromium is not installed (apt-get install chromium chromium-driver)"
    if not shutil.which(DRIVER):
        return "chromedriver is not installed (apt-get install chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install selenium)"
    return None


@dataclass
class Report:
    pages: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    images: int = 0
    links: int = 0
    # At LEGIBLE: (page, diagram, the height of its smallest text in px) and the blocks measured.
    diagrams: list[tuple[str, str, float]] = field(default_factory=list)
    blocks: int = 0


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # the check reports problems itself
        pass


@contextlib.contextmanager
def serve(site: Path):
    """The site on http://127.0.0.1:PORT/ for the duration of the block."""
    handler = functools.partial(_Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def pages_of(site: Path) -> list[str]:
    """The site's pages as paths relative to its root ('' for the home page, 'api/' ...)."""
    pages = []
    for index in sorted(site.rglob("index.html")):
        relative = index.parent.relative_to(site).as_posix()
        pages.append("" if relative == "." else relative + "/")
    return pages


class _Ids(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("id", "name") and value:
                self.ids.add(value)


class _Links:
    """Which URLs of the site exist, and the ids of each page, fetched once."""

    def __init__(self):
        self.status: dict[str, int] = {}
        self.ids: dict[str, set[str]] = {}

    def check(self, url: str) -> str | None:
        target, _, fragment = url.partition("#")
        if target not in self.status:
            try:
                with urllib.request.urlopen(target, timeout=30) as response:
                    self.status[target] = response.status
                    body = response.read()
                    if "html" in response.headers.get("Content-Type", ""):
                        parser = _Ids()
                        parser.feed(body.decode("utf-8", "replace"))
                        self.ids[target] = parser.ids
            except urllib.error.HTTPError as error:
                self.status[target] = error.code
        if self.status[target] != 200:
            return f"HTTP {self.status[target]}"
        if fragment and target in self.ids and urllib.parse.unquote(fragment) not in self.ids[target]:
            return f"no element with id {fragment!r}"
        return None


def _driver(width: int, height: int, phone: bool = False):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     f"--window-size={max(width, 800)},{height}", "--force-device-scale-factor=1",
                     # The site as it serves itself: other hosts (Material's Google Fonts) fail at
                     # once instead of each page load waiting on a network a CI machine may lack
                     # (1 s a page here), and what is measured never depends on a web font arriving.
                     "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"):
        options.add_argument(argument)
    if phone:
        # A phone's viewport, touch and overlay scrollbars (a headless window is at least 500 px wide,
        # and its desktop scrollbar would take 15 px that no phone gives up).
        options.add_experimental_option("mobileEmulation", {"deviceMetrics": {"width": width, "height": height, "pixelRatio": 1},
                                                            "userAgent": "Mozilla/5.0 (Linux; Android 14) Mobile"})
    binary = next((shutil.which(name) for name in CHROMIUM if shutil.which(name)), None)
    if binary:
        options.binary_location = binary
    return webdriver.Chrome(options=options, service=Service(shutil.which(DRIVER)))


# Measured in the page: how far the page scrolls sideways, the elements that stick out past the
# viewport's right edge (outermost first, for the message), every image's state, and every link.
_MEASURE = """
const root = document.scrollingElement || document.documentElement;
const width = document.documentElement.clientWidth;
const wide = [];
for (const element of document.body.querySelectorAll('*')) {
  const box = element.getBoundingClientRect();
  if (box.width > 0 && box.right > width + 1 && !wide.some(parent => parent.contains(element))) {
    const style = getComputedStyle(element);
    let clipped = false;
    for (let p = element.parentElement; p && p !== document.body; p = p.parentElement) {
      const overflow = getComputedStyle(p).overflowX;
      if (overflow !== 'visible') { clipped = true; break; }
    }
    if (!clipped && style.position !== 'fixed') wide.push(element);
  }
}
return {
  scroll: root.scrollWidth, width: width,
  wide: wide.slice(0, 5).map(e => e.tagName.toLowerCase() + (e.id ? '#' + e.id : '') +
        (e.className && typeof e.className === 'string' ? '.' + e.className.trim().split(/\\s+/).join('.') : '') +
        ' (' + Math.round(e.getBoundingClientRect().right) + ' px)'),
  images: Array.from(document.images).map(i => [i.currentSrc || i.src, i.complete && i.naturalWidth > 0]),
  links: Array.from(document.querySelectorAll('a[href]')).map(a => a.href),
};
"""


# Measured in the page at LEGIBLE, asynchronously (an <img> of an SVG is fetched): for every diagram
# the height of its smallest text, for every block its text and box widths, its right edge and
# whether the copy button covers a line of it. Tabs hide their other panels (display: none):
# each tab of each set is shown in turn, and everything is measured where it is visible.
_LEGIBILITY = """
const done = arguments[arguments.length - 1];
(async () => {
  const content = document.querySelector('.md-content') || document.body;
  const box = element => element.getBoundingClientRect();
  const isSvgImage = img => /\\.svg($|[?#])/.test(img.currentSrc || img.src);
  const name = element => element.getAttribute('aria-label') || element.getAttribute('alt') ||
    ((element.currentSrc || element.src || '').split('/').pop()) ||
    ((element.querySelector('title') || {}).textContent || '').trim() || element.tagName.toLowerCase();
  const smallest = (svg, label) => {
    let low = null, text = '';
    for (const element of svg.querySelectorAll('text')) {
      if (!element.textContent.trim()) continue;
      const height = box(element).height;
      if (low === null || height < low) { low = height; text = element.textContent.trim(); }
    }
    return {name: label, low, text};
  };
  // An <img>'s SVG is not in the page: the same SVG is laid out, invisible, over the image at the
  // image's size (it scales the same way), measured, and removed.
  const sources = {};
  const viaImage = async img => {
    const src = img.currentSrc || img.src;
    if (!(src in sources)) sources[src] = await (await fetch(src)).text();
    const r = box(img);
    const probe = document.createElement('div');
    probe.style.cssText = `position:absolute;visibility:hidden;left:${r.left + scrollX}px;top:${r.top + scrollY}px;` +
                          `width:${r.width}px;height:${r.height}px`;
    probe.innerHTML = sources[src];
    const svg = probe.querySelector('svg');
    if (!svg) return {name: name(img), low: null, text: ''};
    svg.setAttribute('width', '100%');
    svg.setAttribute('height', '100%');
    document.body.appendChild(probe);
    try { return smallest(svg, name(img)); } finally { probe.remove(); }
  };
  const diagrams = new Map(), blocks = new Map();
  const visit = async () => {
    for (const svg of content.querySelectorAll('svg')) {
      if (diagrams.has(svg) || !svg.querySelector('text') || box(svg).width === 0) continue;
      diagrams.set(svg, smallest(svg, name(svg.closest('[aria-label]') || svg)));
    }
    for (const img of content.querySelectorAll('img')) {
      if (diagrams.has(img) || !isSvgImage(img) || box(img).width === 0) continue;
      diagrams.set(img, await viaImage(img));
    }
    for (const code of content.querySelectorAll('pre > code')) {
      if (blocks.has(code) || box(code).width === 0) continue;
      const pre = code.parentElement, r = box(code);
      const entry = {first: (code.textContent.split('\\n')[0] || '').slice(0, 60), scroll: code.scrollWidth,
                     client: code.clientWidth, right: Math.round(box(pre).right), covered: ''};
      const button = pre.querySelector('.md-code__nav, .md-clipboard');
      if (button && box(button).width > 0) {
        // A line of text inside the block's visible box and under the button.
        const b = box(button), left = r.left + code.clientLeft, right = left + code.clientWidth;
        const range = document.createRange();
        range.selectNodeContents(code);
        for (const line of range.getClientRects()) {
          const x0 = Math.max(line.left, left, b.left), x1 = Math.min(line.right, right, b.right);
          const y0 = Math.max(line.top, b.top), y1 = Math.min(line.bottom, b.bottom);
          if (x1 - x0 > 1 && y1 - y0 > 1) { entry.covered = `${Math.round(x1 - x0)} x ${Math.round(y1 - y0)} px`; break; }
        }
      }
      blocks.set(code, entry);
    }
  };
  await visit();
  for (const set of content.querySelectorAll('.tabbed-set')) {
    const inputs = Array.from(set.querySelectorAll(':scope > input'));
    const checked = inputs.find(input => input.checked);
    for (const input of inputs) { input.checked = true; await visit(); }
    if (checked) checked.checked = true;
  }
  const unseen = Array.from(content.querySelectorAll('svg, img')).filter(element => !diagrams.has(element) &&
    (element.tagName === 'IMG' ? isSvgImage(element) : !!element.querySelector('text'))).map(name);
  done({width: document.documentElement.clientWidth, diagrams: Array.from(diagrams.values()),
        blocks: Array.from(blocks.values()), unseen});
})().catch(error => done({error: String((error && error.stack) || error)}));
"""


def check_legibility(site: Path, report: Report, base: str) -> None:
    """At LEGIBLE: diagram text heights, cut blocks and covered text, into ``report``."""
    width, height = LEGIBLE
    driver = _driver(width, height)
    driver.set_script_timeout(120)
    try:
        for page in report.pages:
            driver.get(base + page)
            driver.execute_script("return document.fonts ? document.fonts.ready : null")
            seen = driver.execute_async_script(_LEGIBILITY)
            where = f"/{page} ({width} px)"
            if "error" in seen:
                report.problems.append(f"{where}: the legibility check failed in the page: {seen['error']}")
                continue
            for diagram in seen["diagrams"]:
                low = diagram["low"]
                report.diagrams.append((page, diagram["name"], low))
                if low is not None and low < MIN_TEXT_PX - 0.05:  # 0.05: the browser's rounding of 10 px
                    report.problems.append(f"{where}: diagram {diagram['name']}: text {low:.1f} px high "
                                           f"({diagram['text'][:40]!r}), under {MIN_TEXT_PX} px")
            for name in seen["unseen"]:
                report.problems.append(f"{where}: diagram {name} was never shown, so never measured")
            for block in seen["blocks"]:
                report.blocks += 1
                unused = seen["width"] - block["right"]
                if page.startswith(BLOCK_PAGES) and block["scroll"] > block["client"] + 1 and unused > MARGIN_PX:
                    report.problems.append(f"{where}: block {block['first']!r} is cut at {block['client']} of its "
                                           f"{block['scroll']} px while {unused} px of the window to its right are unused")
                if block["covered"]:
                    report.problems.append(f"{where}: the copy button covers text of block {block['first']!r} "
                                           f"({block['covered']})")
    finally:
        driver.quit()


def check_site(site: Path, screenshots: Path | None = None) -> Report:
    """Check every page of the built site at every width; write the screenshots if asked."""
    site = Path(site)
    report = Report(pages=pages_of(site))
    if not report.pages:
        report.problems.append(f"{site}: no pages (is it a built site?)")
        return report
    links = _Links()
    with serve(site) as base:
        for label, (width, height) in WIDTHS.items():
            driver = _driver(width, height, phone=label == "phone")
            try:
                for page in report.pages:
                    driver.get(base + page)
                    driver.execute_script("return document.fonts ? document.fonts.ready : null")
                    seen = driver.execute_script(_MEASURE)
                    where = f"/{page} ({label}, {width} px)"
                    if seen["scroll"] > seen["width"] + 1:
                        report.problems.append(f"{where}: the page scrolls sideways ({seen['scroll']} px wide in "
                                               f"{seen['width']} px); too wide: {', '.join(seen['wide']) or 'unknown'}")
                    for source, loaded in seen["images"]:
                        report.images += 1
                        if not loaded:
                            report.problems.append(f"{where}: image {source} did not load")
                    if label == "desktop":  # the same links at every width: check them once
                        for url in dict.fromkeys(seen["links"]):
                            if not url.startswith(base):
                                continue
                            report.links += 1
                            if problem := links.check(url):
                                report.problems.append(f"{where}: link {url[len(base) - 1:]}: {problem}")
                    if screenshots is not None and label == "desktop":
                        for name, shown in SCREENSHOTS.items():
                            if page == shown:
                                screenshots.mkdir(parents=True, exist_ok=True)
                                driver.save_screenshot(str(screenshots / name))
            finally:
                driver.quit()
        check_legibility(site, report, base)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", type=Path, help="the built site (mkdocs build -d SITE)")
    parser.add_argument("--screenshots", type=Path, metavar="DIR", help="write home.png and attention.png here")
    args = parser.parse_args(argv)
    missing = browser_missing()
    if missing:
        print(f"cannot check the site in a browser: {missing}", file=sys.stderr)
        return 2
    report = check_site(args.site, args.screenshots)
    lows = [low for _, _, low in report.diagrams if low is not None]
    print(f"{len(report.pages)} pages at {len(WIDTHS)} widths, {report.images} images, {report.links} internal links, "
          f"{len(report.diagrams)} diagrams (smallest text {min(lows, default=0):.1f} px at {LEGIBLE[0]} px), "
          f"{report.blocks} blocks: {len(report.problems)} problem{'s' if len(report.problems) != 1 else ''}")
    for problem in report.problems:
        print(f"  {problem}")
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
