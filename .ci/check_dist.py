"""Build the sdist and the wheel as a user's installer would, and check what they carry.

``make check-dist`` (run by ``.ci/run``)::

    python -m build ─▶ sdist ─▶ wheel (built from the unpacked sdist)
    check: the sdist holds the test suite's support files, the wheel's metadata
    unpack the sdist, drop its package sources ─▶ its tests must import the installed wheel
    pip install --target SITE the wheel ─▶ poller --version, poller doctor, a fast subset of the tests

The installed wheel is used through ``PYTHONPATH``; its dependencies (pyzmq, msgpack, pytest)
come from the environment running this script. Exit 0 when every check passed.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from email.parser import Parser
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
NAME = "zmq-replay-poller"

# Files the sdist's test suite imports or reads besides the test modules themselves.
SDIST_MUST_HOLD = [
    "LICENSE", "CHANGELOG.md", "README.md", "SECURITY.md", "setup.cfg", "pyproject.toml",
    "tests/conftest.py", "tests/helpers/__init__.py", "tests/helpers/sources.py", "tests/helpers/stalls.py",
    "tests/helpers/netns.py", "tests/faults/__init__.py", "tests/integration/constraints.txt",
    "bench/__init__.py", "bench/faultmatrix.py", "examples/verl_style_trainer.py",
    "mkdocs.yml", "docs/using.md",
]

# Fast (well under a minute together), and between them they import every test support
# module and start real pollers from the installed files.
FAST_TESTS = ["tests/test_public_api.py", "tests/test_packaging.py", "tests/test_protocol.py",
              "tests/test_launch.py", "tests/test_buffer.py"]


# What a fresh clone does not have.
_NOT_SOURCE = (".git", ".venv", "*.egg-info", "build", "dist", "__pycache__", ".pytest_cache", ".mypy_cache",
               ".ruff_cache", "*.png", "site")


def _version() -> str:
    namespace: dict[str, str] = {}
    exec((ROOT / "poller" / "_version.py").read_text(), namespace)
    return namespace["__version__"]


def _classifiers() -> list[str]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return [line.strip() for line in config["metadata"]["classifiers"].splitlines() if line.strip()]


def _run(argv: Sequence[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    print("+", " ".join(argv), flush=True)
    result = subprocess.run(list(argv), text=True, stdin=subprocess.DEVNULL, **kwargs)  # type: ignore[call-overload]
    if result.returncode != 0:
        raise SystemExit(f"check-dist: exit code {result.returncode} from {' '.join(argv)}")
    return result


def _check_sdist(sdist: Path, version: str) -> str:
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
    top = f"zmq_replay_poller-{version}"
    missing = [path for path in SDIST_MUST_HOLD if f"{top}/{path}" not in names]
    if missing:
        raise SystemExit(f"check-dist: the sdist lacks {missing} (MANIFEST.in)")
    tests = sorted(n for n in names if n.startswith(f"{top}/tests/test_") and n.endswith(".py"))
    print(f"sdist: {len(names)} entries, {len(tests)} top-level test modules, support files present")
    return top


def _check_wheel(wheel: Path, version: str) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = Parser().parsestr(archive.read(f"zmq_replay_poller-{version}.dist-info/METADATA").decode())
    problems = []
    if metadata["Version"] != version:
        problems.append(f"Version {metadata['Version']} is not poller/_version.py's {version}")
    if sorted(metadata.get_all("Classifier") or []) != sorted(_classifiers()):
        problems.append("the classifiers differ from setup.cfg's")
    if metadata["License"] != "Apache-2.0" or "LICENSE" not in (metadata.get_all("License-File") or []):
        problems.append("License Apache-2.0 with License-File LICENSE expected")
    tops = sorted({n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")})
    if tops != ["buffer", "poller"]:
        problems.append(f"the wheel installs {tops}, expected exactly buffer and poller")
    for marker in ("poller/py.typed", "buffer/py.typed"):
        if marker not in names:
            problems.append(f"{marker} is missing")
    if problems:
        raise SystemExit("check-dist: wheel metadata: " + "; ".join(problems))
    print(f"wheel: {len(names)} files, version {version}, classifiers and license as declared")


def main(argv: Sequence[str] | None = None) -> int:
    """Build, check, unpack, install, test; return 0 when all passed (a failed step exits non-zero)."""
    del argv  # no options
    started = time.monotonic()
    python = sys.executable
    version = _version()
    with tempfile.TemporaryDirectory(prefix="check-dist-") as tmp:
        work = Path(tmp)
        dist = work / "dist"
        # From a clean copy, as in a fresh clone: setuptools would otherwise also pack whatever an
        # earlier build's *.egg-info/SOURCES.txt lists, and hide a MANIFEST.in that misses files.
        source = work / "source"
        shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*_NOT_SOURCE))
        _run([python, "-m", "build", "--outdir", str(dist), str(source)], stdout=subprocess.DEVNULL)
        sdist, = dist.glob("*.tar.gz")
        wheel, = dist.glob("*.whl")
        top = _check_sdist(sdist, version)
        _check_wheel(wheel, version)

        # The "data" filter where this Python has it (3.10.12+, 3.11.4+): no links or devices out of place.
        safe: dict[str, str] = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        with tarfile.open(sdist) as archive:
            archive.extractall(work, **safe)  # type: ignore[arg-type]
        unpacked = work / top
        # Without the sources next to the tests, the tests can only import the installed wheel.
        for package in ("poller", "buffer"):
            shutil.rmtree(unpacked / package)
        site = work / "site"
        _run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target", str(site),
              str(wheel)])
        env = dict(os.environ, PYTHONPATH=str(site), PYTHONDONTWRITEBYTECODE="1")
        where = _run([python, "-c", "import buffer, poller; print(poller.__file__); print(buffer.__file__)"],
                     cwd=unpacked, env=env, capture_output=True).stdout.split()
        if not all(path.startswith(str(site) + os.sep) for path in where):
            raise SystemExit(f"check-dist: the tests would not import the installed wheel but {where}")
        _run([python, "-m", "poller", "--version"], cwd=unpacked, env=env)
        _run([python, "-m", "poller", "doctor"], cwd=unpacked, env=env)
        _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *FAST_TESTS],
             cwd=unpacked, env=env)
    print(f"check-dist: OK in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
