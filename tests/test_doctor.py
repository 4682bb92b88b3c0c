"""``python -m poller doctor`` against a real second distribution that also installs a top-level ``buffer``.

A temporary virtual environment gets this distribution's wheel (built from a copy of the source
tree, offline), then a tiny wheel built here whose only package is ``buffer``: installed after ours
it overwrites ``buffer/__init__.py``, as the clashing distribution on the public index does.
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLASH = "buffer-clash"


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_clashing_wheel(directory: Path) -> Path:
    """A wheel of another distribution, ``buffer-clash``, that installs a top-level ``buffer`` package."""
    dist_info = "buffer_clash-1.0.dist-info"
    files = {
        "buffer/__init__.py": b'"""Another project\'s buffer package: a ring buffer."""\n\nCAPACITY = 16\n',
        "buffer/ring.py": b"def push(item):\n    return item\n",
        f"{dist_info}/METADATA": b"Metadata-Version: 2.1\nName: buffer-clash\nVersion: 1.0\n",
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{dist_info}/top_level.txt": b"buffer\n",
    }
    record = [_record_line(name, data) for name, data in files.items()] + [f"{dist_info}/RECORD,,"]
    path = directory / "buffer_clash-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")
    return path


def _run(argv: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180)
    if check:
        assert result.returncode == 0, f"{argv}:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    work = tmp_path_factory.mktemp("doctor-wheels")
    source = work / "source"
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        shutil.copy(ROOT / name, source / name)
    for package in ("poller", "buffer"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    out = work / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index", "--no-build-isolation",
          "--wheel-dir", str(out), str(source)], cwd=work)
    ours, = out.glob("zmq_replay_poller-*.whl")
    yield {"ours": ours, "clash": build_clashing_wheel(work)}


class Venv:
    """A fresh virtual environment; pyzmq and msgpack come from the test's own environment."""

    def __init__(self, path: Path) -> None:
        self.path = path
        _run([sys.executable, "-m", "venv", "--without-pip", str(path)], cwd=path.parent)
        self.python = path / "bin" / "python"

    def pip(self, *args: str) -> None:
        offline = ["--no-index"] if args[0] == "install" else []  # the wheels are files: no index, no network
        _run([sys.executable, "-m", "pip", "--python", str(self.python), *args, "--quiet", *offline], cwd=self.path)

    def borrow_dependencies(self) -> None:
        # After the installs, so pip never sees the test environment's own copy of this distribution.
        site = Path(_run([str(self.python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         cwd=self.path).stdout.strip())
        (site / "borrowed.pth").write_text(sysconfig.get_path("purelib") + "\n")

    def run(self, code: str) -> subprocess.CompletedProcess[str]:
        return _run([str(self.python), "-c", code], cwd=self.path, check=False)

    def doctor(self) -> subprocess.CompletedProcess[str]:
        return _run([str(self.python), "-m", "poller", "doctor"], cwd=self.path, check=False)


def test_doctor_passes_on_a_clean_install_and_explains_a_clash_and_its_fix(tmp_path: Path,
                                                                           wheels: dict[str, Path]) -> None:
    venv = Venv(tmp_path / "venv")
    venv.pip("install", "--no-deps", str(wheels["ours"]))
    venv.borrow_dependencies()
    clean = venv.doctor()
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "ok: buffer from " in clean.stdout and "files match the install record" in clean.stdout
    assert venv.run("from buffer import ReplayBuffer").returncode == 0

    # The clash: installed after ours, pip overwrites buffer/__init__.py without a word.
    venv.pip("install", "--no-deps", str(wheels["clash"]))
    broken = venv.run("from buffer import ReplayBuffer")
    assert broken.returncode != 0 and "ImportError" in broken.stderr  # what users hit
    diagnosis = venv.doctor()
    assert diagnosis.returncode == 1, diagnosis.stdout + diagnosis.stderr
    report = diagnosis.stderr
    assert "problem: buffer in " in report and "buffer/__init__.py was changed" in report, report
    assert "buffer/ring.py is not one of zmq-replay-poller's files" in report, report
    assert f"installed by another distribution as well: {CLASH}" in report, report
    assert f"fix: pip uninstall {CLASH}" in report, report
    # The wheel it was installed from (the distribution is not on the package index yet).
    assert f"fix: pip install --force-reinstall --no-deps {wheels['ours']}" in report, report
    assert "ok: poller from " in report  # the other package is still fine

    # The fix it gives, step by step (the wheel file stands in for the index).
    venv.pip("uninstall", "--yes", CLASH)
    half = venv.doctor()
    assert half.returncode == 1 and "buffer/__init__.py is missing" in half.stderr, half.stderr
    venv.pip("install", "--force-reinstall", "--no-deps", str(wheels["ours"]))
    fixed = venv.doctor()
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert venv.run("from buffer import ReplayBuffer").returncode == 0


def test_doctor_finds_a_buffer_that_shadows_ours_from_an_earlier_path_entry(tmp_path: Path,
                                                                            wheels: dict[str, Path]) -> None:
    venv = Venv(tmp_path / "venv")
    venv.pip("install", "--no-deps", str(wheels["ours"]))
    venv.pip("install", "--no-deps", "--target", str(tmp_path / "elsewhere"), str(wheels["clash"]))
    venv.borrow_dependencies()
    result = _run([str(venv.python), "-m", "poller", "doctor"], cwd=tmp_path / "elsewhere", check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "another package named buffer comes first on sys.path" in result.stderr, result.stderr
    assert f"installed by another distribution as well: {CLASH}" in result.stderr, result.stderr


def test_doctor_in_this_environment_is_healthy() -> None:
    result = _run([sys.executable, "-m", "poller", "doctor"], cwd=ROOT, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok: ") == 2
