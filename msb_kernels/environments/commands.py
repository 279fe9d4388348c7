"""What `msb-kernels env` does: add, create, list, check and remove environments, each losing nothing on failure.

Each returns the lines to print; a refusal is an InvalidRequest naming the argument and what to do.
"""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import datetime, timezone
from pathlib import Path

from jupyter_client.kernelspec import KernelSpecManager

from msb_kernels.environments import building, environment_kernelspecs, interpreters
from msb_kernels.environments.environment import ADDED, CREATED, Environment
from msb_kernels.environments.kernel_images import build_command
from msb_kernels.environments.store import EnvironmentStore, list_environments
from msb_kernels.environments.usage import kernels_using
from msb_kernels.errors import InvalidRequest, MsbError
from msb_kernels.kernelspecs.choice import ENVIRONMENT_NAME, RESERVED_ENVIRONMENT_NAMES
from msb_kernels.kernelspecs.templates import LANGUAGE_ALIASES
from msb_kernels.settings.config import MsbSettings


def check_new_name(name: str, store: EnvironmentStore) -> None:
    """A name free for a new environment: well formed, no template or flavor, no kernelspec's, no environment's."""
    if not ENVIRONMENT_NAME.match(name):
        raise InvalidRequest(
            f"NAME {name!r}: use lowercase letters, digits and '-' (at most 40, not starting or ending with '-')",
            ["e.g. `msb-kernels env add data-science --python ...`"],
        )
    if name in RESERVED_ENVIRONMENT_NAMES or name in LANGUAGE_ALIASES:
        raise InvalidRequest(f"NAME {name!r} is a template, a flavor or the default environment's name", ["pick another name"])
    if store.get(name) is not None:
        raise InvalidRequest(
            f"NAME {name!r}: an environment of that name exists", [f"`msb-kernels env remove {name}` first, or pick another name"]
        )
    found = KernelSpecManager().find_kernel_specs()
    clashes = sorted(k for k in found if k == name or k in {c.kernel_name for c in environment_kernelspecs.choices(name)})
    if clashes:
        raise InvalidRequest(
            f"NAME {name!r} clashes with the installed kernelspec {', '.join(clashes)} ({found[clashes[0]]})",
            ["pick another name", f"or remove that kernelspec: `jupyter kernelspec remove {clashes[0]}`"],
        )


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _register(environment: Environment, store: EnvironmentStore, settings: MsbSettings, prefix: str | None, user: bool) -> list[str]:
    """The kernelspecs first, then the record: a failure between takes back the kernelspecs."""
    try:
        lines = environment_kernelspecs.install(environment, settings, prefix, user)
        store.put(environment)
    except BaseException:
        environment_kernelspecs.remove(environment.name)
        raise
    return lines


def add(name: str, python: str, settings: MsbSettings, prefix: str | None = None, user: bool = False) -> list[str]:
    store = EnvironmentStore.of(settings)
    check_new_name(name, store)
    interpreter = interpreters.checked(python)
    environment = Environment(name, interpreter.path, ADDED, now(), interpreter.version, interpreter.packages)
    lines = _register(environment, store, settings, prefix, user)
    return [f"added environment {name}: Python {interpreter.version} at {interpreter.path}, {len(interpreter.packages)} packages", *lines]


def create(
    name: str, requirements: Path, settings: MsbSettings, wheels: Path | None = None, prefix: str | None = None, user: bool = False
) -> list[str]:
    store = EnvironmentStore.of(settings)
    check_new_name(name, store)
    directory = store.created_dir(name)
    built = building.build(directory, requirements, wheels)
    try:
        interpreter = interpreters.checked(built.python, "the new environment's python")
        environment = Environment(name, interpreter.path, CREATED, now(), interpreter.version, interpreter.packages)
        lines = _register(environment, store, settings, prefix, user)
    except BaseException:
        building.shutil.rmtree(directory, ignore_errors=True)
        raise
    installed = ", ".join(environment.main_packages(limit=40)) or "only the kernel's own packages"
    return [
        f"created environment {name} in {directory} with {built.installer} in {built.seconds:.1f} s"
        + (f" (offline, from {wheels})" if wheels else ""),
        f"  Python {interpreter.version}, {len(interpreter.packages)} packages: {installed} (and ipykernel {interpreter.ipykernel})",
        *lines,
    ]


def describe(environment: Environment) -> str:
    packages = ", ".join(environment.main_packages()) or "no packages beyond the kernel's"
    image = (
        f"  image {environment.image}" if environment.image else f"  no image for Swarm or microVMs (`{build_command(environment.name)}`)"
    )
    line = f"{environment.name}  Python {environment.python_version}  {environment.origin} {environment.created_at}  {environment.python}"
    return f"{line}  [{packages}]{image}"


def list_lines(settings: MsbSettings) -> list[str]:
    environments = list_environments(settings)
    if not environments:
        return [
            f"no environments (the store is {EnvironmentStore.of(settings).path}); add one with `msb-kernels env add NAME --python PATH`"
        ]
    return [describe(e) for e in environments]


def get(name: str, settings: MsbSettings, argument: str = "NAME") -> Environment:
    environment = EnvironmentStore.of(settings).get(name)
    if environment is None:
        names = ", ".join(e.name for e in list_environments(settings)) or "none yet"
        raise InvalidRequest(f"{argument} {name!r}: no such environment (registered: {names})", ["`msb-kernels env list` shows them"])
    return environment


def remove(name: str, settings: MsbSettings) -> list[str]:
    store = EnvironmentStore.of(settings)
    environment = get(name, settings)
    using = kernels_using(name, settings)
    if using:
        raise InvalidRequest(
            f"environment {name} is in use by {len(using)} live kernel(s): {', '.join(using)}",
            ["shut those kernels down (or wait for them to be culled), then remove it again"],
        )
    lines = environment_kernelspecs.remove(name)
    store.drop(name)
    if environment.origin == CREATED and Path(environment.python).is_relative_to(store.created_dir(name)):
        building.shutil.rmtree(store.created_dir(name), ignore_errors=True)
        lines.append(f"removed its venv {store.created_dir(name)}")
    if environment.image:
        lines.append(f"its image {environment.image} stays where it was loaded: `docker image rm {environment.image}` on each node")
    return [f"removed environment {name}", *lines]


def check(names: list[str], settings: MsbSettings) -> tuple[bool, list[str]]:
    """Each environment's interpreter looked at, then a kernel started from it in every backend that runs here."""
    from msb_kernels.backends import backend_classes
    from msb_kernels.kernelspecs.templates import TEMPLATES
    from msb_kernels.provisioning import probe

    environments = [get(n, settings) for n in names] if names else list_environments(settings)
    lines: list[str] = []
    ok = True
    for environment in environments:
        try:
            interpreter = interpreters.inspect(environment.python, f"environment {environment.name}'s python")
        except MsbError as exc:
            ok = False
            lines.append(f"{environment.name}: broken: {exc.message}")
            continue
        problem = interpreters.kernel_problem(interpreter)
        if problem:
            ok = False
            lines.append(f"{environment.name}: {problem}")
            continue
        looked = dataclasses.replace(environment, python_version=interpreter.version, packages=interpreter.packages)
        EnvironmentStore.of(settings).put(looked)  # what it holds now, for env list, the MCP tools and its kernelspecs
        environment_kernelspecs.refresh(looked)
        lines.append(
            f"{environment.name}: Python {interpreter.version}, ipykernel {interpreter.ipykernel}, {len(interpreter.packages)} packages"
        )
        argv = [environment.python, *TEMPLATES["python"].argv()[1:]]
        for backend, cls in backend_classes().items():
            availability = cls.availability()
            if not availability.ok:
                lines.append(f"  {backend}: not tried: {availability.reason}")
                continue
            try:
                result = asyncio.run(probe.probe(backend, argv, "python", settings, environment.name))
            except MsbError as exc:
                lines.append(f"  {backend}: not tried: {exc.message}")
                continue
            lines.append(f"  {backend}: {'ok' if result.ok else 'failed'}: {result.summary()}")
            if not result.ok:
                ok = False
                lines += [f"    kernel stderr: {line}" for line in result.stderr_tail[-8:]]
    if not environments:
        lines.append("no environments to check")
    return ok, lines
