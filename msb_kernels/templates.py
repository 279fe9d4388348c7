"""Templates: which kernel runs in a sandbox (python or node), and what it needs from the host."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from msb_kernels.errors import InvalidRequest

TSLAB_VERSION = "1.0.22"


def node_prefix() -> Path:
    """Where `msb-kernels install` puts tslab: inside the environment, so sandboxes can see it."""
    return Path(sys.prefix) / "share" / "msb-kernels" / "node"


@dataclass(frozen=True)
class Template:
    name: str
    language: str
    display_name: str
    file_extension: str
    ipc_port_separator: str  # how the kernel joins its ipc path and port; jupyter_client uses "-"

    def argv(self) -> list[str]:
        if self.name == "python":
            return [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        return [node_binary() or "node", str(tslab_entry()), "kernel", "--config-path", "{connection_file}", "--js"]

    def unavailable_reason(self) -> str | None:
        if self.name == "python":
            return None
        if node_binary() is None:
            return "node is not installed on this machine (install Node.js >= 18, then run `msb-kernels install` again)"
        if not tslab_entry().exists():
            return "tslab is not installed; run `msb-kernels install` (it installs tslab with npm)"
        return None

    def readonly_paths(self) -> list[str]:
        if self.name == "python":
            return []
        paths = [str(node_prefix())]
        node = node_binary()
        if node:
            real_prefix = Path(os.path.realpath(node)).parent.parent
            if not str(real_prefix).startswith("/usr"):
                paths.append(str(real_prefix))
        return paths


TEMPLATES: dict[str, Template] = {
    "python": Template("python", "python", "Python 3", ".py", "-"),
    "node": Template("node", "javascript", "JavaScript (Node.js)", ".js", ":"),
}
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
    result = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(node_prefix()), f"tslab@{TSLAB_VERSION}"],
                            capture_output=True, text=True)
    if result.returncode != 0:
        return f"skipped node kernels: npm install tslab failed: {result.stderr.strip()[-500:]}"
    _link_tslab_types()
    return f"installed tslab {TSLAB_VERSION} in {node_prefix()}"
