"""Tables, goals and plots: what a benchmark returns and how it is shown."""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .intervals import Estimate


@dataclass
class Goal:
    """One goal of the table, checked against the measured value."""

    text: str
    value: float
    limit: float
    higher_is_better: bool = False
    interval: tuple[float, float] | None = None  # the value's 95% interval, printed beside it
    # A goal that is not "value against limit" (intervals that must overlap, say): its verdict and what it saw.
    verdict: bool | None = None
    detail: str | None = None

    @classmethod
    def estimated(cls, text: str, estimate: Estimate, limit: float) -> Goal:
        """A goal on an estimate with an interval (:mod:`bench.intervals`), decided by its value."""
        return cls(text, estimate.value, limit, interval=(estimate.low, estimate.high))

    @property
    def met(self) -> bool:
        if self.verdict is not None:
            return self.verdict
        return self.value >= self.limit if self.higher_is_better else self.value <= self.limit

    def render(self) -> str:
        if self.detail is not None:
            return f"{'met' if self.met else 'MISSED'}: {self.text} ({self.detail})"
        spread = f", 95% interval {self.interval[0]:.3g}–{self.interval[1]:.3g}" if self.interval else ""
        return (f"{'met' if self.met else 'MISSED'}: {self.text} (measured {self.value:.3g}{spread}, "
                f"goal {'≥' if self.higher_is_better else '≤'} {self.limit:.3g})")


@dataclass
class Table:
    number: str
    title: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    goals: list[Goal] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plot: Callable[[str], None] | None = None  # writes a PNG to the given path

    def add(self, *row: Any) -> None:
        self.rows.append([_cell(x) for x in row])

    def text(self) -> str:
        cells = [self.columns] + self.rows
        widths = [max(len(str(r[i])) for r in cells) for i in range(len(self.columns))]
        lines = [f"#{self.number} {self.title}"]
        for j, row in enumerate(cells):
            lines.append("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                                   for i, (c, w) in enumerate(zip(row, widths))))
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines += [f"  {g.render()}" for g in self.goals] + [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def markdown(self, plot_name: str | None) -> str:
        lines = [f"### {self.number}. {self.title}", "", "| " + " | ".join(self.columns) + " |",
                 "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in self.rows]
        lines.append("")
        lines += [f"- {g.render()}" for g in self.goals] + [f"- {n}" for n in self.notes]
        if plot_name:
            lines += ["", f"![{self.title}]({plot_name})"]
        return "\n".join(lines) + "\n"


def _cell(x: Any) -> Any:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"
    return x


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


class LoadMonitor:
    """The machine's load while the run goes: 1-minute averages sampled at every benchmark and progress line."""

    def __init__(self) -> None:
        self.samples: list[tuple[str, float]] = []

    def sample(self, label: str) -> float:
        load = os.getloadavg()[0]
        self.samples.append((label, load))
        return load

    def summary(self) -> str:
        loads = [v for _, v in self.samples]
        return (f"load average (1 min) {min(loads):.2f}–{max(loads):.2f} during the run "
                f"on {os.cpu_count()} cores" if loads else "")


def write_markdown(path: str, tables: list[Table], header: list[str]) -> None:
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    parts = ["# Benchmark results", "", *header, ""]
    for table in tables:
        plot_name = None
        if table.plot is not None:
            plot_name = f"{table.number}-{table.title.split(':')[0].lower().replace(' ', '-')[:40]}.png"
            try:
                table.plot(os.path.join(directory, plot_name))
            except ImportError:
                plot_name = None
                table.notes.append("plot skipped: matplotlib is not installed (pip install -e '.[bench]')")
        parts.append(table.markdown(plot_name))
    with open(path, "w") as f:
        f.write("\n".join(parts))


def environment_lines(quick: bool, elapsed: float, load: LoadMonitor, only: str | None = None) -> list[str]:
    import msgpack
    import zmq

    return [
        f"- command: `python -m bench{' --quick' if quick else ''}{f' --only {only}' if only else ''}`, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{elapsed:.0f} s",
        f"- Python {platform.python_version()}, pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()}), "
        f"msgpack {'.'.join(map(str, msgpack.version))}, {platform.machine()}",
        f"- {load.summary()}; every ratio compares figures measured in this run, medians of repetitions",
    ]


def line_plot(path: str, title: str, xlabel: str, ylabel: str, series: dict[str, tuple[list[float], list[float]]],
              logx: bool = True, logy: bool = True) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
