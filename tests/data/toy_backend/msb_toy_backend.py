"""A backend from another package, as a third party would ship one: this module and one entry point
(msb_toy_backend-0.1.dist-info/entry_points.txt). It runs kernels in namespace sandboxes under its own name,
so the contract suite, which takes its variants from the installed backends, tests it."""

from msb_kernels.backends.namespace.backend import NamespaceBackend


class ToyBackend(NamespaceBackend):
    name = "toy"
    auto_order = 1000  # never what auto picks
    transports = ("ipc",)
