"""The ``msb-kernels`` command: install kernelspecs, run notebooks, check the host, sweep orphans."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from msb_kernels.backends.core.hostpaths import closed_note, shown_note
from msb_kernels.environments.env_command import add_env_parser
from msb_kernels.errors import MsbError
from msb_kernels.gateway.serve_command import add_serve_parser
from msb_kernels.identity.users_command import add_users_parser
from msb_kernels.jupyter import slow_imports
from msb_kernels.settings.config import load_settings

if TYPE_CHECKING:
    from collections.abc import Callable

DEFAULT_NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "hello.ipynb"


def _print_outputs(notebook) -> None:
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        print(f"--- cell {index} [{cell.execution_count}]: {cell.source.splitlines()[0] if cell.source else ''}")
        for output in cell.get("outputs", []):
            kind = output.get("output_type")
            if kind == "stream":
                print(output["text"], end="" if output["text"].endswith("\n") else "\n")
            elif kind in ("execute_result", "display_data"):
                data = output.get("data", {})
                extra = [m for m in data if m != "text/plain"]
                print(data.get("text/plain", ""), f"  [+ {', '.join(extra)}]" if extra else "")
            elif kind == "error":
                print(f"{output['ename']}: {output['evalue']}")


def run_notebook(path: Path, kernel: str, timeout: int) -> int:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, DeadKernelError

    from msb_kernels.jupyter.compat import disarm_exit_cleanup

    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, kernel_name=kernel, timeout=timeout, resources={"metadata": {"path": str(path.parent)}})
    started = time.monotonic()
    print(f"running {path} in kernel {kernel}")
    try:
        client.execute()
    except CellExecutionError as exc:
        _print_outputs(notebook)
        print(f"a cell failed: {str(exc).splitlines()[-1] if str(exc) else exc}", file=sys.stderr)
        return 1
    except (RuntimeError, TimeoutError, DeadKernelError) as exc:  # the kernel did not start, or died under a cell
        # nbclient left its exit hook armed on a kernel it has already cleaned up; it would print a traceback at exit.
        disarm_exit_cleanup(client)
        _print_outputs(notebook)
        print(
            f"msb-kernels: the {kernel} kernel stopped before the notebook ran: {exc}; the warnings above give its last "
            "words, and `msb-kernels doctor` checks every backend with a real start",
            file=sys.stderr,
        )
        return 1
    _print_outputs(notebook)
    print(f"done in {time.monotonic() - started:.1f} s")
    return 0


def cmd_install(args: argparse.Namespace) -> int:
    from msb_kernels.environments import environment_kernelspecs, list_environments
    from msb_kernels.kernelspecs.spec_files import install

    settings = load_settings()
    for line in install(settings, prefix=args.prefix, user=args.user):
        print(line)
    for environment in list_environments(settings):  # each environment's kernelspecs, rewritten as the default ones are
        for line in environment_kernelspecs.install(environment, settings, prefix=args.prefix, user=args.user):
            print(line)
    if os.geteuid() == 0:  # root installs for a team, whose people run and see it
        for note in filter(None, (closed_note(), shown_note())):
            print(f"note: {note}", file=sys.stderr)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    load_settings()  # a bad setting fails here, before a kernel starts
    return run_notebook(Path(args.notebook), args.kernel, args.timeout)


def cmd_demo(args: argparse.Namespace) -> int:
    from msb_kernels.kernelspecs.spec_files import install

    for line in install(load_settings(), node=False):  # the demo is a Python notebook: no npm run at each demo
        print(line)
    return run_notebook(DEFAULT_NOTEBOOK, "msb-python-small", 120)


def cmd_doctor(args: argparse.Namespace) -> int:
    from msb_kernels.backends import backend_classes, choose_backend, unloadable_backends
    from msb_kernels.backends.core import cgroups
    from msb_kernels.kernelspecs.flavors import FLAVORS
    from msb_kernels.kernelspecs.templates import TEMPLATES

    settings = load_settings()
    print(
        f"settings: backend={settings.backend} default_flavor={settings.default_flavor} "
        f"max_sessions={settings.max_sessions} session_timeout={settings.session_timeout_seconds}s "
        f"shared_volume={settings.shared_volume or 'none'} runtime_dir={settings.runtime_root()}"
    )
    from msb_kernels.backends.core import leftovers, scratch

    # Read before the start probes below, whose first start sweeps them as any start does.
    left = [disk for disk in leftovers.disks(settings.scratch_root(), leftovers.STARTS_WITHIN) if disk.left]
    dead_io = leftovers.dead_io_dirs(leftovers.STARTS_WITHIN)
    failed = _print_backends(settings)
    for name, why in unloadable_backends.items():
        print(f"backend {name}: unavailable - {why} (reinstall msb-kernels)")
    hierarchy, note = cgroups.detect()
    print(f"limits: {note}")
    print(f"python: {closed_note() or f'{sys.executable}, which every user of this host can run'}")
    print(f"  in sandboxes: {shown_note() or 'no path of it names a person (none under /home or /root)'}")
    speed_note = cgroups.start_speed_note(hierarchy)
    if speed_note is not None:
        print(f"  start time: {speed_note}")
    for flavor in FLAVORS.values():
        print(
            f"flavor {flavor.name}: {flavor.cpus} CPU, {flavor.memory_mib} MiB memory, {flavor.disk_mib} MiB disk, "
            f"{flavor.shm_mib} MiB /dev/shm"
        )
    for template in TEMPLATES.values():
        reason = template.unavailable_reason()
        print(f"template {template.name}: {'ok' if reason is None else reason}")
    for cls in backend_classes().values():  # what each backend needs of this host, in its own words
        for line in cls.doctor_lines(settings):
            print(line)
    try:
        chosen, why = choose_backend(settings.backend, skip=failed if settings.backend == "auto" else None)
    except MsbError as exc:
        print(exc.report("msb-kernels doctor"))
        return 1
    print(f"-> {why}")
    if chosen in failed:
        print(f"-> but MSB_BACKEND={chosen} cannot start a kernel here (above); unset MSB_BACKEND to let auto pick one that can")
        return 1
    if settings.scratch_root().exists() and (problem := scratch.root_problem(settings.scratch_root())) is not None:
        print(f"scratch: MSB_SCRATCH_DIR={settings.scratch_root()} {problem}: no kernel's disk is made or swept there")
    _print_leftovers(left, clean=args.clean)  # before the verdict lines, which end the report
    for state_dir, why in dead_io:
        if args.clean and state_dir.exists():
            leftovers.remove_dead_state_dir(state_dir)
        print(f"scratch: left behind: {state_dir} (its io tmpfs mounted): {why}{'; removed' if not state_dir.exists() else ''}")
    try:
        transport = backend_classes()[chosen].transport_for(settings)
    except MsbError as exc:
        print(exc.report("msb-kernels doctor"))
        return 1
    print(f"-> kernels reached over {transport} (MSB_TRANSPORT={settings.transport})")
    if settings.hibernate_after_seconds > 0:
        from msb_kernels.backends import get_backend

        unavailable = get_backend(settings, chosen).hibernation_unavailable()
        after = f"MSB_HIBERNATE_AFTER_SECONDS={settings.hibernate_after_seconds}"
        print(f"-> {after}: " + (f"kernels cannot hibernate here: {unavailable}" if unavailable else "idle kernels hibernate to disk"))
    return 0


def _print_leftovers(left: list, clean: bool) -> None:
    """The scratch dir's disk images that no live sandbox held when doctor began, from any runtime dir
    (backends/core/leftovers.py): removed with clean, or by the start probe's sweep, else still there."""
    from msb_kernels.backends.core import leftovers

    if not left:
        print("scratch: no disk left behind")
        return
    for disk in left:
        if clean and disk.image.exists():
            leftovers.remove(disk)
        mounted = f", mounted at {', '.join(map(str, disk.mounts))}" if disk.mounts else ""
        mounted += f", its sandbox's state dir {disk.state_dir}" if disk.state_dir and disk.state_dir.exists() else ""
        print(f"scratch: left behind: {disk.image} ({disk.allocated >> 20} MiB{mounted}): {disk.why}")
    freed = sum(disk.allocated for disk in left) >> 20
    still = [disk for disk in left if disk.image.exists()]
    if not still:
        print(f"-> removed {len(left)} disk(s) no sandbox held{' (the start probe swept them)' if not clean else ''}, freeing {freed} MiB")
    else:
        print(
            f"-> {len(still)} disk(s) no sandbox holds take {sum(d.allocated for d in still) >> 20} MiB: `msb-kernels doctor --clean` removes them"
        )


def _print_backends(settings) -> dict[str, str]:
    """Each backend's look at the host, then, where that says ok, a real start of a small kernel from the installed
    kernelspec's interpreter (msb_kernels.provisioning.probe). Returns the backends that failed their start, with why."""
    from msb_kernels.backends import backend_classes
    from msb_kernels.kernelspecs.templates import TEMPLATES
    from msb_kernels.provisioning import probe

    argv = _installed_argv("msb-python-small") or TEMPLATES["python"].argv()
    failed: dict[str, str] = {}
    for name, cls in backend_classes().items():
        availability = cls.availability()
        if not availability.ok:
            print(f"backend {name}: unavailable - {availability.reason}")
            continue
        try:
            result = asyncio.run(probe.probe(name, argv, "python", settings))
        except MsbError as exc:  # a setting this backend cannot honour; the verdict at the end says so
            print(f"backend {name}: ok - {availability.reason}")
            print(f"  start: not tried: {exc.message}")
            continue
        print(f"backend {name}: {'ok' if result.ok else 'failed'} - {availability.reason}")
        print(f"  start: {result.summary()}")
        for line in [] if result.ok else result.stderr_tail[-8:]:
            print(f"  kernel stderr: {line}")
        for warning in availability.warnings:
            print(f"  warning: {warning}")
        if not result.ok:
            failed[name] = result.summary()
    return failed


def _installed_argv(kernel_name: str) -> list[str] | None:
    """The argv of the installed kernelspec, as a client would start it; None when it is not installed."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        return KernelSpecManager().get_kernel_spec(kernel_name).argv
    except NoSuchKernel:
        print(f"kernelspec {kernel_name}: not installed (run `msb-kernels install`); probing with this interpreter instead")
        return None


def cmd_image_build(args: argparse.Namespace) -> int:
    from msb_kernels.backends.microsandbox import images as msb_images
    from msb_kernels.images import builds, image_for

    settings = load_settings()
    if args.env is not None:
        from msb_kernels.environments.env_command import cmd_image_build_env

        if args.template != "python" or args.online:
            why = "environments hold Python packages: build `python --env NAME`" if args.template != "python" else "drop --online"
            print(
                f"msb-kernels: error: --env {args.env}: an environment's image is built offline from this host's interpreter ({why})",
                file=sys.stderr,
            )
            return 2
        loader = _image_loader(args)
        return 2 if loader is None else cmd_image_build_env(args, settings, *loader)
    tag = args.tag or (builds.GATEWAY_TAG if args.template == "gateway" else image_for(settings, args.template))
    if args.online and args.template == "gateway":
        print("msb-kernels: error: the gateway image is built offline only (drop --online)", file=sys.stderr)
        return 2
    if args.online:
        result = msb_images.build_online(args.template, tag, base=args.base)
    else:
        loader = _image_loader(args)
        if loader is None:
            return 2
        load, loaded_with = loader
        if args.template == "gateway":
            result = builds.build_gateway(
                tag, base_archive=args.from_archive, suite=args.suite, mirror=args.mirror, keep_archive=args.save_archive, load=load
            )
        else:
            result = builds.build_offline(
                args.template, tag, suite=args.suite, mirror=args.mirror, keep_archive=args.save_archive, load=load
            )
        result.loaded_with = loaded_with
    print(result.report())
    if args.template != "gateway" and args.tag and args.tag != image_for(settings, args.template):
        print(f"use it with MSB_{args.template.upper()}_IMAGE={args.tag}")
    return 0


def _image_loader(args: argparse.Namespace) -> tuple[Callable[[Path, str], object], str] | None:
    """--engine's loader and its name; None (after saying why) for --engine none without --save-archive."""
    from msb_kernels.backends.microsandbox import images as msb_images

    if args.engine == "docker":
        from msb_kernels.backends.cluster.swarm import docker_load

        return docker_load, "docker load"
    if args.engine == "none":
        if args.save_archive is None:
            print("msb-kernels: error: --engine none keeps only the archive: name it with --save-archive PATH", file=sys.stderr)
            return None
        return (lambda archive, tag: None), "nothing (archive only)"
    return msb_images.load_archive, "msb load"


def cmd_sweep(args: argparse.Namespace) -> int:
    from msb_kernels.backends import get_backend

    backend = get_backend(load_settings())
    swept = asyncio.run(backend.sweep_orphans(include_adoptable=args.include_adoptable))
    print(f"removed {len(swept)} orphaned sandbox(es)" + (f": {', '.join(swept)}" if swept else ""))
    waiting = [record.sandbox_id for record in backend.list_sandboxes() if record.adoptable]
    if waiting:
        print(
            f"left {len(waiting)} adoptable sandbox(es) running for the next msb-kernels serve: {', '.join(waiting)} "
            "(they stop by themselves after MSB_ADOPT_GRACE_SECONDS; --include-adoptable stops them now)"
        )
    return 0


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def cmd_swarm_proxy(args: argparse.Namespace) -> int:
    from msb_kernels.backends.cluster.socket_proxy import serve

    host, port = args.listen
    serve(host, port, args.docker_socket)
    return 0


def sandbox_state(record) -> str:
    """What `msb-kernels list` says of one sandbox: who holds it, and whether a gateway may still adopt it."""
    if not record.running:
        return "stopped  dead (the next sweep removes it)"
    if record.owner_alive:
        return f"running  owned by pid {record.details.get('owner_pid')}"
    if record.adoptable:
        return f"running  adoptable (held by keeper pid {record.details.get('keeper_pid')} for the next msb-kernels serve)"
    return "running  orphaned (the next sweep stops it)"


def cmd_list(args: argparse.Namespace) -> int:
    from msb_kernels.backends import get_backend

    records = get_backend(load_settings()).list_sandboxes()
    for record in records:
        print(f"{record.sandbox_id}  {record.backend}  {record.details.get('flavor', '?')}  {sandbox_state(record)}")
    if not records:
        print("no sandboxes")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="msb-kernels", description="Sandboxed Jupyter kernels.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("install", help="write the msb-python-* (and msb-node-*) kernelspecs")
    p.add_argument("--user", action="store_true", help="install for the current user instead of this environment")
    p.add_argument("--prefix", help="install under this prefix (default: this environment)")
    p.set_defaults(func=cmd_install)
    p = sub.add_parser("run", help="execute a notebook in a sandboxed kernel and print its outputs")
    p.add_argument("notebook")
    p.add_argument("--kernel", default="msb-python-small")
    p.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("demo", help="install the kernelspecs and run notebooks/hello.ipynb")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("doctor", help="say which sandbox backends and limits work on this host")
    p.add_argument("--clean", action="store_true", help="remove the disk images no live sandbox holds, which doctor lists")
    p.set_defaults(func=cmd_doctor)
    p = sub.add_parser("image", help="build the kernel images (microVMs, Docker Swarm)")
    image_sub = p.add_subparsers(dest="image_command", required=True)
    b = image_sub.add_parser("build", help="build the python or node kernel image and load it (msb load or docker load)")
    b.add_argument("template", choices=["python", "node", "gateway"], help="a kernel image, or the gateway's own (MSB_BACKEND=swarm)")
    b.add_argument(
        "--online", action="store_true", help="pip/npm install on a base image in a builder microVM (needs a host that boots microVMs)"
    )
    b.add_argument("--tag", help="image reference (default: MSB_PYTHON_IMAGE / MSB_NODE_IMAGE; with --env: msb-kernels/python-NAME:latest)")
    b.add_argument(
        "--env",
        metavar="NAME",
        help="python: the image of environment NAME (`msb-kernels env list`): the default python image (--from-archive, else "
        "the engine's, else built first) plus its interpreter; the tag is recorded in its record for Swarm and microVM kernels",
    )
    b.add_argument("--base", help="--online: the base image (default python:3.12-slim or node:20-slim)")
    b.add_argument(
        "--from-archive",
        metavar="PATH",
        type=Path,
        help="gateway, --env: start from this python kernel image archive (made with --save-archive) instead of building one",
    )
    b.add_argument(
        "--engine",
        choices=("msb", "docker", "none"),
        default="msb",
        help="offline: load the image into microsandbox (msb, the default), the Docker engine at DOCKER_HOST (docker: for "
        "MSB_BACKEND=swarm, on each node), or nowhere (none: with --save-archive, for `docker load` elsewhere)",
    )
    b.add_argument("--suite", help="offline: the Debian suite (default: this host's)")
    b.add_argument("--mirror", help="offline: the Debian mirror (default: apt's configured one)")
    b.add_argument("--save-archive", metavar="PATH", type=Path, help="offline: also keep the image tar (Docker-save format) at PATH")
    b.set_defaults(func=cmd_image_build)
    p = sub.add_parser("sweep", help="stop sandboxes whose owning process is gone")
    p.add_argument(
        "--include-adoptable", action="store_true", help="also stop the kernels a stopped gateway left running for the next one to adopt"
    )
    p.set_defaults(func=cmd_sweep)
    p = sub.add_parser("list", help="list this host's sandboxes")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser(
        "swarm-proxy", help="serve the Docker API to a swarm gateway, passing only the calls that start and stop its kernels"
    )
    p.add_argument("--listen", type=_host_port, default=("0.0.0.0", 2375), metavar="HOST:PORT", help="default 0.0.0.0:2375")
    p.add_argument("--docker-socket", default="/var/run/docker.sock", metavar="PATH", help="the engine's socket (a swarm manager's)")
    p.set_defaults(func=cmd_swarm_proxy)
    add_serve_parser(sub)
    add_users_parser(sub)
    add_env_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    slow_imports.defer()
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except MsbError as exc:
        print(exc.report("msb-kernels"), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.debug or os.environ.get("MSB_DEBUG"):
            raise
        print(f"msb-kernels: error: {type(exc).__name__}: {exc} (rerun with --debug for details)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
