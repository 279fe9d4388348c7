"""The kernel choice: a template (python or node), a flavor and an environment, and the kernelspec name that carries them.

Every layer speaks in choices: a kernelspec is named for one (``msb-python-small``), the MCP tools
resolve their ``language`` and ``flavor`` arguments into one, the pool is sized in them, and the
gateway and the bridge read them back from a kernel's kernelspec name. The name is built and parsed
here and nowhere else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from msb_kernels.errors import ConfigError, InvalidRequest
from msb_kernels.kernelspecs.flavors import FLAVORS, Flavor, get_flavor
from msb_kernels.kernelspecs.templates import TEMPLATES, Template, get_template

KERNEL_NAME_PREFIX = "msb-"
# The environment that needs no name: the gateway's own interpreter, which msb-python-small has always meant.
DEFAULT_ENVIRONMENT = "default"
# An environment's name: a kernelspec name's part, a directory's name and an MCP argument alike. Its last two parts
# in a kernel name are always the template and the flavor, so a name with dashes still parses one way only.
ENVIRONMENT_NAME = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,38}[a-z0-9])?$")
ENVIRONMENT_TEMPLATES = ("python",)  # node kernels run the host's tslab: they have no environments


@dataclass(frozen=True)
class KernelChoice:
    template: Template
    flavor: Flavor
    environment: str | None = None  # None: the default environment (the gateway's own interpreter)

    @property
    def kernel_name(self) -> str:
        """The kernelspec that starts this choice: ``msb-<template>-<flavor>``, or ``msb-<env>-<template>-<flavor>``."""
        environment = f"{self.environment}-" if self.environment else ""
        return f"{KERNEL_NAME_PREFIX}{environment}{self.template.name}-{self.flavor.name}"

    @property
    def environment_name(self) -> str:
        return self.environment or DEFAULT_ENVIRONMENT

    @classmethod
    def of(cls, template: str, flavor: str, environment: str | None = None) -> KernelChoice:
        """From names a caller gave (aliases allowed); unknown ones raise InvalidRequest naming the accepted values."""
        chosen = get_template(template, argument="template")
        if environment in (None, DEFAULT_ENVIRONMENT):
            return cls(chosen, get_flavor(flavor))
        if chosen.name not in ENVIRONMENT_TEMPLATES:
            raise InvalidRequest(f"environment={environment!r} holds Python packages; {chosen.name} kernels have no environments")
        return cls(chosen, get_flavor(flavor), environment)

    @classmethod
    def from_kernel_name(cls, name: str | None) -> KernelChoice | None:
        """The choice an msb kernelspec name encodes; None for any other kernel (e.g. a plain ``python3``)."""
        if not name or not name.startswith(KERNEL_NAME_PREFIX):
            return None
        parts = name[len(KERNEL_NAME_PREFIX) :].split("-")
        if len(parts) < 2:
            return None
        *environment, template, flavor = parts
        if template not in TEMPLATES or flavor not in FLAVORS:
            return None
        if not environment:
            return cls(TEMPLATES[template], FLAVORS[flavor])
        joined = "-".join(environment)
        if template not in ENVIRONMENT_TEMPLATES or not ENVIRONMENT_NAME.match(joined) or joined in RESERVED_ENVIRONMENT_NAMES:
            return None
        return cls(TEMPLATES[template], FLAVORS[flavor], joined)

    def __str__(self) -> str:
        environment = f"{self.environment}-" if self.environment else ""
        return f"{environment}{self.template.name}-{self.flavor.name}"


# Names an environment may not have: they read as a template, a flavor or the default in a kernel name or argument.
RESERVED_ENVIRONMENT_NAMES = frozenset({DEFAULT_ENVIRONMENT, *TEMPLATES, *FLAVORS, "python3", "javascript", "js", "py"})


# The names notebooks from elsewhere carry in their metadata (ipykernel's python3, IJavascript's and tslab's),
# and the template each means. The gateway serves each as its kernelspec of the default flavor, so such a
# notebook opens in a sandbox without a kernel-picker dialog. Locally they stay the user's own kernelspecs.
DEFAULT_TEMPLATE = "python"  # the gateway's default kernel is this template's, of MSB_DEFAULT_FLAVOR
CONVENTIONAL_NAMES = {"python3": "python", "python": "python", "javascript": "node", "jslab": "node", "nodejs": "node"}


# The one conventional name of each template that is listed (a launcher card), in place of the kernelspec of the
# default flavor it stands for; the others start kernels too, unlisted.
LISTED_NAMES = {template: name for name, template in reversed(CONVENTIONAL_NAMES.items())}


def conventional_choice(name: str | None, default_flavor: str) -> KernelChoice | None:
    """The choice a conventional kernel name stands for on the gateway (python3 -> msb-python-<default flavor>); else None."""
    template = CONVENTIONAL_NAMES.get((name or "").lower())
    return KernelChoice.of(template, default_flavor) if template else None


def every_choice() -> list[KernelChoice]:
    return [KernelChoice(template, flavor) for template in TEMPLATES.values() for flavor in FLAVORS.values()]


def parse_pool_sizes(value: str, variable: str = "MSB_POOL_SIZE") -> dict[str, int]:
    """'python-small=2,data-python-small=1' (or a bare number for python-small) -> {kernelspec name: size}.

    A key with an environment in front (data-python-small) pools that environment's kernels under their own name."""
    text = str(value).strip()
    if text.isdigit():
        text = f"python-small={text}"
    sizes: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, separator, count = item.partition("=")
        choice = KernelChoice.from_kernel_name(KERNEL_NAME_PREFIX + key.strip())
        if not separator or choice is None or not count.strip().isdigit():
            raise ConfigError(
                f"{variable}={value!r}: {item!r} is not [ENVIRONMENT-]TEMPLATE-FLAVOR=COUNT; use e.g. python-small=1,node-small=0 "
                f"(templates: {', '.join(TEMPLATES)}; flavors: {', '.join(FLAVORS)})"
            )
        sizes[choice.kernel_name] = int(count)
    return {name: size for name, size in sizes.items() if size > 0}
