"""CurveZMQ keys: making key files, loading them, and configuring sockets.

All cryptography is libzmq's. Key files are pyzmq's certificates: ``NAME.key`` holds the public key,
``NAME.key_secret`` both halves. The buffer is the *server* (its pair, and the poller public keys it allows); each
poller a *client* (its pair, and the server's public key, so it cannot be talked into streaming to an impostor).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Union

import zmq
import zmq.auth

__all__ = ["CurveClient", "CurveServer", "make_keys", "load_public_key", "load_key_pair", "generate_pair"]

PathLike = Union[str, "os.PathLike[str]"]

#: The ZAP domain the buffer's socket asks its authenticator about.
ZAP_DOMAIN = "replay-buffer"


def _require_curve() -> None:
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support")


def make_keys(out_dir: PathLike, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` (0600) into ``out_dir`` (made 0700); return both paths.

    Raises:
        FileExistsError: ``NAME.key`` or ``NAME.key_secret`` already exists (a key is never overwritten).
        ValueError: ``name`` is empty or holds a path separator.
    """
    _require_curve()
    if not name or os.sep in name or name.startswith("."):
        raise ValueError(f"bad key name {name!r}: a plain file name is needed")
    out = Path(out_dir)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    public, secret = out / f"{name}.key", out / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise FileExistsError(f"{path} exists; refusing to overwrite a key")
    old_umask = os.umask(0o077)  # the secret file is never readable by others, not even before the chmod
    try:
        public_file, secret_file = zmq.auth.create_certificates(str(out), name)
    finally:
        os.umask(old_umask)
    os.chmod(secret_file, 0o600)
    os.chmod(public_file, 0o644)
    return Path(public_file), Path(secret_file)


def _load(path: PathLike, what: str) -> tuple[bytes | None, bytes | None]:
    _require_curve()
    try:
        return zmq.auth.load_certificate(os.fspath(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read a CURVE {what} from {path}: {exc}") from exc


def load_public_key(path: PathLike) -> bytes:
    """The z85 public key in a ``.key`` or ``.key_secret`` file; a ValueError if it holds none."""
    return _checked(_load(path, "public key")[0], path)


def load_key_pair(path: PathLike) -> tuple[bytes, bytes]:
    """``(public, secret)`` z85 keys from a ``.key_secret`` file; a ValueError if it holds no secret key."""
    public, secret = _load(path, "key pair")
    if not secret:
        raise ValueError(f"{path} holds no secret key; pass the .key_secret file")
    return _checked(public, path), _checked(secret, path)


def generate_pair() -> tuple[bytes, bytes]:
    """A fresh ``(public, secret)`` z85 key pair that never touches a file."""
    _require_curve()
    return zmq.curve_keypair()


def _checked(key: bytes | None, path: PathLike) -> bytes:
    if not key or len(key) != 40:
        raise ValueError(f"{path} holds no valid z85 CURVE key")
    return key


@dataclass(frozen=True)
class CurveClient:
    """A poller's CURVE settings: its own key pair and the buffer's public key (z85)."""

    public_key: bytes
    secret_key: bytes
    server_key: bytes

    @classmethod
    def from_files(cls, secret_file: PathLike, server_key_file: PathLike) -> "CurveClient":
        """From the poller's ``.key_secret`` file and the buffer's ``.key`` file."""
        public, secret = load_key_pair(secret_file)
        return cls(public, secret, load_public_key(server_key_file))

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE client of the buffer (before ``connect``)."""
        sock.curve_publickey = self.public_key
        sock.curve_secretkey = self.secret_key
        sock.curve_serverkey = self.server_key

    def __repr__(self) -> str:  # never print a secret key
        return f"CurveClient(public_key={self.public_key!r}, server_key={self.server_key!r})"


@dataclass(frozen=True)
class CurveServer:
    """The buffer's CURVE settings: its key pair and the poller public keys it accepts (z85)."""

    public_key: bytes
    secret_key: bytes
    allowed: frozenset[bytes]

    @classmethod
    def from_files(cls, secret_file: PathLike,
                   allowed: PathLike | Iterable[PathLike | bytes]) -> "CurveServer":
        """From the buffer's ``.key_secret`` file; ``allowed``: a directory of ``.key`` files, one, or files/keys."""
        if isinstance(allowed, (str, os.PathLike)):
            allowed = sorted(Path(allowed).glob("*.key")) if Path(allowed).is_dir() else [allowed]
        public, secret = load_key_pair(secret_file)
        return cls(public, secret, frozenset(_checked(item, "an allowed key") if isinstance(item, bytes)
                                             else load_public_key(item) for item in allowed))

    def allowing(self, *public_keys: bytes) -> "CurveServer":
        """The same server, accepting ``public_keys`` as well."""
        return CurveServer(self.public_key, self.secret_key, self.allowed | frozenset(public_keys))

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE server that asks ZAP about every client (before ``bind``)."""
        sock.curve_server = True
        sock.curve_publickey = self.public_key
        sock.curve_secretkey = self.secret_key
        sock.zap_domain = ZAP_DOMAIN.encode()
        try:
            # Fail closed: without a ZAP handler, refuse rather than admit.
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        except (AttributeError, zmq.ZMQError):
            pass  # older libzmq: the authenticator is bound before the socket, so ZAP is always asked

    def __repr__(self) -> str:
        return f"CurveServer(public_key={self.public_key!r}, allowed={len(self.allowed)} keys)"
