"""The kernel choice: template + flavor, the kernelspec name that carries it, and pool sizes in its terms."""

from __future__ import annotations

import pytest

from msb_kernels.errors import ConfigError, InvalidRequest
from msb_kernels.kernelspecs.choice import KernelChoice, every_choice, parse_pool_sizes
from msb_kernels.kernelspecs.flavors import FLAVORS
from msb_kernels.kernelspecs.templates import TEMPLATES
from tests.parallel import UNIT

pytestmark = UNIT  # starts no process


def test_the_kernelspec_name_is_built_and_parsed_in_one_place():
    choice = KernelChoice.of("javascript", "Medium")  # aliases and case, as tool arguments may come
    assert (choice.template, choice.flavor) == (TEMPLATES["node"], FLAVORS["medium"])
    assert choice.kernel_name == "msb-node-medium" and str(choice) == "node-medium"
    for each in every_choice():
        assert KernelChoice.from_kernel_name(each.kernel_name) == each
    assert len(every_choice()) == len(TEMPLATES) * len(FLAVORS)


@pytest.mark.parametrize(
    "name", [None, "", "python3", "msb-python", "msb-python-huge", "msb-ruby-small", "msb-python-small-x", "xmsb-python-small"]
)
def test_other_kernels_are_no_choice(name):
    assert KernelChoice.from_kernel_name(name) is None


def test_unknown_names_name_the_accepted_values():
    with pytest.raises(InvalidRequest, match="flavor='huge' is not a flavor; use one of small, medium, large"):
        KernelChoice.of("python", "huge")
    with pytest.raises(InvalidRequest, match="template='ruby' is not supported"):
        KernelChoice.of("ruby", "small")


def test_pool_sizes_parse_and_reject_bad_values():
    assert parse_pool_sizes("python-small=1,node-medium=2,python-large=0") == {"msb-python-small": 1, "msb-node-medium": 2}
    assert parse_pool_sizes("3") == {"msb-python-small": 3}
    assert parse_pool_sizes("") == {}
    with pytest.raises(ConfigError, match="'python-huge=1' is not \\[ENVIRONMENT-\\]TEMPLATE-FLAVOR=COUNT"):
        parse_pool_sizes("python-huge=1")


@pytest.mark.parametrize("environment", ["data", "data-science", "x2", "a-python-small"])
def test_an_environments_kernel_name_parses_back_one_way(environment):
    for flavor in FLAVORS:
        choice = KernelChoice.of("python", flavor, environment)
        assert choice.kernel_name == f"msb-{environment}-python-{flavor}"
        assert KernelChoice.from_kernel_name(choice.kernel_name) == choice
        assert choice.environment_name == environment and str(choice) == f"{environment}-python-{flavor}"
    # The names users already have keep meaning the default environment.
    assert KernelChoice.from_kernel_name("msb-python-small") == KernelChoice.of("python", "small", "default")
    assert KernelChoice.from_kernel_name("msb-python-small").environment_name == "default"


@pytest.mark.parametrize(
    "name", ["msb-data-node-small", "msb-Data-python-small", "msb--python-small", "msb-default-python-small", "msb-small-python-small"]
)
def test_no_environment_of_node_or_of_a_reserved_or_malformed_name(name):
    assert KernelChoice.from_kernel_name(name) is None


def test_node_has_no_environments():
    with pytest.raises(InvalidRequest, match="node kernels have no environments"):
        KernelChoice.of("node", "small", "data")


def test_pool_sizes_name_environments_too():
    sizes = parse_pool_sizes("python-small=1,data-python-small=2,data-science-python-large=1")
    assert sizes == {"msb-python-small": 1, "msb-data-python-small": 2, "msb-data-science-python-large": 1}
    with pytest.raises(ConfigError, match="'data-node-small=1' is not"):
        parse_pool_sizes("data-node-small=1")
