"""The gVisor wing: each kernel in its own ``runsc`` sandbox, behind gVisor's application kernel.

- backend.py: runsc itself: create, restore, adopt and remove a sandbox, and the cgroup around it;
- bundle.py: the OCI bundle, the limits inside gVisor, and pid 1's program;
- sandbox.py: a running (or hibernated) kernel, and its checkpoint and restore;
- netstack.py: the tcp transport over gVisor's own network stack, which a checkpoint can save;
- runsc.py: which runsc runs kernels (this environment's own, installed from Debian 13, before the host's);
- checkpoint_images.py: the images on disk (sealed, counted against a budget), and what would stop a checkpoint.
"""

from msb_kernels.backends.gvisor.backend import GVisorBackend
from msb_kernels.backends.gvisor.bundle import process_limit
from msb_kernels.backends.gvisor.runsc import runsc_path
from msb_kernels.backends.gvisor.sandbox import GVisorSandbox

__all__ = ["GVisorBackend", "GVisorSandbox", "process_limit", "runsc_path"]
