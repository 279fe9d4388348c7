"""Sandboxed, stateful Jupyter kernels: a kernel provisioner that puts every kernel in its own sandbox."""

__version__ = "0.1.0"
