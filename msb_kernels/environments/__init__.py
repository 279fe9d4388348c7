"""Environments: named Python interpreters with their own packages, outside the gateway's venv.

A record per environment (``record.py``), one JSON store of them (``store.py``), what an interpreter
is and holds (``interpreters.py``), a venv built from a requirements file (``building.py``), the
kernelspecs each gets (``kernelspecs.py``), and the kernels that use one (``usage.py``).
"""

from msb_kernels.environments.record import Environment
from msb_kernels.environments.store import EnvironmentStore, list_environments

__all__ = ["Environment", "EnvironmentStore", "list_environments"]
