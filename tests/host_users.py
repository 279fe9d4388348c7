"""Host users made for a test with useradd, as an operator makes them, and removed after it (with what they ran)."""

from __future__ import annotations

import contextlib
import pwd
import subprocess
from collections.abc import Iterator


def delete_host_user(name: str) -> None:
    subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True)
    subprocess.run(["userdel", "--remove", name], capture_output=True)


@contextlib.contextmanager
def host_user(name: str, uid: int | None = None, home: bool = False) -> Iterator[pwd.struct_passwd]:
    """The login ``name`` (its own group; ``uid`` if given; a home of its own, 0700, with ``home``)."""
    delete_host_user(name)  # a run killed before its cleanup left it
    argv = ["useradd", "--user-group", "--shell", "/bin/sh", "--create-home" if home else "--no-create-home"]
    subprocess.run([*argv, *(["--uid", str(uid)] if uid is not None else []), name], check=True, capture_output=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        delete_host_user(name)
