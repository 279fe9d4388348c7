"""The environments' store: ``environments.json`` in MSB_ENVIRONMENTS_DIR, which created environments live in too.

The gateway, `msb-kernels install`, `msb-kernels env` and the MCP tools all read this one file; it is replaced
whole on each change, so no reader ever sees half of it and a failed command leaves the previous one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from msb_kernels.environments.environment import Environment
from msb_kernels.errors import ConfigError
from msb_kernels.settings.config import MsbSettings

STORE_FILE = "environments.json"
FORMAT = 1


class EnvironmentStore:
    def __init__(self, directory: Path):
        self.directory = Path(directory)

    @classmethod
    def of(cls, settings: MsbSettings) -> EnvironmentStore:
        return cls(settings.environments_root())

    @property
    def path(self) -> Path:
        return self.directory / STORE_FILE

    def created_dir(self, name: str) -> Path:
        """Where `env create NAME` builds its venv."""
        return self.directory / name

    def load(self) -> dict[str, Environment]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"MSB_ENVIRONMENTS_DIR: cannot read {self.path}: {exc}",
                [f"fix or remove {self.path}; then add the environments again with `msb-kernels env add`"],
            ) from None
        return {record["name"]: Environment.from_json(record) for record in data.get("environments", [])}

    def get(self, name: str) -> Environment | None:
        return self.load().get(name)

    def save(self, environments: dict[str, Environment]) -> None:
        """Replace the file whole (write a temporary file beside it, then rename)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        text = json.dumps(
            {"format": FORMAT, "environments": [e.to_json() for e in sorted(environments.values(), key=lambda e: e.name)]}, indent=1
        )
        fd, temporary = tempfile.mkstemp(prefix=".environments-", dir=self.directory)
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
            os.chmod(temporary, 0o644)  # the gateway's and the kernels' readers need not be its writer
            os.replace(temporary, self.path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """One change at a time: two `env add`s at once would each write the file without the other's environment."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def put(self, environment: Environment) -> None:
        with self._locked():
            environments = self.load()
            environments[environment.name] = environment
            self.save(environments)

    def drop(self, name: str) -> None:
        with self._locked():
            environments = self.load()
            environments.pop(name, None)
            self.save(environments)


def list_environments(settings: MsbSettings) -> list[Environment]:
    """Every registered environment, by name: for `env list`, the MCP tools and a launcher."""
    return sorted(EnvironmentStore.of(settings).load().values(), key=lambda e: e.name)
