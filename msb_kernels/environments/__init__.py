"""Environments: named Python interpreters with their own packages, outside the gateway's venv.

A record per environment (``environment.py``), one JSON store of them (``store.py``), what an interpreter
is and holds (``interpreters.py``), a venv built from a requirements file (``building.py``), the
kernelspecs each gets (``environment_kernelspecs.py``), and the kernels that use one (``usage.py``); the
``msb-kernels env`` command (``env_command.py``, with ``commands.py`` doing the work) and images (``image_build.py``,
``kernel_images.py``).
"""

from msb_kernels.environments.environment import Environment
from msb_kernels.environments.store import EnvironmentStore, list_environments

__all__ = ["Environment", "EnvironmentStore", "list_environments"]
