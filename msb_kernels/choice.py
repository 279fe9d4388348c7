"""The kernel choice: a template (python or node) and a flavor, and the kernelspec name that carries them.

Every layer speaks in choices: a kernelspec is named for one (``msb-python-small``), the MCP tools
resolve their ``language`` and ``flavor`` arguments into one, the pool is sized in them, and the
gateway and the bridge read them back from a kernel's kernelspec name. The name is built and parsed
here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

from msb_kernels.errors import ConfigError
from msb_kernels.flavors import FLAVORS, Flavor, get_flavor
from msb_kernels.templates import TEMPLATES, Template, get_template

KERNEL_NAME_PREFIX = "msb-"


@dataclass(frozen=True)
class KernelChoice:
    template: Template
    flavor: Flavor

    @property
    def kernel_name(self) -> str:
        """The kernelspec that starts this choice: ``msb-<template>-<flavor>``."""
        return f"{KERNEL_NAME_PREFIX}{self.template.name}-{self.flavor.name}"

    @classmethod
    def of(cls, template: str, flavor: str) -> KernelChoice:
        """From names a caller gave (aliases allowed); unknown ones raise InvalidRequest naming the accepted values."""
        return cls(get_template(template, argument="template"), get_flavor(flavor))

    @classmethod
    def from_kernel_name(cls, name: str | None) -> KernelChoice | None:
        """The choice an msb kernelspec name encodes; None for any other kernel (e.g. a plain ``python3``)."""
        if not name or not name.startswith(KERNEL_NAME_PREFIX):
            return None
        template, _, flavor = name[len(KERNEL_NAME_PREFIX) :].partition("-")
        if template in TEMPLATES and flavor in FLAVORS:
            return cls(TEMPLATES[template], FLAVORS[flavor])
        return None

    def __str__(self) -> str:
        return f"{self.template.name}-{self.flavor.name}"


# The names notebooks from elsewhere carry in their metadata (ipykernel's python3, IJavascript's and tslab's),
# and the template each means. The gateway serves each as its kernelspec of the default flavor, so such a
# notebook opens in a sandbox without a kernel-picker dialog. Locally they stay the user's own kernelspecs.
CONVENTIONAL_NAMES = {"python3": "python", "python": "python", "javascript": "node", "jslab": "node", "nodejs": "node"}


def conventional_choice(name: str | None, default_flavor: str) -> KernelChoice | None:
    """The choice a conventional kernel name stands for on the gateway (python3 -> msb-python-<default flavor>); else None."""
    template = CONVENTIONAL_NAMES.get((name or "").lower())
    return KernelChoice.of(template, default_flavor) if template else None


def every_choice() -> list[KernelChoice]:
    return [KernelChoice(template, flavor) for template in TEMPLATES.values() for flavor in FLAVORS.values()]


def parse_pool_sizes(value: str, variable: str = "MSB_POOL_SIZE") -> dict[str, int]:
    """'python-small=2,node-small=1' (or a bare number for python-small) -> {kernelspec name: size}."""
    text = str(value).strip()
    if text.isdigit():
        text = f"python-small={text}"
    sizes: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, separator, count = item.partition("=")
        choice = KernelChoice.from_kernel_name(KERNEL_NAME_PREFIX + key.strip())
        if not separator or choice is None or not count.strip().isdigit():
            raise ConfigError(
                f"{variable}={value!r}: {item!r} is not TEMPLATE-FLAVOR=COUNT; use e.g. python-small=1,node-small=0 "
                f"(templates: {', '.join(TEMPLATES)}; flavors: {', '.join(FLAVORS)})"
            )
        sizes[choice.kernel_name] = int(count)
    return {name: size for name, size in sizes.items() if size > 0}
