"""``python -m poller doctor``: are ``poller`` and ``buffer`` the files this distribution installed?

Another distribution on the public index also installs a top-level ``buffer``, which overwrites or shadows ours while
``pip check`` (requirements, not files) sees nothing. This compares where Python would import each package from, and
every file's sha256, with the installer's ``RECORD``, importing neither, so a broken ``buffer`` cannot stop it.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import NamedTuple

from poller._version import __version__

__all__ = ["DISTRIBUTION", "PACKAGES", "Diagnosis", "diagnose"]

DISTRIBUTION = "zmq-replay-poller"
PACKAGES = ("poller", "buffer")


@dataclass
class Diagnosis:
    """What the check found: ``ok`` lines, ``problems``, and how to fix them."""

    ok: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        """The report, one finding a line."""
        out = [f"ok: {line}" for line in self.ok] + [f"problem: {line}" for line in self.problems]
        out += [f"fix: {line}" for line in self.fixes]
        if self.healthy:
            out.append(f"{DISTRIBUTION} {__version__}: poller and buffer are this distribution's files")
        return out


def diagnose() -> Diagnosis:
    """Compare the importable ``poller`` and ``buffer`` with this distribution's install record."""
    result = Diagnosis()
    dist = _our_distribution()
    if dist is None:
        where = {name: _imported_dir(name) for name in PACKAGES}
        result.problems.append(f"{DISTRIBUTION} is not installed in this environment (poller from {where['poller']}, "
                               f"buffer from {where['buffer']}); nothing to compare them with")
        result.fixes.append(f"pip install <a clone or a built wheel of {DISTRIBUTION}>   "
                            f"(pip install {DISTRIBUTION} once it is on the package index)")
        return result
    editable_root = _editable_root(dist)
    owners: set[str] = set()
    for package in PACKAGES:
        if editable_root is None:
            owners |= _check_recorded(dist, package, result)
            continue
        imported, expected = _imported_dir(package), editable_root / package
        spec = importlib.util.find_spec(package)  # a regular package, not a namespace one
        if imported != expected or spec is None or not str(spec.origin).endswith("__init__.py"):
            result.problems.append(f"{package} is imported from {imported}, not from the editable install's "
                                   f"source tree {expected}")
        else:
            result.ok.append(f"{package} from {imported} (editable install)")
    if result.healthy:
        return result
    if owners:
        names = " ".join(sorted(owners))
        result.problems.append(f"installed by another distribution as well: {names} (it also installs a top-level "
                               f"package of that name; both cannot live in one environment)")
        result.fixes.append(f"pip uninstall {names}   (or give it an environment of its own), then:")
    if editable_root is not None:
        result.fixes.append(f"pip install -e {editable_root}   (and remove what shadows it from sys.path)")
    else:  # the local wheel or tree it came from, or the index
        path, _ = _direct_url(dist)
        source = path if path is not None and Path(path).exists() else f"{DISTRIBUTION}=={__version__}"
        result.fixes.append(f"pip install --force-reinstall --no-deps {source}   (puts this distribution's files back)")
    return result


def _our_distribution() -> importlib.metadata.Distribution | None:
    """This distribution's record: the one beside the ``poller`` Python imports, else the first found."""
    found = list(importlib.metadata.distributions(name=DISTRIBUTION))
    imported = _imported_dir("poller")
    for dist in found:
        root = _editable_root(dist)
        where = root / "poller" if root is not None else Path(str(dist.locate_file("poller"))).resolve()
        if where == imported:
            return dist
    return found[0] if found else None


def _imported_dir(package: str) -> Path | None:
    """The directory ``import package`` would load, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        return None
    if spec.origin is not None and spec.origin not in ("namespace", "built-in"):
        return Path(spec.origin).resolve().parent
    locations = list(spec.submodule_search_locations or [])
    return Path(locations[0]).resolve() if locations else None


def _direct_url(dist: importlib.metadata.Distribution) -> tuple[str | None, bool]:
    """The local path this install came from (``direct_url.json``), if any, and whether it is editable."""
    try:
        info = json.loads(dist.read_text("direct_url.json") or "{}")
        url, editable = info.get("url", ""), bool(info.get("dir_info", {}).get("editable"))
    except (ValueError, AttributeError):
        return None, False
    return (url[len("file://"):], editable) if url.startswith("file://") else (None, False)


def _editable_root(dist: importlib.metadata.Distribution) -> Path | None:
    """The source tree of an editable install (``pip install -e``), whose record lists no package files."""
    path, editable = _direct_url(dist)
    return Path(path).resolve() if path is not None and editable else None


class _Recorded(NamedTuple):
    path: PurePosixPath
    sha256: str | None  # None: listed without one (RECORD itself, compiled files, a source tree's egg-info)


def _recorded(dist: importlib.metadata.Distribution, package: str) -> list[_Recorded]:
    """The files of ``package`` the install record lists, from RECORD itself (3.12+'s dist.files omits missing ones)."""
    text = dist.read_text("RECORD")
    if text is None:  # an .egg-info: SOURCES.txt lists files without hashes
        rows = [(str(PurePosixPath(*f.parts)), "") for f in dist.files or []]
    else:
        rows = [(row[0], row[1] if len(row) > 1 else "") for row in csv.reader(text.splitlines()) if row]
    out = []
    for name, digest in rows:
        path = PurePosixPath(name)
        mode, _, value = digest.partition("=")
        if path.parts and path.parts[0] == package:
            out.append(_Recorded(path, value if mode == "sha256" and value else None))
    return out


def _check_recorded(dist: importlib.metadata.Distribution, package: str, result: Diagnosis) -> set[str]:
    """Check one package against the record; return the other distributions found owning its files."""
    recorded = _recorded(dist, package)
    installed_dir = Path(str(dist.locate_file(package))).resolve()
    imported = _imported_dir(package)
    if not recorded:
        result.problems.append(f"the install record of {DISTRIBUTION} lists no files of {package}")
        return set()
    if imported != installed_dir:
        result.problems.append(f"{package} is imported from {imported}, but {DISTRIBUTION} installed it in "
                               f"{installed_dir}: another package named {package} comes first on sys.path")
        return _owners_of(package, imported)
    hashed = [file for file in recorded if file.sha256 is not None]
    if not hashed:
        result.ok.append(f"{package} from {installed_dir} (a source tree: its record has no hashes to compare)")
        return set()
    bad = []
    for file in hashed:
        path = Path(str(dist.locate_file(str(file.path))))
        if not path.is_file():
            bad.append(f"{file.path} is missing")
        elif _sha256(path) != file.sha256:
            bad.append(f"{file.path} was changed")
    recorded_names = {file.path for file in recorded}
    found = sorted(PurePosixPath(package, *p.relative_to(installed_dir).parts) for p in installed_dir.rglob("*.py"))
    bad += [f"{name} is not one of {DISTRIBUTION}'s files" for name in found if name not in recorded_names]
    if not bad:
        result.ok.append(f"{package} from {installed_dir} ({len(hashed)} files match the install record)")
        return set()
    result.problems.append(f"{package} in {installed_dir} is not what {DISTRIBUTION} installed: " + "; ".join(bad))
    return _owners_of(package, installed_dir)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256(path.read_bytes()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _owners_of(package: str, directory: Path | None) -> set[str]:
    """Other installed distributions that record files of ``package`` in ``directory``."""
    if directory is None:
        return set()
    return {dist.metadata["Name"] or "?" for dist in importlib.metadata.distributions()
            if dist.metadata["Name"] != DISTRIBUTION
            and any(file.parts and file.parts[0] == package
                    and Path(str(dist.locate_file(file))).resolve().parent.is_relative_to(directory)
                    for file in dist.files or [])}

