"""Kernel images: what every backend that runs an image (the microVM, the swarm) shares.

rootfs.py makes a Debian root filesystem with the kernel in it; archives.py writes it as a Docker-save archive, which
both `msb load` and `docker load` take; builds.py is `msb-kernels image build` (the kernel images and the swarm
gateway's own). Loading is the engine's: microsandbox/images.py (msb load), cluster/swarm.py (docker load).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from msb_kernels.kernelspecs.templates import TEMPLATES

if TYPE_CHECKING:
    from msb_kernels.settings.config import MsbSettings

GUEST_USER = "sandbox"  # the images' unprivileged user (uid 1000, home /home/sandbox)
GUEST_UID = 1000
GUEST_HOME = "/home/sandbox"
IMAGE_SHARED_DIR = "/shared"  # the kernel user's, empty: a named volume mounted there first takes its owner and mode
GUEST_PATH = "/usr/local/bin:/usr/bin:/bin"
LOCAL_IMAGE_PREFIX = "msb-kernels/"  # images `msb-kernels image build` tags
IMAGE_CURVE_LABEL = "org.msb-kernels.curve"  # "true" when the image's kernel speaks CurveZMQ
TEMPLATE_LABEL = "org.msb-kernels.template"


def image_for(settings: MsbSettings, template: str) -> str:
    """The image a template's kernels run (MSB_PYTHON_IMAGE, MSB_NODE_IMAGE)."""
    return getattr(settings, TEMPLATES[template].image_setting)
