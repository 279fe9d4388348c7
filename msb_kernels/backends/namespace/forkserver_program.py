"""A fork server: a Python kernel's imports done once, then a fork per sandboxed kernel.

Runs as ``<kernel's python> [its options] -s forkserver_program.py <fd>`` (forkservers.py starts it), with a clean
environment, as its own session; fd is the listening Unix socket that the host bound for it. It imports ipykernel and what a started kernel imports, freezes that heap for
the garbage collector (so children leave those pages shared), writes one JSON line to stdout
(``{"pid": ..., "watched": {dir: mtime_ns}}``: the import directories as they were before the imports, to
tell when the environment changed) and serves connections on that socket until its stdin, the owner's
lifeline, closes.

The server itself never accepts a connection or reads a request. It keeps one child forked ahead, waiting in
accept() on that socket, so that no start waits for a fork of this 50 MiB process (5 to 9 ms of a start here);
when that child takes a connection from the server's own user, the server forks the next one. A child still
waiting ends with the server; one that has a connection goes on without it. That child reads the launch plan and
the descriptors (SCM_RIGHTS) that go with it, and becomes what ``python init_program.py`` is on the exec path: the
launcher. Its init forks the kernel process, which here does not exec: it drops every descriptor but 0-2, takes
the kernel's environment, reseeds ``random`` (and numpy's global generator if a preload imported numpy), and
runs ``ipykernel_launcher``'s ``IPKernelApp`` from the imported modules. So no plan, key or path of one kernel
ever sits in the memory the next one inherits.

What forked kernels do share with the server and with each other: the address-space layout of everything
imported before the fork, and the string hash seed (PYTHONHASHSEED), both chosen when the server started. Code
in a sandbox cannot reach the server or another sandbox to use either (README, "Forked kernels").

Only the standard library and the kernel's own packages are used; init_program.py is loaded by path.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import importlib.util
import json
import os
import random
import select
import signal
import socket
import sys
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == HERE:
    del sys.path[0]  # run as a script: its own directory is no kernel's import path

# What a started IPKernelApp has imported beyond ipykernel.kernelapp: about 60 ms of a start when left to the child.
PRELOADED = (
    "ipykernel.kernelapp",
    "ipykernel.ipkernel",
    "ipykernel.zmqshell",
    "ipykernel.debugger",
    "ipykernel.comm",
    "IPython.core.debugger",
    "IPython.core.oinspect",
    "IPython.extensions.storemagic",
    "IPython.utils.wildcard",
    "IPython.core.completerlib",
    "sqlite3",
    "tornado.platform.asyncio",
    "tornado.queues",
    "tornado.locks",
    "pdb",
    "faulthandler",
    "IPython.core.logger",
    # With MSB_TRANSPORT=tcp, jupyter_client's load_connection_info asks localinterfaces for a default ip even when
    # the file names one, and that imports psutil: 15 to 60 ms. Only the import is done here: the addresses are read
    # in the kernel's own network namespace, never the host's.
    "psutil",
    "jupyter_client.localinterfaces",
)
REQUIRED = "ipykernel.kernelapp"
# How long after a launcher takes a connection the server forks the next: a fork of this process takes a CPU for some
# 5 ms, which a start under way would otherwise wait for on a small host. A connection that comes sooner gets one at once.
REFILL_DELAY_SECONDS = 0.3
FORK_RETRY_SECONDS = 0.1  # after a fork failed: soon, but not a busy loop while the host has no process to spare
RESTORED_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD, signal.SIGALRM)


def _load(name: str, directory: str = HERE):
    spec = importlib.util.spec_from_file_location(f"msb_{name}", os.path.join(directory, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


nsinit = _load("init_program")
keeper = _load("keeper_program", os.path.join(os.path.dirname(HERE), "core"))
KernelApp: type | None = None  # kernel_app_class(), made by preload()


def import_directories() -> dict[str, int]:
    """The import path's directories and their mtimes: installing or removing a package changes one."""
    watched = {}
    for entry in sys.path:
        try:
            watched[entry] = os.stat(entry).st_mtime_ns
        except OSError:
            continue
    return watched


def preload() -> None:
    importlib.import_module(REQUIRED)
    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except Exception:
            continue
    tokenize_once()
    if threading.active_count() != 1:
        raise RuntimeError("importing the kernel started a thread, and a fork keeps only the forking one")
    global KernelApp
    KernelApp = kernel_app_class()
    gc.collect()
    gc.freeze()  # the collector leaves the imported objects alone, so forked kernels keep those pages shared


def tokenize_once() -> None:
    """Compile the tokenizer's patterns here, once: IPython tokenizes every cell, and tokenize compiles its patterns
    at first use, 13 ms of each kernel's first cell. Only module-level caches of the standard library are filled."""
    import io
    import tokenize

    for _ in tokenize.generate_tokens(io.StringIO("x = f'{1}' + b'' + 1j  # a cell\n").readline):
        pass


def kernel_app_class() -> type:
    """IPKernelApp, except that the command line the provisioner writes for a Python kernel (PROVISIONER_SETTINGS) is
    taken without building traitlets' argparse parser for every configurable class: 10 to 13 ms of each start. Any
    other command line is parsed as usual. The subclass keeps the name, so logs and config sections read as before;
    tests/msb_kernels/backends/namespace/test_forkserver.py checks it against traitlets' own parse of the provisioner's command
    line."""
    from ipykernel import kernelapp
    from traitlets.config import Config

    class IPKernelApp(kernelapp.IPKernelApp):
        def parse_command_line(self, argv=None):
            settings = _provisioner_command_line(argv)
            if settings is None:
                return super().parse_command_line(argv)
            self.argv = list(argv)
            self.cli_config = Config(settings)
            self.update_config(self.cli_config)
            self.extra_args = []
            return None

    return IPKernelApp


# The ``--Class.trait=`` arguments the provisioner adds (templates.PythonTemplate.launch_arguments), each with what
# traitlets makes of its value there: exec_files is a list trait of IPKernelApp, whose classes traitlets knows;
# HistoryManager is not among them, so its value stays a string that the trait converts when it is read.
def _deferred(value: str) -> str:
    from traitlets.config.loader import DeferredConfigString

    return DeferredConfigString(value)


PROVISIONER_SETTINGS = {
    "--IPKernelApp.exec_files=": lambda value: [value],
    "--HistoryManager.hist_file=": _deferred,
}


def _provisioner_command_line(argv: list[str] | None) -> dict | None:
    """The settings of a command line made only of ``-f <connection file>`` and PROVISIONER_SETTINGS, each at most
    once, as {section: {trait: value}}; None for anything else."""
    if not argv:
        return None
    settings: dict = {}
    arguments = iter(argv)
    for argument in arguments:
        if argument == "-f" and "connection_file" not in settings.get("IPKernelApp", {}):
            value = next(arguments, None)
            if value is None or value.startswith("-"):
                return None
            settings.setdefault("IPKernelApp", {})["connection_file"] = value
            continue
        prefix, _, value = argument.partition("=")
        convert = PROVISIONER_SETTINGS.get(prefix + "=")
        section, _, trait = prefix[2:].partition(".")
        if convert is None or trait in settings.get(section, {}):
            return None
        settings.setdefault(section, {})[trait] = convert(value)
    return settings if "connection_file" in settings.get("IPKernelApp", {}) else None


def serve(listener: socket.socket) -> None:
    """Keep one launcher forked ahead and waiting for a connection, so no start waits for a fork of this process;
    return when the owner's lifeline closes."""
    taken, taken_by_launcher = os.pipe()  # a launcher writes a byte here once it has a connection
    poller = select.poll()
    poller.register(0, select.POLLIN)  # the owner's lifeline: EOF when the gateway (or whoever started us) is gone
    poller.register(taken, select.POLLIN)
    poller.register(listener.fileno(), select.POLLIN)  # watched only while no launcher waits
    waiting: int | None = None  # the pidfd of the launcher waiting for a connection
    refill_at = 0.0

    def none_waiting(delay: float) -> float:
        """Stop watching the waiting launcher (it took a connection, or it died): when to fork the next one."""
        poller.unregister(waiting)
        os.close(waiting)
        poller.modify(listener.fileno(), select.POLLIN)
        return time.monotonic() + delay

    while True:
        if waiting is None and time.monotonic() >= refill_at:
            waiting = _fork_launcher(listener, taken_by_launcher)
            if isinstance(waiting, OSError):
                # No process can be made (a full pids cgroup or pid_max: EAGAIN). The starts waiting for a launcher are
                # told so now, not after the host's report timeout; forks are tried again later, not in a busy loop.
                _refuse_waiting(listener, waiting)
                refill_at, waiting = time.monotonic() + FORK_RETRY_SECONDS, None
            elif waiting is not None:
                poller.register(waiting, select.POLLIN)  # readable once it has exited
                poller.modify(listener.fileno(), 0)
        timeout = 1000 if waiting is not None else max(0, (refill_at - time.monotonic()) * 1000)
        for fd, _ in poller.poll(timeout):
            if fd == 0:
                if not os.read(0, 64):
                    return  # the waiting launcher ends with this process (die_with_parent); those under way go on
            elif fd == taken:
                os.read(taken, 64)
                if waiting is not None:
                    refill_at, waiting = none_waiting(REFILL_DELAY_SECONDS), None
            elif fd == listener.fileno():
                refill_at = 0.0  # a connection and no launcher for it: fork one now
            elif fd == waiting:  # it died while waiting (killed, or it could not start)
                refill_at, waiting = none_waiting(0.1), None  # not a busy loop should every fork fail
        while True:  # the launchers exit once the host holds a pidfd for their init
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break


def _fork_launcher(listener: socket.socket, taken: int) -> int | OSError | None:
    """Fork a launcher that waits for the next connection: its pidfd; the fork's error when none could be made; None
    when it ended at once."""
    server = os.getpid()
    try:
        child = os.fork()
    except OSError as exc:
        return exc
    if child == 0:
        try:
            _wait_for_connection(listener, taken, server)
        finally:
            os._exit(1)
    try:
        return os.pidfd_open(child)
    except OSError:
        return None  # reaped already: it could not start


def _refuse_waiting(listener: socket.socket, failure: OSError) -> None:
    """Answer each connection waiting on listener, as its launcher would have, with the fork's failure (and its errno,
    which the host turns into a refusal that names the limit)."""
    report = {"error": f"no launcher could be forked for the sandbox: {failure.strerror or failure}", "errno": failure.errno}
    while select.select([listener], [], [], 0)[0]:
        try:
            connection, _ = listener.accept()
        except OSError:
            return  # gone meanwhile, or no descriptor left for it: its start meets its own timeout
        with connection:
            connection.settimeout(5)
            if keeper.peer_uid(connection) != os.geteuid():
                continue
            try:
                _, fds = keeper.receive_request(connection)
                for fd in fds:
                    os.close(fd)
                connection.sendall(json.dumps(report).encode() + b"\n")
            except (OSError, ValueError, EOFError):
                continue  # that start gave up: nothing to tell it


def _wait_for_connection(listener: socket.socket, taken: int, server: int) -> None:
    """The forked launcher, before any request: ready the process, then take one connection from the server's own
    user and tell the server, which forks the next launcher."""
    nsinit.die_with_parent(signal.SIGKILL)  # a waiting launcher holds no sandbox: it ends with the server
    if os.getppid() != server:
        return
    nsinit.close_descriptors_but([listener.fileno(), taken])  # not the server's lifeline, pipe or pidfds
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.close(null)
    os.setsid()
    while True:
        try:
            connection, _ = listener.accept()
        except ConnectionAbortedError:
            continue
        if keeper.peer_uid(connection) == os.geteuid():
            break
        connection.close()
    os.write(taken, b".")
    os.close(taken)
    os.close(listener.detach())
    nsinit.die_with_parent(0)  # from here on the sandbox outlives the server
    _launcher(connection)


def _launcher(connection: socket.socket) -> None:
    """The launcher with a connection: read the launch plan, build the sandbox with init_program, report init's pid, and wait
    for the host to close (it holds init's pidfd then)."""
    report: dict
    try:
        plan, fds = keeper.receive_request(connection)
        if not fds:
            raise ValueError("the request carries no descriptors")
        stderr, *fds = fds
        os.dup2(stderr, 2)  # the sandbox's stderr, which the host reads
        os.dup2(stderr, 1)
        os.close(stderr)
        for name in ("lifeline_fd", "scratch_ready_fd", "shared_fd"):
            if plan.get(name) is not None:
                plan[name] = fds.pop(0)
        for entry in plan.get("host_dirs") or ():
            if entry[2] is not None:
                entry[2] = fds.pop(0)
        plan["listen_fds"] = fds[: len(plan.get("listen_fds") or [])]
        report = nsinit.launch(plan, start_forked_kernel, reap_here)
    except Exception as exc:
        report = {"error": f"the fork server could not launch the sandbox: {exc}"}
    try:
        connection.sendall(json.dumps(report).encode() + b"\n")
        while connection.recv(4096):  # the host closes once it holds a pidfd for init
            pass
    finally:
        os._exit(0)


def start_forked_kernel(plan: dict, error_pipe: int) -> None:
    """Init's forked child: become the kernel without an exec (init_program.exec_kernel's counterpart)."""
    try:
        nsinit.prepare_kernel_process(plan)
        nsinit.drop_capabilities()
        nsinit.close_descriptors_but([error_pipe])  # nothing of the server's, the launcher's or init's
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for signum in RESTORED_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python sets it at start
        arguments = kernel_arguments(plan["argv"])
        os.environ.clear()
        os.environ.update(plan["env"])
        sys.path[:0] = [entry for entry in plan["env"].get("PYTHONPATH", "").split(os.pathsep) if entry]
        random.seed()  # from os.urandom: siblings forked from one server must not draw the same numbers
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed()
        sys.argv = ["ipykernel_launcher", *arguments]
        os.close(error_pipe)  # the kernel "execs" now: init reports the sandbox started
    except BaseException as exc:
        os.write(error_pipe, f"cannot start the forked kernel: {exc}".encode())
        os._exit(127)
    code = 0
    try:
        KernelApp.launch_instance(argv=arguments)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # what an interpreter's exit runs: IPython saves its history there
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def reap_here(plan: dict, kernel: int, kept_fds: list[int]) -> None:
    """Init runs core/guest.py's REAPER in this process instead of a fresh interpreter: its pages stay shared with the
    server's, where an exec'd reaper would cost each sandbox some 4 MiB of its own."""
    try:
        nsinit.drop_capabilities()  # what the exec as uid 1000 would have dropped
        nsinit.close_descriptors_but(kept_fds)
        sys.argv = ["msb-reaper", *nsinit.reaper_arguments(plan, kernel)]
        code = compile(nsinit.REAPER, "<msb-reaper>", "exec")
    except BaseException:
        os._exit(1)  # init gone: the whole sandbox with it, and the host sees it end
    exec(code, {"__name__": "__msb_reaper__"})  # the guest's own reaper: the code an exec'd init would run
    os._exit(0)


def kernel_arguments(argv: list[str]) -> list[str]:
    """The arguments after ``-m ipykernel_launcher`` in a kernel's argv."""
    index = argv.index("-m")
    if argv[index + 1] != "ipykernel_launcher":
        raise ValueError(f"{argv!r} does not run ipykernel_launcher")
    return argv[index + 2 :]


def main() -> None:
    try:
        listener = socket.socket(fileno=int(sys.argv[1]))
        listener.set_inheritable(False)
        watched = import_directories()
        preload()
    except BaseException as exc:
        sys.stdout.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.write(json.dumps({"pid": os.getpid(), "watched": watched}) + "\n")
    sys.stdout.flush()
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 1)
    os.close(null)
    serve(listener)
    os._exit(0)


if __name__ == "__main__":
    main()
