"""The egress settings' checks and accepted values, which msb_kernels.settings.config reads into its own tables."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import Any

from msb_kernels.egress.dns import parse_dns_servers
from msb_kernels.egress.policy import RULE_FORMS, Policy, PolicyError
from msb_kernels.errors import ConfigError
from msb_kernels.settings.value_checks import check_private_file


def _network_allow(value: str) -> str | None:
    try:
        Policy.parse(value)
    except PolicyError as exc:
        return f"has a rule that cannot be used ({exc})"
    return None


def _dns_servers(value: str) -> str | None:
    try:
        return None if parse_dns_servers(value) else "names no server"
    except ValueError as exc:
        return f"is not a list of addresses ({exc})"


def _ca_file(value: str) -> str | None:
    try:
        ssl.create_default_context().load_verify_locations(cafile=value)
    except (OSError, ssl.SSLError) as exc:
        return f"cannot be loaded as PEM certificates ({exc})"
    return None


CHECKS: dict[str, Callable[[Any], str | None]] = {
    "network_allow": _network_allow,
    "network_dns": _dns_servers,
    "network_ca_file": _ca_file,
    "network_secrets_file": check_private_file,  # docs/network.md: read by the gateway's user only
}
ACCEPTED = {
    "network_allow": f"use {RULE_FORMS}",
    "network_dns": "use DNS server addresses, ADDRESS[:PORT] separated by commas, such as 192.0.2.53 or [2001:db8::53]:5353",
    "network_ca_file": "use a PEM file of CA certificates, or leave it unset for the system's",
    "network_secrets_file": 'use a JSON file {"NAME": {"value": "...", "hosts": ["api.example.com"]}}, readable by this user only (chmod 600)',
}


def check_together(allow_network: bool, network_allow: str | None, secrets_file: str | None) -> None:
    """What the network settings must agree on; ConfigError says which to change."""
    from msb_kernels.egress.grant import operator_policy, operator_secrets

    if allow_network and network_allow:
        raise ConfigError(
            "MSB_ALLOW_NETWORK=true and MSB_NETWORK_ALLOW are both set; set one",
            ["MSB_NETWORK_ALLOW alone for an allow-list", "MSB_ALLOW_NETWORK=true alone for the whole public internet"],
        )
    operator_secrets(secrets_file, operator_policy(allow_network, network_allow))
