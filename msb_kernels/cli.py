"""The ``msb-kernels`` command: install kernelspecs, run notebooks, check the host, sweep orphans."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from pathlib import Path

from msb_kernels.config import load_settings
from msb_kernels.errors import MsbError

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
    from nbclient.exceptions import CellExecutionError

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
    _print_outputs(notebook)
    print(f"done in {time.monotonic() - started:.1f} s")
    return 0


def cmd_install(args: argparse.Namespace) -> int:
    from msb_kernels.kernelspecs import install

    for line in install(load_settings(), prefix=args.prefix, user=args.user):
        print(line)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    load_settings()  # a bad setting fails here, before a kernel starts
    return run_notebook(Path(args.notebook), args.kernel, args.timeout)


def cmd_demo(args: argparse.Namespace) -> int:
    cmd_install(argparse.Namespace(prefix=None, user=False))
    return run_notebook(DEFAULT_NOTEBOOK, "msb-python-small", 120)


def cmd_doctor(args: argparse.Namespace) -> int:
    from msb_kernels.backends import backend_classes, choose_backend
    from msb_kernels.backends import cgroups
    from msb_kernels.templates import TEMPLATES

    settings = load_settings()
    print(f"settings: backend={settings.backend} default_flavor={settings.default_flavor} "
          f"max_sessions={settings.max_sessions} session_timeout={settings.session_timeout_seconds}s "
          f"shared_volume={settings.shared_volume or 'none'} runtime_dir={settings.runtime_root()}")
    for name, cls in backend_classes().items():
        availability = cls.availability()
        print(f"backend {name}: {'ok' if availability.ok else 'unavailable'} - {availability.reason}")
        for warning in availability.warnings:
            print(f"  warning: {warning}")
    if "microsandbox" not in backend_classes():
        print("backend microsandbox: not installed (pip install 'msb-kernels[microsandbox]')")
    hierarchy, note = cgroups.detect()
    print(f"limits: {note}")
    for template in TEMPLATES.values():
        reason = template.unavailable_reason()
        print(f"template {template.name}: {'ok' if reason is None else reason}")
    chosen, why = choose_backend(settings.backend)
    print(f"-> {why}")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from msb_kernels.backends import get_backend

    swept = asyncio.run(get_backend(load_settings()).sweep_orphans())
    print(f"removed {len(swept)} orphaned sandbox(es)" + (f": {', '.join(swept)}" if swept else ""))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from msb_kernels.backends import get_backend

    records = get_backend(load_settings()).list_sandboxes()
    for record in records:
        state = "running" if record.running else "stopped"
        owner = "owned" if record.owner_alive else "orphaned"
        print(f"{record.sandbox_id}  {record.backend}  {record.details.get('flavor', '?')}  {state}  {owner}")
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
    p.set_defaults(func=cmd_doctor)
    p = sub.add_parser("sweep", help="stop sandboxes whose owning process is gone")
    p.set_defaults(func=cmd_sweep)
    p = sub.add_parser("list", help="list this host's sandboxes")
    p.set_defaults(func=cmd_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except MsbError as exc:
        print(f"msb-kernels: error: {exc.message}", file=sys.stderr)
        for suggestion in exc.suggestions:
            print(f"  try: {suggestion}", file=sys.stderr)
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
