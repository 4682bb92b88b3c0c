"""Render the built manual in a real headless Chromium and check that it shows what it should.

``make docs`` runs this after ``mkdocs build --strict`` (``.ci/run`` installs Debian's
``chromium`` first when it is missing)::

    site/ ─▶ http.server on 127.0.0.1 (a thread) ─▶ chromium --headless --dump-dom URL ─▶ checks
                                                 └▶ chromium --headless --screenshot (--shots DIR)

Checked pages: the index, the API reference and the verl guide. A page fails when Chromium
exits non-zero or times out, when its DOM lacks the theme's rendered article or the page's
title, or when it lacks any of its expected anchors (on the API reference: ``ReplayBuffer``
and its ``sample``, ``sync`` and ``close`` as rendered objects). Every Chromium run has a fresh
profile and a deadline. Exit 0 when every page passed.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_DEADLINE_S = 60.0

# page path ─▶ what its DOM must contain: the page's heading text and the ids of rendered objects.
PAGES: dict[str, tuple[str, list[str]]] = {
    "": ("What it replaces", ["Getting started"]),
    "reference/": ("API reference", ['id="buffer.ReplayBuffer"', 'id="buffer.ReplayBuffer.sample"',
                                     'id="buffer.ReplayBuffer.sync"', 'id="buffer.ReplayBuffer.close"',
                                     'id="buffer.verl.ReplayBuffer"', 'id="buffer.process.PollerProcess"']),
    "verl/": ("verl v1 guide", ["pkg://buffer.verl", "sampler_kwargs", "ReplayBufferAsync"]),
}
SHOT_NAMES = {"": "index", "reference/": "reference", "verl/": "verl"}
# The DOM of a page the theme rendered: its main article.
RENDERED_MARK = 'class="md-content__inner md-typeset"'


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    raise SystemExit("check-docs: no chromium found; install Debian's package: apt-get install -y chromium")


def _run_chromium(chromium: str, profile: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    argv = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
            f"--user-data-dir={profile}", *args]
    try:
        return subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              timeout=CHROMIUM_DEADLINE_S)
    except subprocess.TimeoutExpired as exc:
        raise SystemExit(f"check-docs: chromium gave no answer within {CHROMIUM_DEADLINE_S:.0f} s: {args}") from exc


def _check_page(chromium: str, base: str, page: str, shots: Path | None) -> list[str]:
    title, expected = PAGES[page]
    url = base + page
    with tempfile.TemporaryDirectory(prefix="check-docs-profile-") as profile:
        result = _run_chromium(chromium, Path(profile), ["--dump-dom", url])
    if result.returncode != 0:
        return [f"{url}: chromium exit code {result.returncode}: {result.stderr.strip()[-500:]}"]
    dom = result.stdout
    problems = []
    if RENDERED_MARK not in dom:
        problems.append(f"{url}: no rendered article in the DOM ({len(dom)} characters)")
    if title not in dom:
        problems.append(f"{url}: the title {title!r} is missing")
    problems += [f"{url}: {needle!r} is missing" for needle in expected if needle not in dom]
    if shots is not None:
        shot = shots / f"docs-{SHOT_NAMES[page]}.png"
        with tempfile.TemporaryDirectory(prefix="check-docs-profile-") as profile:
            result = _run_chromium(chromium, Path(profile), ["--window-size=1280,1600", "--hide-scrollbars",
                                                             f"--screenshot={shot}", url])
        if result.returncode != 0 or not shot.is_file():
            problems.append(f"{url}: no screenshot (exit code {result.returncode})")
        else:
            print(f"screenshot: {shot}")
    print(f"{'FAIL' if problems else 'ok  '} {url} ({len(dom)} characters of DOM)")
    return problems


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Serve ``site/``, render and check each page; return 0 when all passed, 1 otherwise."""
    parser = argparse.ArgumentParser(prog="check_docs.py", description=__doc__.split("\n", 1)[0])
    parser.add_argument("--site", type=Path, default=ROOT / "site", help="the built site (default: site/)")
    parser.add_argument("--shots", type=Path, help="also write docs-{index,reference,verl}.png into this directory")
    args = parser.parse_args(argv)
    if not (args.site / "index.html").is_file():
        raise SystemExit(f"check-docs: {args.site}/index.html does not exist; build first (make docs)")
    chromium = _chromium()
    handler = functools.partial(_Quiet, directory=str(args.site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="check-docs-http", daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}/"
        problems = [problem for page in PAGES for problem in _check_page(chromium, base, page, args.shots)]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    for problem in problems:
        print("check-docs:", problem, file=sys.stderr)
    print(f"check-docs: {'FAILED' if problems else 'OK'}, {len(PAGES)} pages rendered in headless Chromium")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
