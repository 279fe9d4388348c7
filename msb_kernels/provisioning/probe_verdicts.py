"""Start probes' passes kept on disk, so that a new process (papermill, nbclient, `msb-kernels run`) need not start a
probe kernel before its own: on gVisor that probe is a second kernel start, some 5 s of every batch run.

A verdict is kept per user, in ``$XDG_CACHE_HOME/msb-kernels/probes`` (``~/.cache`` of the user's passwd entry when
XDG_CACHE_HOME is unset or relative), one 0600 file per key in a 0700 directory. Its key is everything that decides
whether a kernel starts: the backend and what its availability check found (runsc's ``--version`` in it), the runtime's
own binary (``start_identity``), the interpreter's file and argv, the template, the host's kernel release and boot,
the user, this msb-kernels and the settings a start reads. Any of them changed is another key, so the next start probes.

Only passes are kept: a failed probe is cheap to repeat and a repaired host should not wait for a cache to forget.
A start that fails on a backend distrusts its verdict (``drop``), and the next start proves it again. A file that is
corrupt, not ours, group- or world-writable, or under a directory that is, is not believed; the cache is then ignored,
never an error: the worst it costs is a probe.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pwd
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

import msb_kernels
from msb_kernels.settings.config import MsbSettings

log = logging.getLogger("msb_kernels")

FORMAT = 2  # 2: the probe runs `ls` and `stat` too (msb_kernels.provisioning.probe.PROBE_CODE); a pass of format 1 proved less
# Settings that never change whether one kernel starts: who may start, how many, when to cull, how to serve.
_NOT_IN_KEY = frozenset(
    {
        "backend",  # the key names the backend itself; auto and an explicit name share its verdict
        "host",
        "port",
        "token",
        "users_file",
        "hub_auth_cache_seconds",
        "metrics_host",
        "metrics_port",
        "session_timeout_seconds",
        "max_sessions",
        "max_sessions_per_user",
        "capacity_cpus",
        "capacity_memory_mib",
        "concurrent_starts",
        "cull_busy",
        "cull_connected",
        "cull_interval_seconds",
        "pool_size",
        "pool_counts_as_sessions",
        "keep_kernels",
        "adopt_grace_seconds",
        "lab_url",
        "lab_token",
    }
)


def cache_dir() -> Path:
    """This user's directory of verdicts (made on first save)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path(_home()) / ".cache"
    return base / "msb-kernels" / "probes"


def _home() -> str:
    # The passwd entry, not $HOME: under `sudo` HOME may still be the caller's, whose cache root must not write.
    try:
        return pwd.getpwuid(os.geteuid()).pw_dir
    except KeyError:
        return os.path.expanduser("~")


def file_identity(path: str | None) -> dict[str, Any] | str:
    """What tells a binary replaced or upgraded at the same path: its resolved path, inode, size and mtime."""
    if not path:
        return "none"
    try:
        real = os.path.realpath(path)
        found = os.stat(real)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    return {"path": path, "real": real, "dev": found.st_dev, "ino": found.st_ino, "size": found.st_size, "mtime_ns": found.st_mtime_ns}


def key_for(backend: Any, argv: list[str], template: str, settings: MsbSettings, environment: str | None = None) -> dict[str, Any]:
    """Everything that decides whether a kernel of template from argv starts in backend (its SandboxBackend class) on
    this host (environment: the one argv[0] is, whose image a backend that runs images starts)."""
    availability = backend.availability()
    relevant = {name: getattr(settings, name) for name in sorted(settings.trait_names(config=True)) if name not in _NOT_IN_KEY}
    return {
        "format": FORMAT,
        "backend": backend.name,
        "found": [availability.ok, availability.reason, *availability.warnings],
        "runtime": backend.start_identity(),
        "interpreter": file_identity(argv[0] if argv else None),
        "argv": list(argv),
        "template": template,
        "environment": environment,
        "kernel": os.uname().release,
        "boot": boot_id(),
        "user": os.geteuid(),
        "msb_kernels": f"{msb_kernels.__version__} {Path(msb_kernels.__file__).parent}",
        # hashed: settings include secrets' paths and a token could be among them one day
        "settings": hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest(),
    }


def boot_id() -> str:
    # A reboot may bring another kernel module set or sysctls: prove once per boot.
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def path_for(key: dict[str, Any]) -> Path:
    """The file that holds key's verdict."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return cache_dir() / f"{key['backend']}-{digest}.json"


def load(key: dict[str, Any]) -> dict[str, Any] | None:
    """The kept pass for key, or None: none kept, or the file is not to be believed (said at debug level, or as a
    warning where someone else's file sits in our cache)."""
    path = path_for(key)
    if not _trusted_dir(path.parent):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.debug("msb-kernels: probe verdict %s not read: %s", path, exc)
        return None
    with os.fdopen(fd, "rb") as handle:
        found = os.fstat(handle.fileno())
        if not stat.S_ISREG(found.st_mode) or found.st_uid != os.geteuid() or found.st_mode & 0o077:
            log.warning(
                "msb-kernels: ignoring the probe verdict %s: it must be a regular file of uid %d, mode 0600 (is uid %d, mode %o)",
                path,
                os.geteuid(),
                found.st_uid,
                stat.S_IMODE(found.st_mode),
            )
            return None
        try:
            verdict = json.loads(handle.read(1 << 16))
        except (ValueError, UnicodeDecodeError) as exc:
            log.debug("msb-kernels: probe verdict %s is corrupt (%s): probing again", path, exc)
            return None
    if not isinstance(verdict, dict) or verdict.get("key") != json.loads(json.dumps(key, default=str)) or verdict.get("ok") is not True:
        log.debug("msb-kernels: probe verdict %s is not this key's pass: probing again", path)
        return None
    return verdict


def save(key: dict[str, Any], seconds: float, found: dict[str, Any] | None = None) -> None:
    """Keep a pass for key, with what it found (gVisor's platform choice keeps its figures); a cache that cannot be
    written is left alone (the next process probes)."""
    path = path_for(key)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _trusted_dir(path.parent):
            return
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".verdict-")  # mode 0600
        with os.fdopen(fd, "w") as handle:
            json.dump(
                {"key": key, "ok": True, "seconds": round(seconds, 3), "found": found or {}, "proven_at": time.time(), "pid": os.getpid()},
                handle,
                default=str,
            )
        os.replace(temporary, path)
    except OSError as exc:
        log.debug("msb-kernels: probe verdict not kept in %s: %s", path.parent, exc)


def drop(key: dict[str, Any]) -> bool:
    """Forget key's verdict; True where one was kept."""
    path = path_for(key)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("msb-kernels: cannot remove the probe verdict %s: %s; remove it by hand", path, exc)
        return False
    return True


def _trusted_dir(directory: Path) -> bool:
    """Ours, not a link, and writable by us alone; one of ours that others may read is tightened to 0700."""
    try:
        found = os.lstat(directory)
    except OSError:
        return False
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.geteuid():
        log.warning("msb-kernels: ignoring the probe verdicts in %s: it is not a directory of uid %d", directory, os.geteuid())
        return False
    if found.st_mode & 0o077:
        with contextlib.suppress(OSError):
            os.chmod(directory, 0o700)
            found = os.lstat(directory)
    if found.st_mode & 0o022:
        log.warning(
            "msb-kernels: ignoring the probe verdicts in %s: others may write to it (mode %o)", directory, stat.S_IMODE(found.st_mode)
        )
        return False
    return True
