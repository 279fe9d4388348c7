"""Each person's key and host ids: chosen by the gateway the first time it sees them, kept, and never a name's.

Why: a name is what a person chose (an open sign-up, an OAuth login, a users-file line), so a name used as a key let a
person named like a host login take that login's home, one named like a directory take the directory, and two names
whose escapes met, or one name from two sources, share files. Here a person is their source and name together
(``Owner``), and the gateway holds for each:

- a key, the one name of everything that is theirs on the host and the cluster (their directory of the shared volume,
  their Docker named volume): readable, but distinct for distinct people by construction (``person_key``);
- host ids of their own, from PERSON_IDS, chosen under a lock, checked against the host's user and group database
  (NSS: SSSD and LDAP too) and against the owners already present where people's directories are made, written down,
  and never given to anyone else, even after the person is gone.

A person is a host account only where the operator declares that one source's names are this host's logins
(MSB_HOST_ACCOUNTS: the shipped Hub config under LocalProcessSpawner, where JupyterHub itself runs each person's server
as their login). Nowhere else does a name reach an account's uid, files or home.

Callers: provisioning/person_places.py, which builds the registry from the settings and is what the gateway, the
provisioner, the pool's hand-out and the MCP file tools ask.
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import hashlib
import json
import os
import pwd
import re
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from msb_kernels.errors import ConfigError, SandboxError
from msb_kernels.identity.people import Owner

# Host ids for people: above any login's (LAST_LOGIN_UID) and below the namespace sandboxes' (namespace/uids.py). An
# operator keeps this range out of their user database (docs/teams.md "Your files"); an id found there is skipped.
PERSON_IDS = range(1_000_000_000, 1_001_000_000)
# A uid below this is the system's (login.defs' UID_MIN): a directory of such an owner is never shown as a sandbox's
# (backends/core/idmap.py), or the sandbox could make files of root (or of a daemon) on the host.
FIRST_PERSON_UID = 1000
LAST_LOGIN_UID = 60000  # login.defs' UID_MAX: above it are accounts such as nobody (65534), never a person's
ACCOUNT_SOURCES = ("hub", "users-file")  # what MSB_HOST_ACCOUNTS may declare: the sources whose names are logins
SOURCE_TAGS = {"hub": "hub", "users-file": "users", "token": "token", "local": "local", "system": "system"}
READABLE_CHARS = 32  # of a key's readable part; the digest beside it makes it distinct
DIGEST_CHARS = 16  # hex digits of the (source, name) digest in a key: 64 bits; the registry refuses a clash anyway
_UNREADABLE = re.compile(r"[^A-Za-z0-9_.-]")
FILE_NAME, LOCK_NAME = "people.json", "people.lock"


def person_key(owner: Owner, digest_chars: int = DIGEST_CHARS) -> str:
    """The key of (source, name): ``<source>-<readable name>-<digest>``. The digest is of the source and every byte of
    the name, so two people differ in it whatever their names; the readable part is for the operator's eyes only. Only
    Docker's volume-name characters, starting with a letter: one path component, never '.' or '..'."""
    readable = _UNREADABLE.sub("_", owner.name)[:READABLE_CHARS] or "_"
    digest = hashlib.sha256(f"{owner.source}\0{owner.name}".encode()).hexdigest()[:digest_chars]
    return f"{SOURCE_TAGS[owner.source]}-{readable}-{digest}"


def legacy_slug(name: str) -> str:
    """The directory name an earlier version gave a name (Person.slug's variable-width %XX escape, which two names
    could share): only to find that person's data and move it under their key (volumes.py, labroot.py)."""
    safe = "".join(c if c.isalnum() or c in "._-" else f"%{ord(c):02X}" for c in name)
    return safe if safe not in ("", ".", "..") else f"%{safe}"


@dataclass(frozen=True)
class Ids:
    """The host uid and gid a person's files are kept as."""

    uid: int
    gid: int


@dataclass(frozen=True)
class Registered:
    """One person as the registry holds them: their key, their own ids, and whether their name is their host account
    (then ``ids`` are the account's, looked up when asked, and ``own`` stays theirs for a day it is not)."""

    owner: Owner
    key: str
    own: Ids
    account: Ids | None = None

    @property
    def ids(self) -> Ids:
        return self.account or self.own

    @property
    def directory_name(self) -> str | None:
        """Their name as one path component (for MSB_LAB_ROOT_PATH's {username}, as JupyterHub's notebook_dir has it),
        or None where the name cannot be one."""
        name = self.owner.name
        return None if name in ("", ".", "..") or "/" in name or "\0" in name else name


class PersonRegistry:
    """The people this gateway has seen, in ``<state dir>/people.json`` (root's, 0600), under ``people.lock``.

    ``places``: the directories people's directories are made in (the shared volume, the Lab roots' parent); an owner
    found there is never given to a new person, so a stranger's directory never becomes theirs by its id.
    ``accounts``: the source whose names are this host's logins (MSB_HOST_ACCOUNTS), or None."""

    def __init__(self, state_dir: Path, places: Iterable[Path] = (), accounts: str | None = None):
        if accounts is not None and accounts not in ACCOUNT_SOURCES:
            raise ConfigError(f"MSB_HOST_ACCOUNTS={accounts!r} is not a source; use one of {', '.join(ACCOUNT_SOURCES)}, or leave it unset")
        self.state_dir = state_dir
        self.places = tuple(places)
        self.accounts = accounts
        self._known: dict[Owner, Registered] = {}  # entries never change once written: a cache is never stale
        self._lock = threading.Lock()

    @property
    def path(self) -> Path:
        return self.state_dir / FILE_NAME

    def get(self, owner: Owner) -> Registered:
        """The person's entry, made the first time they are seen. With their name declared a host account, ``account``
        holds their login's ids now (ConfigError where no login of that name is a person's)."""
        entry = self._known.get(owner)
        if entry is None:
            with self._lock:
                entry = self._known.get(owner) or self._register(owner)
                self._known[owner] = entry
        if self.accounts == owner.source:
            return Registered(entry.owner, entry.key, entry.own, login_ids(owner.name, self.accounts))
        return entry

    def entries(self) -> list[Registered]:
        with self._locked() as people:
            return people

    def left_by_an_earlier_version(self, directory: os.stat_result, person: Registered, name: str) -> bool:
        """Whether a directory at ``person``'s name from an earlier version (``legacy_slug``) is theirs to take: it is
        no person's key, and its owner is their own ids, or ids an earlier version chose per directory (of PERSON_IDS)
        that no person here holds. Never a directory of root's, of a login's or of anyone else's: an operator's
        ``<volume>/teamdata`` does not become a person's for their name, nor does another person's key."""
        if directory.st_uid == person.ids.uid:
            return all(entry.key != name or entry.owner == person.owner for entry in self.entries())
        if directory.st_uid not in PERSON_IDS:
            return False
        return all(entry.own.uid != directory.st_uid and entry.key != name for entry in self.entries())

    # -- the file, under its lock ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self):
        try:
            self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            lock = os.open(self.state_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise ConfigError(
                f"cannot keep the person registry in MSB_STATE_DIR={self.state_dir} ({exc.strerror or exc})",
                ["set MSB_STATE_DIR to a directory this user can write, on a disk that survives reboots"],
            ) from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one writer across processes: gateways on this state dir, a Hub's spawn hook
            yield self._read()
        finally:
            os.close(lock)

    def _read(self) -> list[Registered]:
        try:
            data = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            raise SandboxError(
                f"cannot read the person registry {self.path}: {exc}",
                ["restore it from a backup: each person's key and ids are kept there, and are never chosen again"],
            ) from None
        return [Registered(Owner(p["source"], p["name"]), p["key"], Ids(p["uid"], p["gid"])) for p in data.get("people", [])]

    def _write(self, people: list[Registered]) -> None:
        data = {"people": [{**asdict(p.owner), "key": p.key, **asdict(p.own)} for p in people]}
        temporary = self.path.with_name(FILE_NAME + ".new")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as file:
            json.dump(data, file, indent=1)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, self.path)

    def _register(self, owner: Owner) -> Registered:
        with self._locked() as people:
            for entry in people:
                self._known.setdefault(entry.owner, entry)
            if owner in self._known:
                return self._known[owner]
            keys = {entry.key for entry in people}
            key = person_key(owner)
            if key in keys:  # a clash of 64-bit digests: the whole digest, which no two (source, name) share
                key = person_key(owner, digest_chars=64)
            uid = self._free_id({entry.own.uid for entry in people} | {entry.own.gid for entry in people})
            entry = Registered(owner, key, Ids(uid, uid))
            self._write([*people, entry])
            return entry

    def _free_id(self, taken: set[int]) -> int:
        """The lowest id of PERSON_IDS that no person here has, the host's user and group databases do not name, and
        no file directly in a place is owned by (a stranger's directory, an earlier version's person's)."""
        for place in self.places:
            with contextlib.suppress(OSError):
                for entry in os.scandir(place):
                    with contextlib.suppress(OSError):
                        st = entry.stat(follow_symlinks=False)
                        taken |= {st.st_uid, st.st_gid}
        for candidate in PERSON_IDS:
            if candidate not in taken and not _in_host_database(candidate):
                return candidate
        raise SandboxError(f"every host id of {PERSON_IDS.start}-{PERSON_IDS.stop - 1} is taken: no new person can be given one")


def _in_host_database(number: int) -> bool:
    try:
        pwd.getpwuid(number)
        return True
    except KeyError:
        pass
    try:
        grp.getgrgid(number)
        return True
    except KeyError:
        return False


def login_ids(name: str, source: str) -> Ids:
    """The ids of the host login ``name``, for a person whose source MSB_HOST_ACCOUNTS declares; ConfigError where no
    login of that name is a person's (a system account, root's group, or none)."""
    try:
        account = pwd.getpwnam(name)
    except KeyError:
        account = None
    if account is None or not FIRST_PERSON_UID <= account.pw_uid <= LAST_LOGIN_UID or account.pw_gid == 0:
        raise ConfigError(
            f"MSB_HOST_ACCOUNTS={source} says {source} names are this host's logins, and {name!r} is no person's login here",
            [f"add the login {name!r} (useradd), or leave MSB_HOST_ACCOUNTS unset so that each person gets ids of their own"],
        )
    return Ids(account.pw_uid, account.pw_gid)
