"""`msb-kernels env`: the operator's commands for environments (msb_kernels.environments.commands does the work)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from msb_kernels.settings.config import MsbSettings, load_settings


def _print(lines: list[str]) -> None:
    for line in lines:
        print(line)


def cmd_env(args: argparse.Namespace) -> int:
    from msb_kernels.environments import commands

    settings = load_settings()
    if args.env_command == "add":
        _print(commands.add(args.name, args.python, settings, args.prefix, args.user))
    elif args.env_command == "create":
        _print(
            commands.create(
                args.name, Path(args.requirements), settings, Path(args.wheels) if args.wheels else None, args.prefix, args.user
            )
        )
    elif args.env_command == "list":
        _print(commands.list_lines(settings))
    elif args.env_command == "check":
        ok, lines = commands.check(args.names, settings)
        _print(lines)
        return 0 if ok else 1
    elif args.env_command == "remove":
        _print(commands.remove(args.name, settings))
    return 0


def cmd_image_build_env(args: argparse.Namespace, settings: MsbSettings, load: Callable[[Path, str], object], loaded_with: str) -> int:
    """`msb-kernels image build python --env NAME` (msb_kernels.environments.image_build does the work)."""
    from msb_kernels.environments import commands, image_build
    from msb_kernels.environments.kernel_images import default_tag

    environment = commands.get(args.env, settings, argument="--env")
    base = image_build.base_archive_from(args.engine, settings, args.from_archive, args.suite, args.mirror)
    tag = args.tag or default_tag(settings, environment.name)
    result = image_build.build(environment, settings, tag, base_archive=base, load=load, keep_archive=args.save_archive)
    result.loaded_with = loaded_with
    print(result.report())
    print(f"recorded in environment {environment.name}: its kernels on Swarm and microVMs run {tag}")
    if args.engine == "docker":
        print("every Swarm node that may run its kernels needs it: run this there too, or `docker load -i` an archive of it")
    elif args.engine == "none":
        print(f"load it where its kernels run: `docker load -i {args.save_archive}` on each Swarm node, or `msb load` for microVMs")
    return 0


def add_env_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="Python environments for the kernels, outside msb-kernels' own venv")
    env_sub = p.add_subparsers(dest="env_command", required=True)
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--user", action="store_true", help="write its kernelspecs for the current user instead of this environment")
    where.add_argument("--prefix", help="write its kernelspecs under this prefix (default: this environment, as install does)")
    a = env_sub.add_parser("add", parents=[where], help="register an existing interpreter (a venv, conda env or pyenv Python)")
    a.add_argument("name", help="lowercase letters, digits and '-'; its kernelspecs are msb-NAME-python-<flavor>")
    a.add_argument("--python", required=True, metavar="PATH", help="the interpreter, e.g. /opt/conda/envs/data/bin/python")
    c = env_sub.add_parser("create", parents=[where], help="build a venv from a requirements file (with uv where it is on PATH, else pip)")
    c.add_argument("name", help="lowercase letters, digits and '-'; its kernelspecs are msb-NAME-python-<flavor>")
    c.add_argument("-r", "--requirements", required=True, metavar="FILE", help="a pip requirements file (ipykernel is added)")
    c.add_argument("--wheels", metavar="DIR", help="install offline from this directory of wheels (--no-index --find-links DIR)")
    env_sub.add_parser("list", help="the environments, their Python and main packages")
    k = env_sub.add_parser("check", help="start a kernel from each environment in every backend that runs here")
    k.add_argument("names", nargs="*", metavar="NAME", help="default: every environment")
    r = env_sub.add_parser("remove", help="forget an environment and delete its kernelspecs (and its venv, if created here)")
    r.add_argument("name")
    p.set_defaults(func=cmd_env)
