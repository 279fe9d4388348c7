"""Which image a kernel runs where kernels run an image (Docker Swarm, microVMs), and its command inside it.

The default environment's kernels run the template's image (MSB_PYTHON_IMAGE) and its own python3. An environment's
run the image `msb-kernels image build python --env NAME` made for it, named in its record, which holds the
environment's interpreter at the path it has on the host: its kernelspec's argv stays as it is.
"""

from __future__ import annotations

from msb_kernels.environments.store import EnvironmentStore
from msb_kernels.errors import InvalidRequest
from msb_kernels.images import image_for
from msb_kernels.kernelspecs.choice import DEFAULT_ENVIRONMENT
from msb_kernels.kernelspecs.templates import TEMPLATES
from msb_kernels.settings.config import MsbSettings


def default_tag(settings: MsbSettings, name: str) -> str:
    """The tag `image build python --env NAME` gives an environment's image unless --tag names another: the python
    image's repository with "-NAME" (msb-kernels/python-NAME:latest), which the Swarm API proxy admits as a kernel's."""
    repository = settings.python_image.partition("@")[0]
    if repository.rfind(":") > repository.rfind("/"):  # a tag, not a registry's port
        repository = repository.rpartition(":")[0]
    return f"{repository}-{name}:latest"


def build_command(name: str) -> str:
    return f"msb-kernels image build python --env {name}"


def is_default(environment: str | None) -> bool:
    return environment in (None, "", DEFAULT_ENVIRONMENT)


def kernel_image(settings: MsbSettings, template: str, environment: str | None = None) -> str:
    """The image a kernel of template and environment runs; InvalidRequest, naming the command that builds one, for an
    environment that has none."""
    if is_default(environment):
        return image_for(settings, template)
    record = EnvironmentStore.of(settings).get(str(environment))
    if record is None:
        raise InvalidRequest(
            f"environment {environment!r} is not registered here ({EnvironmentStore.of(settings).path})",
            ["`msb-kernels env list` shows the environments", "add it with `msb-kernels env add` or `env create`"],
        )
    if not record.image:
        raise InvalidRequest(
            f"environment {environment} has no kernel image, and this backend's kernels run one: "
            f"build it with `{build_command(str(environment))}`",
            [
                f"`{build_command(str(environment))} --engine docker` on each Swarm node (or --save-archive and `docker load`)",
                "or run its kernels with MSB_BACKEND=namespace or gvisor, which show its interpreter by path",
            ],
        )
    return record.image


def kernel_argv(template: str, argv: list[str], environment: str | None = None) -> list[str]:
    """The kernel command inside its image: the default image's python3 (or tslab), or an environment's interpreter at
    its host path, where its image holds it."""
    return TEMPLATES[template].guest_argv(list(argv)) if is_default(environment) else list(argv)


def missing_image_advice(settings: MsbSettings, template: str, environment: str | None) -> str:
    """What to do where a node or host lacks the kernel's image."""
    if is_default(environment):
        return f"build the image: `msb-kernels image build {template}` (or load {image_for(settings, template)} where kernels run)"
    return f"build the environment's image where its kernels run: `{build_command(str(environment))}`"
