"""One environment: a named interpreter, how it came to be, and what it held when last looked at."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

ADDED = "added"  # an interpreter the operator already had (a venv, a conda env, a pyenv Python)
CREATED = "created"  # a venv msb-kernels built from a requirements file, inside the environments directory

# The packages a listing names first: what a person picks an environment for, not what ipykernel pulls in.
KERNEL_PACKAGES = frozenset(
    {
        "ipykernel", "ipython", "jupyter-client", "jupyter-core", "traitlets", "pyzmq", "tornado", "comm", "debugpy",
        "matplotlib-inline", "nest-asyncio", "nest-asyncio2", "psutil", "packaging", "platformdirs", "decorator", "jedi",
        "parso", "pexpect", "ptyprocess", "prompt-toolkit", "wcwidth", "pygments", "stack-data", "asttokens", "executing",
        "pure-eval", "ipython-pygments-lexers", "python-dateutil", "six", "typing-extensions", "pip", "setuptools", "wheel",
        "exceptiongroup", "appnope",
    }
)  # fmt: skip


@dataclass(frozen=True)
class Package:
    name: str
    version: str


@dataclass(frozen=True)
class Environment:
    """A named interpreter outside the gateway's venv. Its kernelspecs are msb-<name>-python-<flavor>."""

    name: str
    python: str  # the interpreter's absolute path, as the kernelspecs' argv[0] and the sandbox show it
    origin: str  # ADDED or CREATED
    created_at: str  # ISO 8601, UTC
    python_version: str  # "3.11.7"
    packages: tuple[Package, ...] = field(default_factory=tuple)  # what it held when added, created or last checked
    # For engines that run images (Swarm, microVMs): the image built for this environment; None until one is built.
    image: str | None = None

    def main_packages(self, limit: int = 12) -> list[str]:
        """ "pandas 2.2.3"-style names of what the environment is for, without the kernel's own packages."""
        chosen = [p for p in self.packages if p.name.lower().replace("_", "-") not in KERNEL_PACKAGES]
        return [f"{p.name} {p.version}" for p in sorted(chosen, key=lambda p: p.name.lower())[:limit]]

    def to_json(self) -> dict:
        record = asdict(self)
        record["packages"] = [asdict(p) for p in self.packages]
        return record

    @classmethod
    def from_json(cls, record: dict) -> Environment:
        packages = tuple(Package(str(p["name"]), str(p["version"])) for p in record.get("packages") or [])
        return cls(
            name=str(record["name"]),
            python=str(record["python"]),
            origin=str(record.get("origin", ADDED)),
            created_at=str(record.get("created_at", "")),
            python_version=str(record.get("python_version", "")),
            packages=packages,
            image=record.get("image"),
        )
