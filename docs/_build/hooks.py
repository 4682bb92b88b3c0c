"""MkDocs hooks: the Benchmarks section is generated from ``bench/results/`` at build time.

Each ``bench/results/*.md`` that ``python -m bench`` and its siblings write (``partial.md``, the
output of a partial run, excepted) becomes a page ``benchmarks/NAME.md`` with the file's text
as it is, listed under "Benchmarks" in the navigation in name order. The figures are never
copied into the manual's prose: a new run rewrites the file and the next build shows it.

The plots a run writes beside the tables (``*.png``) are not kept in the repository; a page
shows a plot when its file exists and otherwise names the file and the command that draws it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
SKIPPED = {"partial.md"}
_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+\.png)\)")


def _results() -> list[Path]:
    return sorted(path for path in RESULTS.glob("*.md") if path.name not in SKIPPED)


def _title(path: Path) -> str:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return path.stem


def _titles() -> dict[Path, str]:
    """Each result file's navigation title: its heading, with the file name where two headings are alike."""
    headings = {path: _title(path) for path in _results()}
    repeated = {title for title in headings.values() if list(headings.values()).count(title) > 1}
    return {path: f"{title} ({path.name})" if title in repeated else title for path, title in headings.items()}


def _command(path: Path) -> str:
    """The command line a result file says it came from (its first ``python -m bench...``), or ''."""
    match = re.search(r"`(python -m bench[^`]*)`", path.read_text(encoding="utf-8"))
    return match.group(1) if match else ""


def on_config(config: Any, **kwargs: Any) -> Any:
    for entry in config["nav"]:
        if isinstance(entry, dict) and "Benchmarks" in entry:
            entry["Benchmarks"].extend({title: f"benchmarks/{path.name}"} for path, title in _titles().items())
            break
    else:
        raise ValueError("mkdocs.yml has no 'Benchmarks' section for the pages of bench/results/")
    return config


def _plots(text: str) -> str:
    def plot(match: re.Match[str]) -> str:
        caption, name = match.groups()
        if (RESULTS / name).is_file():
            return match.group(0)
        return f"*Plot not in this build: `bench/results/{name}` ({caption}) is drawn by `make bench`.*"

    return _IMAGE.sub(plot, text)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """On ``benchmarks.md``, the marker ``<!-- bench-results -->`` becomes a table of the result pages."""
    if page.file.src_uri != "benchmarks.md":
        return markdown
    rows = ["| page | file | written by |", "| --- | --- | --- |"]
    rows += [f"| [{title}](benchmarks/{path.name}) | `bench/results/{path.name}` | `{_command(path)}` |"
             for path, title in _titles().items()]
    if "<!-- bench-results -->" not in markdown:
        raise ValueError("docs/benchmarks.md lacks the <!-- bench-results --> marker")
    return markdown.replace("<!-- bench-results -->", "\n".join(rows))


def on_files(files: Files, config: Any, **kwargs: Any) -> Files:
    for path in _results():
        text = _plots(path.read_text(encoding="utf-8"))
        files.append(File.generated(config, f"benchmarks/{path.name}", content=text))
        for match in _IMAGE.finditer(text):
            plot = RESULTS / match.group(2)
            files.append(File.generated(config, f"benchmarks/{plot.name}", abs_src_path=str(plot)))
    return files
