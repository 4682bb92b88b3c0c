"""What a package index and a new user see: version, license, changelog, classifiers, README links.

The built artifacts themselves (sdist contents, wheel metadata, the sdist's own tests) are checked
by ``.ci/check_dist.py`` (``make check-dist``, run by ``.ci/run``).
"""

from __future__ import annotations

import configparser
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import buffer
import poller
from poller._version import __version__

ROOT = Path(__file__).resolve().parent.parent


def _setup_cfg() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config


def test_one_version_source_for_both_packages_and_the_metadata() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)
    assert poller.__version__ == buffer.__version__ == __version__
    assert _setup_cfg()["metadata"]["version"].strip() == "attr: poller._version.__version__"
    assert importlib.metadata.version("zmq-replay-poller") == __version__


def test_python_m_poller_version() -> None:
    result = subprocess.run([sys.executable, "-m", "poller", "--version"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"zmq-replay-poller {__version__}"


def test_license_file_is_the_apache_2_license_declared() -> None:
    metadata = _setup_cfg()["metadata"]
    assert metadata["license"].strip() == "Apache-2.0"
    assert metadata["license_files"].strip() == "LICENSE"
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_changelog_has_the_current_version() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## {re.escape(__version__)}\b", text, re.M), "CHANGELOG.md has no entry for " + __version__


def test_classifiers_python_3_10_to_3_13_on_linux_only() -> None:
    metadata = _setup_cfg()["metadata"]
    classifiers = [line.strip() for line in metadata["classifiers"].splitlines() if line.strip()]
    versions = sorted(c.rsplit(" :: ", 1)[1] for c in classifiers if re.fullmatch(r"Programming Language :: "
                                                                                    r"Python :: 3\.\d+", c))
    assert versions == ["3.10", "3.11", "3.12", "3.13"]
    systems = [c for c in classifiers if c.startswith("Operating System ::")]
    assert systems == ["Operating System :: POSIX :: Linux"]
    assert _setup_cfg()["options"]["python_requires"].strip() == ">=3.10"


def test_readme_has_no_relative_links() -> None:
    # The README is the package index page, where relative links and in-page
    # anchors lead nowhere: every link must be absolute.
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)", text) + re.findall(r"""(?:href|src)=["']([^"']+)""", text)
    targets += re.findall(r"^\s*\[[^\]]+\]:\s*(\S+)", text, re.M)  # reference-style definitions
    relative = [t for t in targets if not re.match(r"https?://", t)]
    assert relative == []
    assert "<a id=" not in text
