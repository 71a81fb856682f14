"""CURVE keys: loading and generating key pairs, the allow-list of client keys
(with what each may do), and the ZAP handler a shard's ROUTER socket runs so
that every message carries its sender's public key. transport.py uses them to
secure its sockets; access.py decides on the keys."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from paramserver.errors import TransportError

__all__ = [
    "ANY_KEY",
    "AUTHORIZED_CLIENTS_DIR",
    "CurveKeyFiles",
    "CurveKeys",
    "KeyGrant",
    "admin_key_pair",
    "generate_curve_keys",
    "load_allow_list",
    "parse_allow_list",
    "public_key",
    "secure_client",
    "start_authenticator",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CurveKeys:
    """CURVE key material (Z85 text). A server needs its secret key; a client the
    server's public key and a key pair of its own."""

    public: bytes
    secret: bytes
    server_public: bytes | None = None

    @classmethod
    def load(cls, key_file: str | Path, server_public_file: str | Path | None = None) -> CurveKeys:
        """Read a key file written by ``paramserver keys generate`` (zmq's format)."""
        try:
            public, secret = zmq.auth.load_certificate(str(key_file))
            server_public = None
            if server_public_file is not None:
                server_public, _ = zmq.auth.load_certificate(str(server_public_file))
        except (OSError, ValueError) as exc:
            raise TransportError(f"cannot read CURVE key file: {exc}") from exc
        if secret is None:
            raise TransportError(f"{key_file} holds no secret key (use the .key_secret file)")
        if not zmq.has("curve"):
            raise TransportError("this libzmq was built without CURVE support")
        return cls(public, secret, server_public)


    def as_replica(self) -> CurveKeys:
        """A server's keys as a client of another replica of its shard: its own pair,
        and its own public key as the server's (every shard shares the server pair)."""
        return CurveKeys(self.public, self.secret, self.public)

    @property
    def public_text(self) -> str:
        """The public key as Z85 text (what ZAP names a sender by)."""
        return self.public.decode("ascii")


def secure_client(socket: zmq.Socket[Any], curve: CurveKeys) -> None:
    """Make ``socket`` (before it connects) a CURVE client with ``curve``'s keys."""
    if curve.server_public is None:
        raise TransportError("CURVE needs the server's public key")
    socket.curve_secretkey = curve.secret
    socket.curve_publickey = curve.public
    socket.curve_serverkey = curve.server_public


AUTHORIZED_CLIENTS_DIR = "authorized_clients"


@dataclass(frozen=True)
class CurveKeyFiles:
    """Where :func:`generate_curve_keys` put the keys (paths)."""

    server_public: Path
    server_secret: Path
    clients: dict[str, tuple[Path, Path]]  # name -> (public, secret)
    authorized_dir: Path
    #: admin key pairs (name -> (public, secret)): servers take them with --admin-key
    admins: dict[str, tuple[Path, Path]] = field(default_factory=dict)


def generate_curve_keys(directory: str | Path, clients: Sequence[str] = ("client",), *,
                        admins: Sequence[str] = (), force: bool = False) -> CurveKeyFiles:
    """Write a server key pair, a key pair per client and a directory of the clients'
    public keys (for the server's ``curve_clients_dir``), in zmq's Z85 text format.
    Each of ``admins`` gets a key pair too, kept out of that directory: a server
    admits it, as an admin, when given its public key (``admin_keys``).

    Refuses to overwrite existing keys unless ``force``. Secret files are made
    readable by their owner only.
    """
    folder = Path(directory)
    names = [*clients, *admins]
    for name in names:
        if not name or name == "server" or not all(c.isalnum() or c in "-_" for c in name):
            raise TransportError(f"client name {name!r}: use letters, digits, - and _, "
                                 f"and not 'server'")
    if len(set(names)) != len(names):
        raise TransportError(f"client names repeat: {names}")
    authorized = folder / AUTHORIZED_CLIENTS_DIR
    targets = [folder / f"{n}.{ext}" for n in ["server", *names] for ext in ("key", "key_secret")]
    existing = [str(p) for p in targets if p.exists()]
    if existing and not force:
        raise TransportError(f"keys exist already ({', '.join(existing)}); refusing to "
                             f"overwrite them (force to replace)")
    try:
        authorized.mkdir(parents=True, exist_ok=True)
        server_public, server_secret = zmq.auth.create_certificates(str(folder), "server")
        made: dict[str, tuple[Path, Path]] = {}
        for name in names:
            public, secret = zmq.auth.create_certificates(str(folder), name)
            made[name] = (Path(public), Path(secret))
            if name not in admins:
                (authorized / f"{name}.key").write_bytes(Path(public).read_bytes())
        for path in [Path(server_secret), *(s for _, s in made.values())]:
            path.chmod(0o600)
    except OSError as exc:
        raise TransportError(f"cannot write keys into {folder}: {exc}") from exc
    return CurveKeyFiles(Path(server_public), Path(server_secret),
                         {n: made[n] for n in clients}, authorized,
                         {n: made[n] for n in admins})


def admin_key_pair(directory: str | Path, name: str = "admin") -> Path:
    """The secret file of an admin key pair in ``directory``, made if it is not there
    (the launcher's own key for SHUTDOWN, CHECKPOINT and reporting deaths)."""
    folder = Path(directory)
    secret = folder / f"{name}.key_secret"
    if secret.exists():
        return secret
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _, made = zmq.auth.create_certificates(str(folder), name)
        Path(made).chmod(0o600)
    except OSError as exc:
        raise TransportError(f"cannot write an admin key into {folder}: {exc}") from exc
    return Path(made)


@dataclass(frozen=True)
class KeyGrant:
    """What one admitted CURVE client key may do on a server.

    ``ranks``: the worker ids it may register and act as (None: any id not
    registered by another key). ``admin``: it may also SHUTDOWN, CHECKPOINT and
    report a worker dead (``BYE dead=true``).
    """

    ranks: frozenset[int] | None = None
    admin: bool = False


#: the grant of a key admitted without an allow-list entry of its own
ANY_KEY = KeyGrant()


def _is_z85_key(text: str) -> bool:
    if len(text) != 40:
        return False
    try:
        return len(z85.decode(text.encode("ascii"))) == 32
    except (ValueError, UnicodeEncodeError, KeyError, TypeError):
        return False


def public_key(text: str, base: str | Path = ".") -> str:
    """A client public key as Z85 text: ``text`` is either the key itself (40
    characters) or a zmq key file (public or secret; relative to ``base``)."""
    text = text.strip()
    if _is_z85_key(text):
        return text
    path = Path(base) / text
    try:
        public, _ = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise TransportError(f"{text}: neither a Z85 public key (40 characters) nor a "
                             f"readable key file: {exc}") from exc
    return public.decode("ascii")


def parse_allow_list(text: str, base: str | Path = ".",
                     where: str = "allow-list") -> dict[str, KeyGrant]:
    """Parse an allow-list file: one admitted client key per line.

    ``KEY [rank=R[,R...]] [role=worker|admin]``: KEY is a Z85 public key or a
    key file (relative to the list's folder). A bare KEY (the old format) may
    act as any worker id and is no admin; ``rank=`` binds the key to those
    worker ids, ``role=admin`` lets it run administrative operations. Blank
    lines and the words from one starting with ``#`` on are comments (Z85 has
    ``#`` but never starts a 32-byte key with it: that needs a value >= 2**32).
    """
    grants: dict[str, KeyGrant] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        words = raw.split()
        comment = next((i for i, w in enumerate(words) if w.startswith("#")), None)
        line = words[:comment]
        if not line:
            continue
        here = f"{where}:{number}"
        key = public_key(line[0], base)
        ranks: frozenset[int] | None = None
        admin = False
        for token in line[1:]:
            name, sep, value = token.partition("=")
            if name == "rank" and sep and ranks is None:
                try:
                    ranks = frozenset(int(r) for r in value.split(","))
                except ValueError:
                    ranks = None
                if not ranks or min(ranks) < 0:
                    raise TransportError(f"{here}: rank= needs worker ids >= 0, like rank=0,1; "
                                         f"got {token!r}")
            elif name == "role" and value in ("worker", "admin"):
                admin = value == "admin"
            else:
                raise TransportError(f"{here}: unknown {token!r}; a line is KEY "
                                     f"[rank=R[,R...]] [role=worker|admin]")
        if key in grants:
            raise TransportError(f"{here}: key {key} is listed twice")
        grants[key] = KeyGrant(ranks, admin)
    return grants


def load_allow_list(location: str | Path) -> dict[str, KeyGrant]:
    """The admitted client keys: a directory of ``*.key`` files (each key may act as
    any worker id, none is admin), or an allow-list file (:func:`parse_allow_list`)."""
    path = Path(location)
    if path.is_dir():
        grants = {public_key(str(f)): ANY_KEY for f in sorted(path.glob("*.key"))}
    else:
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise TransportError(f"cannot read the allow-list {location}: {exc}") from exc
        grants = parse_allow_list(text, path.parent, str(location))
    if not grants:
        raise TransportError(
            f"{location}: no client public keys (*.key files, or lines of an allow-list) to "
            f"authorise; put the clients' .key files there (paramserver keys generate "
            f"writes one)"
        )
    return grants


class _KeyCheck:
    """zmq.auth's credentials provider: admits the listed keys (None: any key).
    zmq.auth then sets each message's User-Id to the client's Z85 public key."""

    def __init__(self, keys: Mapping[str, KeyGrant] | None) -> None:
        self.keys = None if keys is None else frozenset(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return self.keys is None or key.decode("ascii") in self.keys


def start_authenticator(context: zmq.Context[Any],
                         keys: Mapping[str, KeyGrant] | None) -> ThreadAuthenticator:
    """A ZAP handler that admits the client keys in ``keys`` (None: every key), so
    that every message carries the Z85 public key of its sender as User-Id."""
    auth = ThreadAuthenticator(context, log=logging.getLogger(f"{__name__}.auth"))
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_KeyCheck(keys))
    if keys is None:
        log.info("CURVE: admitting any client key")
    else:
        log.info("CURVE: admitting %d client key(s)", len(keys))
    return auth
