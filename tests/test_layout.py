"""The shape of the code (issue 26): no import cycles between modules, and no arrow from the MCP bridge into the
gateway. A module is as long as its one concept needs: lines are not concepts (issue 37)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.conftest import REPO
from tests.parallel import UNIT

pytestmark = UNIT  # starts no process

PACKAGES = ("msb_kernels", "mcp_bridge")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports() -> dict[str, set[str]]:
    """Each module's imports of the project's modules, function-level ones included."""
    found = modules()
    edges: dict[str, set[str]] = {name: set() for name in found}
    for name, path in found.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from package import module` uses the module; the package only where a name is not a module of it
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in found else node.module for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                while target and target not in found:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[name].add(target)
    return edges


def test_no_module_imports_itself_through_others():
    edges = imports()
    visiting: list[str] = []
    done: set[str] = set()

    def visit(name: str) -> None:
        if name in visiting:
            raise AssertionError("import cycle: " + " -> ".join([*visiting[visiting.index(name) :], name]))
        if name in done:
            return
        visiting.append(name)
        for target in sorted(edges[name]):
            visit(target)
        visiting.pop()
        done.add(name)

    for name in sorted(edges):
        visit(name)


def test_the_mcp_bridge_never_imports_the_gateway():
    arrows = sorted((name, target) for name, targets in imports().items() for target in targets)
    assert [a for a in arrows if a[0].startswith("mcp_bridge") and a[1].startswith("msb_kernels.gateway")] == []


def test_egress_never_imports_the_backends():
    """Egress sits below the backends: they carry its EgressRoute in a SandboxSpec, and it knows none of them."""
    arrows = sorted((name, target) for name, targets in imports().items() for target in targets)
    assert [a for a in arrows if a[0].startswith("msb_kernels.egress") and a[1].startswith("msb_kernels.backends")] == []


# The layers, from the ground up. A module's layer is that of the longest name here that it is or is inside of.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "ground: errors; what a kernel is (its template, code, flavor and choice); what is reported; where the Jupyter "
        "servers are met; the sandboxes a manager counts and their limit; the checks of single settings",
        (
            "msb_kernels",
            "msb_kernels.errors",
            "msb_kernels.kernelspecs",
            "msb_kernels.observability",
            "msb_kernels.jupyter",
            "msb_kernels.provisioning.registry",
            "msb_kernels.provisioning.limits",
            "msb_kernels.settings.value_checks",
        ),
    ),
    (
        "people: who asks, what one start asks for, the audit trail",
        ("msb_kernels.identity", "msb_kernels.provisioning.start_request", "msb_kernels.observability.audit"),
    ),
    ("egress: the way out of a sandbox", ("msb_kernels.egress",)),
    ("settings", ("msb_kernels.settings", "msb_kernels.provisioning.probe_verdicts")),
    (
        "what kernels run: kernelspec files, images, environments' records",
        ("msb_kernels.kernelspecs.spec_files", "msb_kernels.images", "msb_kernels.environments"),
    ),
    ("sandboxes: the backends", ("msb_kernels.backends",)),
    (
        "kernels in sandboxes: provisioning (the provisioner, the pool, the probe, a Lab's root), the Jupyter internals "
        "touched, a Lab in front, and the commands that start sandboxes",
        (
            "msb_kernels.provisioning",
            "msb_kernels.jupyter.compat",
            "msb_kernels.jupyterlab",
            "msb_kernels.environments.commands",
            "msb_kernels.environments.image_build",
            "msb_kernels.environments.usage",
        ),
    ),
    ("the MCP bridge", ("mcp_bridge",)),
    ("the gateway", ("msb_kernels.gateway",)),
    (
        "commands",
        (
            "msb_kernels.cli",
            "msb_kernels.gateway.serve_command",
            "msb_kernels.environments.env_command",
            "msb_kernels.identity.users_command",
        ),
    ),
]


def layer_of(module: str) -> int:
    matches = [
        (len(prefix), index)
        for index, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert matches, f"{module} is in no layer of tests/test_layout.py: add it to the one it belongs to"
    return max(matches)[1]


def test_no_import_runs_back_up_the_layers():
    """A module imports only from its own layer and those below (issue 47). The namespace init reads the stdlib files
    it shares (egress/netlink.py, egress/relay_program.py, core/guest.py) by path: no import, and none here."""
    edges = imports()
    upward = [
        f"{name} ({LAYERS[layer_of(name)][0]}) -> {target} ({LAYERS[layer_of(target)][0]})"
        for name, targets in sorted(edges.items())
        for target in sorted(targets)
        if layer_of(target) > layer_of(name)
    ]
    assert upward == []
    print(f"{len(edges)} modules in {len(LAYERS)} layers, {sum(map(len, edges.values()))} imports, 0 back up")


def test_the_layers_name_only_modules_that_exist():
    names = modules()
    assert [p for _, prefixes in LAYERS for p in prefixes if p not in names] == []


def test_the_readme_map_names_only_what_exists():
    """Every path in the first column of the README's "Where things are" (after the first: beside it), and
    every module its second column names, somewhere in that row's folder."""
    text = (REPO / "README.md").read_text()
    table = text[text.index("## Where things are") :].split("\n## ", 1)[0]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) > 10, "the README's map has lost its table"
    missing = []
    for where, what, *_ in rows:
        named = re.findall(r"`([^`]+)`", where)
        first = REPO / named[0]
        folder = first if named[0].endswith("/") else first.parent
        missing += [name for name in named if not (folder / name).exists() and not (REPO / name).exists()]
        for module in re.findall(r"`([\w/]+\.py)`", what):
            if not list(folder.rglob(module)) and not (REPO / module).exists():
                missing.append(f"{module} (in the row of {named[0]})")
    assert missing == []


def test_the_readme_is_a_front_door():
    """At most 350 lines (issue 47): what a newcomer needs first, and links to docs/ for the rest."""
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= 350, f"the README has {lines} lines: move the detail into docs/ and link to it"


def test_the_readme_map_names_every_package_and_top_level_module():
    """The map matches the tree (issue 47): each package of msb_kernels, and each module left at its top, has a row
    (a row's first column names it, as `msb_kernels/<name>/` or `msb_kernels/<name>.py`)."""
    text = (REPO / "README.md").read_text()
    table = text[text.index("## Where things are") :].split("\n## ", 1)[0]
    named = {name for line in table.splitlines() if line.startswith("| `") for name in re.findall(r"`([^`]+)`", line.split(" | ")[0])}
    root = REPO / "msb_kernels"
    parts = [f"msb_kernels/{p.name}/" for p in root.iterdir() if (p / "__init__.py").exists()]
    parts += [f"msb_kernels/{p.name}" for p in root.glob("*.py") if p.name != "__init__.py"]
    assert sorted(p for p in parts if not any(name.startswith(p) for name in named)) == []


def test_the_architecture_package_table_matches_the_packages():
    """docs/architecture.md's table of msb_kernels' packages names each package once, and only packages that exist."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text[text.index("## Where things are") :].split("\n## ", 1)[0]
    named = [
        name.rstrip("/")
        for line in section.splitlines()
        if line.startswith("| `")
        for name in re.findall(r"`([\w]+/)`", line.split(" | ")[0])
    ]
    packages = sorted(p.name for p in (REPO / "msb_kernels").iterdir() if (p / "__init__.py").exists())
    assert sorted(named) == packages
