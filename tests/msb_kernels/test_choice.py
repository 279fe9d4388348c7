"""The kernel choice: template + flavor, the kernelspec name that carries it, and pool sizes in its terms."""

from __future__ import annotations

import pytest

from msb_kernels.choice import KernelChoice, every_choice, parse_pool_sizes
from msb_kernels.errors import ConfigError, InvalidRequest
from msb_kernels.flavors import FLAVORS
from msb_kernels.templates import TEMPLATES


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
    with pytest.raises(ConfigError, match="'python-huge=1' is not TEMPLATE-FLAVOR=COUNT"):
        parse_pool_sizes("python-huge=1")
