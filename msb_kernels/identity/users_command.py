"""``msb-kernels users``: the users file's people (add, token, remove, list). A running gateway rereads the file."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from msb_kernels.errors import ConfigError, InvalidRequest
from msb_kernels.identity import users_file
from msb_kernels.identity.users_file import SETTING, Entry, check_name, new_token, token_digest


def _path(args: argparse.Namespace) -> Path:
    chosen = args.file or os.environ.get(SETTING)
    if not chosen:
        raise ConfigError(
            f"which users file? pass --file PATH or set {SETTING}",
            [f"e.g. --file ~/.config/msb-kernels/users.json, then serve with {SETTING} set to it"],
        )
    return Path(chosen).expanduser().resolve()


def _entries(path: Path, *, create: bool) -> dict[str, Entry]:
    if create and not path.exists():
        return {}
    return users_file.read(path)


def cmd_users(args: argparse.Namespace) -> int:
    path = _path(args)
    if args.users_command == "list":
        entries = _entries(path, create=False)
        for entry in sorted(entries.values(), key=lambda e: e.name):
            print(f"{entry.name}{'  (admin)' if entry.admin else ''}")
        if not entries:
            print(f"no people in {path}")
        return 0
    name = check_name(args.name)
    entries = _entries(path, create=args.users_command == "add")
    if args.users_command == "remove":
        if entries.pop(name, None) is None:
            raise InvalidRequest(f"{name} is not in {path}", [f"`msb-kernels users list --file {path}` shows who is"])
        users_file.write(path, entries)
        print(f"removed {name}; their token no longer works (their running kernels go on until stopped or culled)")
        return 0
    if args.users_command == "add" and name in entries:
        raise InvalidRequest(f"{name} is in {path} already", [f"`msb-kernels users token {name}` gives them a new token"])
    if args.users_command == "token" and name not in entries:
        raise InvalidRequest(f"{name} is not in {path}", [f"`msb-kernels users add {name}` adds them"])
    token = new_token()
    admin = args.admin if args.users_command == "add" else entries[name].admin
    entries[name] = Entry(name, token_digest(token), admin)
    users_file.write(path, entries)
    print(f"{name}{' (admin)' if admin else ''}: {token}")
    print("this token is shown once; only its hash is kept. They send it as  Authorization: token <token>")
    return 0


def add_users_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("users", help=f"the people of a team without JupyterHub ({SETTING}): add, token, remove, list")
    users_sub = p.add_subparsers(dest="users_command", required=True)
    for command, text in (
        ("add", "add a person and print their token"),
        ("token", "give a person a new token (the old one stops working)"),
        ("remove", "remove a person (their token stops working)"),
        ("list", "list the people and who is an admin"),
    ):
        c = users_sub.add_parser(command, help=text)
        if command != "list":
            c.add_argument("name")
        if command == "add":
            c.add_argument("--admin", action="store_true", help="sees and manages every person's kernels")
        c.add_argument("--file", help=f"the users file (default: {SETTING})")
        c.set_defaults(func=cmd_users)
