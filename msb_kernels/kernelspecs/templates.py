"""Templates: which kernel runs in a sandbox (python or node), and what it needs from the host."""

from __future__ import annotations

import abc
import enum
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from msb_kernels.errors import InvalidRequest
from msb_kernels.kernelspecs import kernel_code

TSLAB_VERSION = "1.0.22"


def node_prefix() -> Path:
    """Where `msb-kernels install` puts tslab: inside the environment, so sandboxes can see it."""
    return Path(sys.prefix) / "share" / "msb-kernels" / "node"


class ErrorKind(enum.Enum):
    """What a failed execution was, as the kernel's own report tells it."""

    COMPILE = "compile"  # the code never ran: a syntax or type error
    INTERRUPT = "interrupt"  # the kernel was interrupted; its state is kept
    OUT_OF_MEMORY = "out_of_memory"  # the runtime ran out of the flavor's memory
    RUNTIME = "runtime"  # anything the code raised while it ran


@dataclass(frozen=True)
class KernelError:
    kind: ErrorKind
    message: str  # one line: "NameError: name 'x' is not defined", a compiler diagnostic, ...


@dataclass(frozen=True)
class Template(abc.ABC):
    """One kind of kernel and the facts every layer needs about it, so none of them asks for its name.

    Data that differs per kernel is a field; behaviour that differs is a method of the subclass
    (PythonTemplate, NodeTemplate). A new kernel is one subclass and one entry in TEMPLATES.
    """

    name: str
    language: str
    display_name: str
    ipc_port_separator: str  # how the kernel joins its ipc path and port; jupyter_client uses "-"
    speaks_curve: bool  # the kernel can encrypt its channels (CurveZMQ): ipykernel can, tslab cannot
    # RLIMIT_DATA is a useful memory cap: CPython allocates as it goes; V8 reserves a huge heap up front.
    data_limit_caps_memory: bool
    # Packages install into the sandbox's own directory, which the kernel imports from (pip does; npm is not offered).
    user_packages: bool
    startup_file: str  # the file, in the kernel's own directory, that the kernel runs before anything else
    image_setting: str  # the MsbSettings trait that names its microVM image
    logo_text: str | None  # drawn on a logo at install time; None keeps the kernel's own logos
    # Seconds to wait after an error before the next request: tslab aborts what arrives within 200 ms of one.
    pause_after_error_seconds: float

    @abc.abstractmethod
    def argv(self) -> list[str]:
        """The kernelspec's argv on this host. Called by kernelspecs.kernelspec_for at install time."""

    @abc.abstractmethod
    def guest_argv(self, host_argv: list[str]) -> list[str]:
        """``host_argv`` rewritten for a microVM image, whose runtime is on its PATH. Called by the microsandbox backend."""

    def unavailable_reason(self) -> str | None:
        """Why this host cannot run the kernel, with what to do; None when it can. Called by install, doctor and tests."""
        return None

    def unix_sockets_argv(self, argv: list[str], pipe_path: str) -> list[str]:
        """``argv`` for a kernel whose every socket must be a Unix socket of its own sandbox (runsc checkpoints no TCP
        socket of this kind); pipe_path: where the kernel may put sockets of its own making. Called by the gVisor
        backend under its tcp transport."""
        return argv

    @abc.abstractmethod
    def startup_code(self, out_of_memory_message: str, guest_dir: str) -> str:
        """What ``startup_file`` holds; guest_dir: where the guest sees it and ``helper_files``. Called by the provisioner
        before each start."""

    def helper_files(self) -> dict[str, str]:
        """Files beside ``startup_file`` that the kernel's own code runs, by name. Called by the provisioner before each start."""
        return {}

    def launch_arguments(self, startup_path: str) -> list[str]:
        """Arguments added to the kernelspec's argv at each start: the startup file, and settings that suit a sandbox.
        Called by the provisioner."""
        return []

    def kernel_env(self, memory_mib: int, startup_path: str) -> dict[str, str]:
        """Variables the kernel needs inside the sandbox for the flavor's memory. Called by the provisioner."""
        return {}

    def readonly_paths(self) -> list[str]:
        """Host paths the kernel needs, shown read-only in a namespace sandbox. Called by the provisioner."""
        return []

    def warm_up_code(self) -> str | None:
        """A silent cell (no execution count, history, output or variable) that the warm pool runs in each kernel it
        holds, so that a session's first cell does not pay for what the kernel builds at its first execution; None
        to run nothing. Called by msb_kernels.provisioning.pool."""
        return None

    def hand_out_code(self, working_dir: str | None) -> str | None:
        """A silent cell that the warm pool runs in a kernel it hands out, once the person's directories are shown:
        what a fresh start of theirs would have had from its first instruction (its working directory). None to run
        nothing. Called by msb_kernels.provisioning.pool."""
        return None

    @abc.abstractmethod
    def command_code(self, argv: list[str], marker: str) -> str:
        """Code for an execute request that runs ``argv`` and prints ``marker:<exit status>`` last.

        Called by mcp_bridge's execute_command. The user's variables and history stay as they were.
        """

    def file_step_code(self, request: dict, marker: str) -> str | None:
        """Code for an execute request that does one step of a file transfer (mcp_bridge.files) and prints its answer
        as a JSON line, then ``marker:0``; None where this language's kernels cannot move files yet.

        Called by mcp_bridge's upload_file and download_file. The user's variables and history stay as they were."""
        return None

    @abc.abstractmethod
    def error_of(self, reply_error: dict, stderr: str) -> KernelError:
        """What a failed execution was. Called by mcp_bridge when a reply's status is "error".

        reply_error: the error the kernel reported (ename, evalue), from its error message or reply;
        stderr: what the execution wrote there.
        """


PIP_RUNNER_FILE = "msb_pip.py"  # pip for a person's own packages (kernel_code.PYTHON_PIP_RUNNER)
IN_MEMORY_HISTORY = ":memory:"  # sqlite's name for a database in memory, which IPython's HistoryManager accepts


class PythonTemplate(Template):
    def argv(self) -> list[str]:
        return [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]

    def guest_argv(self, host_argv: list[str]) -> list[str]:
        return ["python3", *host_argv[1:]]

    def unix_sockets_argv(self, argv: list[str], pipe_path: str) -> list[str]:
        for at in range(len(argv) - 1):
            if argv[at : at + 2] == ["-m", "ipykernel_launcher"]:
                launcher = kernel_code.PYTHON_UNIX_PIPE_LAUNCHER.replace("PIPE_PATH", repr(pipe_path))
                return [*argv[:at], "-c", launcher, *argv[at + 2 :]]
        return argv

    def startup_code(self, out_of_memory_message: str, guest_dir: str) -> str:
        return "\n\n".join(
            [
                kernel_code.PYTHON_MEMORY_HINT.format(message=out_of_memory_message),
                kernel_code.PYTHON_QUICK_FLUSH,
                kernel_code.PYTHON_USER_PACKAGES.format(runner=f"{guest_dir}/{PIP_RUNNER_FILE}"),
            ]
        )

    def helper_files(self) -> dict[str, str]:
        return {PIP_RUNNER_FILE: kernel_code.PYTHON_PIP_RUNNER}

    def launch_arguments(self, startup_path: str) -> list[str]:
        # IPython's history database would live in the sandbox's home, which goes with the sandbox (a restart gets a
        # new one), so no later kernel could read it. In memory, %history, search and the frontends' history requests
        # work as before, and a start saves the file's creation and its writer thread: 4 to 8 ms.
        return [f"--IPKernelApp.exec_files={startup_path}", f"--HistoryManager.hist_file={IN_MEMORY_HISTORY}"]

    def warm_up_code(self) -> str:
        # IPython builds its display formatters at the first result it shows: 9 ms of a first `1+1` here.
        return "get_ipython().display_formatter.format(None)"

    def hand_out_code(self, working_dir: str | None) -> str:
        # The person's own packages too: the startup put their site on sys.path, but read its .pth files only where it
        # was there, and the import system noted it missing. Its own globals, as command_code's.
        source = kernel_code.PYTHON_HAND_OUT + f"\nhand_out({working_dir!r})\n"
        return f"exec(compile({source!r}, '<msb-hand-out>', 'exec'), {{'__name__': '__msb_hand_out__'}})"

    def command_code(self, argv: list[str], marker: str) -> str:
        # Its own globals dict, so the runner's names never land in the user's namespace.
        source = kernel_code.PYTHON_COMMAND_RUNNER + f"\nrun({list(argv)!r}, {marker!r})\n"
        return f"exec(compile({source!r}, '<msb-command>', 'exec'), {{'__name__': '__msb_command__'}})"

    def file_step_code(self, request: dict, marker: str) -> str:
        source = kernel_code.PYTHON_FILE_STEP.replace("_msb_file_step(REQUEST, MARKER)", f"_msb_file_step({request!r}, {marker!r})")
        return f"exec(compile({source!r}, '<msb-file>', 'exec'), {{'__name__': '__msb_file__'}})"

    def error_of(self, reply_error: dict, stderr: str) -> KernelError:
        ename = reply_error.get("ename") or "Error"
        evalue = strip_ansi(str(reply_error.get("evalue") or ""))
        message = f"{ename}: {evalue}" if evalue else ename
        kind = {
            "SyntaxError": ErrorKind.COMPILE,
            "IndentationError": ErrorKind.COMPILE,
            "TabError": ErrorKind.COMPILE,
            "KeyboardInterrupt": ErrorKind.INTERRUPT,
            "MemoryError": ErrorKind.OUT_OF_MEMORY,
        }.get(ename, ErrorKind.RUNTIME)
        return KernelError(kind, message)


# tslab reports compile diagnostics as "line:col - message" before anything runs, and runtime errors only on stderr.
TS_DIAGNOSTIC = re.compile(r"^(?:\S+ )?\d+:\d+ - .+$", re.M)
JS_ERROR_LINE = re.compile(r"^(?:Uncaught )?([A-Z]\w*(?:Error|Exception)|Error)\b:? ?(.*)$", re.M)


class NodeTemplate(Template):
    def hand_out_code(self, working_dir: str | None) -> str | None:
        return f"process.chdir({json.dumps(working_dir)});" if working_dir is not None else None

    def argv(self) -> list[str]:
        return [node_binary() or "node", str(tslab_entry()), "kernel", "--config-path", "{connection_file}", "--js"]

    def guest_argv(self, host_argv: list[str]) -> list[str]:
        rest = host_argv[host_argv.index("kernel") :] if "kernel" in host_argv else host_argv[2:]
        return ["tslab", *rest]

    def unavailable_reason(self) -> str | None:
        if node_binary() is None:
            return "node is not installed on this machine (install Node.js >= 18, then run `msb-kernels install` again)"
        if not tslab_entry().exists():
            return "tslab is not installed; run `msb-kernels install` (it installs tslab with npm)"
        return None

    def startup_code(self, out_of_memory_message: str, guest_dir: str) -> str:
        return kernel_code.NODE_ROUTER_HANDOVER

    def kernel_env(self, memory_mib: int, startup_path: str) -> dict[str, str]:
        # V8 would grow its heap past the flavor's memory and be killed; --require loads the startup file before tslab.
        return {"NODE_OPTIONS": f"--max-old-space-size={memory_mib * 3 // 4} --require={startup_path}"}

    def readonly_paths(self) -> list[str]:
        paths = [str(node_prefix())]
        node = node_binary()
        if node:
            real_prefix = Path(os.path.realpath(node)).parent.parent
            if not str(real_prefix).startswith("/usr"):
                paths.append(str(real_prefix))
        return paths

    def command_code(self, argv: list[str], marker: str) -> str:
        return kernel_code.NODE_COMMAND_RUNNER.replace("MARKER", json.dumps(marker)).replace("ARGV", json.dumps(list(argv)))

    def error_of(self, reply_error: dict, stderr: str) -> KernelError:
        stderr = strip_ansi(stderr)
        if diagnostics := TS_DIAGNOSTIC.findall(stderr):
            return KernelError(ErrorKind.COMPILE, "the code did not compile: " + "; ".join(d.strip() for d in diagnostics[:5]))
        match = JS_ERROR_LINE.search(stderr)
        message = match.group(0).strip() if match else (stderr.strip().splitlines() or ["the code raised an error"])[-1]
        if match and match.group(1) == "SyntaxError":
            return KernelError(ErrorKind.COMPILE, message)
        return KernelError(ErrorKind.RUNTIME, message)


TEMPLATES: dict[str, Template] = {
    "python": PythonTemplate(
        "python",
        "python",
        "Python 3",
        ipc_port_separator="-",
        speaks_curve=True,
        data_limit_caps_memory=True,
        user_packages=True,
        startup_file="msb_startup.py",
        image_setting="python_image",
        logo_text=None,
        pause_after_error_seconds=0.0,
    ),
    "node": NodeTemplate(
        "node",
        "javascript",
        "JavaScript (Node.js)",
        ipc_port_separator=":",
        speaks_curve=False,
        data_limit_caps_memory=False,
        user_packages=False,
        startup_file="msb_startup.js",
        image_setting="node_image",
        logo_text="JS",
        pause_after_error_seconds=0.3,
    ),
}

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def strip_ansi(text: str) -> str:
    return ANSI.sub("", text)


LANGUAGE_ALIASES = {"python": "python", "python3": "python", "py": "python", "node": "node", "javascript": "node", "js": "node"}


def get_template(name: str, *, argument: str = "language") -> Template:
    key = LANGUAGE_ALIASES.get(str(name).strip().lower())
    if key is None:
        raise InvalidRequest(f"{argument}={name!r} is not supported; use one of {', '.join(LANGUAGE_ALIASES)}")
    return TEMPLATES[key]


def node_binary() -> str | None:
    return shutil.which("node")


def tslab_entry() -> Path:
    return node_prefix() / "node_modules" / "tslab" / "bin" / "tslab"


def _link_tslab_types() -> None:
    """tslab looks for @types/node under its own node_modules; npm flattens it one level up.

    Inside a sandbox the kernel's cwd has no node_modules, so without this link even
    `console.log` fails to type-check.
    """
    nested = tslab_entry().parent.parent / "node_modules" / "@types"
    if not nested.exists():
        nested.parent.mkdir(exist_ok=True)
        nested.symlink_to(os.path.relpath(node_prefix() / "node_modules" / "@types", nested.parent))


def install_tslab() -> str:
    """Install tslab with npm into node_prefix(); idempotent. Returns what happened."""
    if node_binary() is None:
        return "skipped node kernels: node is not installed (Python kernels are unaffected)"
    if tslab_entry().exists():
        _link_tslab_types()
        return f"tslab already installed in {node_prefix()}"
    npm = shutil.which("npm")
    if npm is None:
        return "skipped node kernels: npm is not installed (install npm, then run `msb-kernels install` again)"
    try:
        node_prefix().mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"skipped node kernels: cannot create {node_prefix()} ({exc.strerror}); run `msb-kernels install` as the environment's owner"
    result = subprocess.run(
        [npm, "install", "--no-audit", "--no-fund", "--prefix", str(node_prefix()), f"tslab@{TSLAB_VERSION}"],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        return f"skipped node kernels: npm install tslab failed: {result.stderr.strip()[-500:]}"
    _link_tslab_types()
    return f"installed tslab {TSLAB_VERSION} in {node_prefix()}"
