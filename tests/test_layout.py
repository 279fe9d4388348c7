"""The shape of the code (issue 26): no import cycles between modules, and no arrow from the MCP bridge into the
gateway. A module is as long as its one concept needs: lines are not concepts (issue 37)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

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
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
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


# The namespace init is a standard-library script (it runs before and inside the sandbox): its netlink reader of the
# host's addresses belongs to no layer, and the egress policy reads them with it rather than with a second copy.
LAYER_NEUTRAL = {"msb_kernels.backends.namespace.init_program"}


def test_egress_never_imports_the_backends():
    """Egress sits below the backends: they carry its EgressRoute in a SandboxSpec, and it knows none of them."""
    arrows = sorted((name, target) for name, targets in imports().items() for target in targets)
    upward = [a for a in arrows if a[0].startswith("msb_kernels.egress") and a[1].startswith("msb_kernels.backends")]
    assert [a for a in upward if a[1] not in LAYER_NEUTRAL] == []
