"""What the swarm gateway may ask of Docker's API (socket_proxy.py enforces it): the calls the swarm backend makes, and
request bodies that describe kernels and nothing else. Pure functions of a request: tested without a Docker engine.

Every level of a body is checked against the exact-case fields the backend sets: Docker's JSON decoding matches
field names without regard to case, so a check that looks up only ``CapabilityAdd`` would let ``capabilityadd`` by.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from msb_kernels.backends.cluster.swarm import LABEL
from msb_kernels.kernelspecs.choice import ENVIRONMENT_NAME
from msb_kernels.settings.config import MsbSettings

NAME_PREFIX = "msb-"  # of every service, secret and config the swarm backend makes
MAX_BODY_BYTES = 2**20  # a kernel's spec and its connection file are a few KiB
NOT_A_CALL = "not a call the swarm backend makes"
# httpx decodes the body and Starlette counts it again: these would describe the upstream bytes, not ours.

_VERSION = re.compile(r"^/v[0-9]+(?:\.[0-9]+)*(?=/)")
# IDs and names as Docker makes them; nothing that could mean another path once the engine decodes it.
_ID = r"[A-Za-z0-9][A-Za-z0-9_.-]*"
_IMAGE = r"[A-Za-z0-9][A-Za-z0-9_.:/@-]*"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_VOLUME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,250}$")

READS: tuple[tuple[frozenset[str], re.Pattern[str]], ...] = tuple(
    (frozenset(methods), re.compile(pattern))
    for methods, pattern in (
        (("GET", "HEAD"), r"^/_ping$"),
        (("GET",), r"^/(version|info|nodes|tasks|services|secrets|configs)$"),
        (("GET",), rf"^/services/{_ID}$"),
        (("GET",), rf"^/networks/{_ID}$"),
        (("GET",), rf"^/images/{_IMAGE}/json$"),
    )
)
CREATES = frozenset({"/networks/create", "/secrets/create", "/configs/create", "/services/create"})
DELETE_PATH = re.compile(rf"^/(services|secrets|configs)/({_ID})$")

# The fields of each object of a service's spec the swarm backend sets, or that cannot reach the node. Exact case:
# the engine's JSON decoder matches field names case-insensitively, so "capabilityadd" would be CapabilityAdd to
# it and nothing to a check that looks up "CapabilityAdd". An unknown field is refused, never ignored.
SPEC_FIELDS = frozenset({"Name", "Labels", "TaskTemplate", "Mode", "UpdateConfig", "RollbackConfig", "Networks", "EndpointSpec"})
TASK_FIELDS = frozenset({"ContainerSpec", "Resources", "RestartPolicy", "Placement", "Networks", "ForceUpdate", "Runtime"})
CONTAINER_FIELDS = frozenset(
    {
        "Image",
        "Labels",
        "Command",
        "Args",
        "Hostname",
        "Env",
        "Dir",
        "User",
        "Privileges",
        "TTY",
        "OpenStdin",
        "ReadOnly",
        "Mounts",
        "StopSignal",
        "StopGracePeriod",
        "HealthCheck",
        "Hosts",
        "DNSConfig",
        "Secrets",
        "Isolation",
        "Init",
        "CapabilityAdd",
        "CapabilityDrop",
    }
)
MOUNT_FIELDS = frozenset({"Target", "Source", "Type", "ReadOnly", "Consistency", "TmpfsOptions"})
SECRET_REF_FIELDS = frozenset({"File", "SecretID", "SecretName"})
SECRET_FILE_FIELDS = frozenset({"Name", "UID", "GID", "Mode"})
NETWORK_REF_FIELDS = frozenset({"Target", "Aliases"})
RESOURCES_FIELDS = frozenset({"Limits", "Reservations"})
LIMITS_FIELDS = frozenset({"NanoCPUs", "MemoryBytes", "Pids"})
ENDPOINT_FIELDS = frozenset({"Mode", "Ports"})
MODE_FIELDS = frozenset({"Replicated", "replicated"})  # docker-py's ServiceMode sends "replicated"
REPLICATED_FIELDS = frozenset({"Replicas"})
NETWORK_CREATE_FIELDS = frozenset({"Name", "CheckDuplicate", "Driver", "Scope", "Internal", "Attachable", "Ingress", "Labels", "Options"})
OBJECT_CREATE_FIELDS = frozenset({"Name", "Labels", "Data"})  # secrets and configs: no driver plugin, no templating


class Refused(Exception):
    """A call the proxy does not pass on; rule says why, in words a user of the Docker SDK reads in its APIError."""

    def __init__(self, rule: str, status: int = 403):
        super().__init__(rule)
        self.rule = rule
        self.status = status


def _object(value: Any, where: str, allowed: frozenset[str]) -> dict[str, Any]:
    """value as a JSON object (null is an empty one) holding only allowed fields."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise Refused(f"{where} is not an object")
    for key in value:
        if key not in allowed:
            raise Refused(f"{where}.{key} is not a field the swarm backend sets")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise Refused(f"{where} is not a list")
    return value


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_root(part: str) -> bool:
    part = part.strip()
    if part.lower() == "root":
        return True
    try:
        return int(part) == 0
    except ValueError:
        return False


def _labelled(labels: Any) -> bool:
    return isinstance(labels, dict) and labels.get(LABEL) == "1"


def spec_labelled(obj: Any) -> bool:
    """Whether an engine object (service, secret, config) as the engine lists it is one of ours."""
    return isinstance(obj, dict) and _labelled((obj.get("Spec") or {}).get("Labels"))


def image_reference(ref: str) -> tuple[str, str | None, str | None]:
    """(repository as Docker normalizes it, tag, digest): "msb-kernels/python" is "docker.io/msb-kernels/python"."""
    name, _, digest = ref.partition("@")
    tag = None
    if name.rfind(":") > name.rfind("/"):  # a colon before the last slash is a registry's port
        name, _, tag = name.rpartition(":")
    first, slash, rest = name.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        domain, path = first, rest
    else:
        domain, path = "docker.io", name
    if domain == "index.docker.io":
        domain = "docker.io"
    if domain == "docker.io" and "/" not in path:
        path = f"library/{path}"
    return f"{domain}/{path}", tag or None, digest or None


@dataclass(frozen=True)
class Policy:
    """What kernels look like in this swarm: from the gateway's own settings (MSB_SWARM_NETWORK, MSB_PYTHON_IMAGE,
    MSB_NODE_IMAGE, MSB_ALLOW_NETWORK), so the proxy and the gateway agree."""

    network: str
    images: tuple[str, ...]
    allow_network: bool = False
    # Environments' images are this repository with "-NAME" added (`msb-kernels image build python --env NAME`), any tag.
    environments_of: str | None = None
    # MSB_SHARED_VOLUME_NAME: the named volumes a kernel may mount (it, or a person's, "<it>-..."), at volume_target only.
    volume_name: str | None = None
    volume_target: str = "/shared"

    @classmethod
    def from_settings(cls, settings: MsbSettings) -> Policy:
        images = (settings.python_image, settings.node_image)
        return cls(
            settings.swarm_network,
            images,
            settings.allow_network,
            image_reference(settings.python_image)[0],
            settings.shared_volume_name,
            settings.shared_volume_guest_path,
        )

    def volume_mount(self, mount: dict[str, Any]) -> bool:
        """A mount of one of the shared volume's named volumes at its guest path: the volume, or a person's own. Any
        other volume (a database's, one an operator made with a host path) is never a kernel's to mount; no options
        ride along (VolumeOptions is not a field a kernel's mount may have), so the engine makes it plain if missing."""
        source, name = mount.get("Source"), self.volume_name
        return (
            name is not None
            and isinstance(source, str)
            and (source == name or (source.startswith(name + "-") and bool(_VOLUME.match(source))))
            and mount.get("Target") == self.volume_target
        )

    def kernel_image(self, ref: str) -> bool:
        """One of the kernel images; with a digest it is the image that tag named when it was pinned (as the Docker CLI
        sends it), so any digest of the repository passes unless the setting itself pins one."""
        name, tag, digest = image_reference(ref)
        if digest is not None and not (digest.startswith("sha256:") and _HEX64.match(digest.removeprefix("sha256:"))):
            return False
        for allowed in self.images:
            allowed_name, allowed_tag, allowed_digest = image_reference(allowed)
            if name != allowed_name:
                continue
            if allowed_digest is not None:
                if digest == allowed_digest and (tag is None or tag == allowed_tag):
                    return True
            elif digest is not None:
                if tag is None or tag == (allowed_tag or "latest"):
                    return True
            elif (tag or "latest") == (allowed_tag or "latest"):
                return True
        prefix = f"{self.environments_of}-"
        return self.environments_of is not None and name.startswith(prefix) and bool(ENVIRONMENT_NAME.match(name.removeprefix(prefix)))

    def check_service(self, spec: dict[str, Any]) -> tuple[list[str], list[str]]:
        """Refuse a service spec that is not a kernel's; returns (secret IDs, network IDs) it names, which the caller
        checks against the engine (ours, and the kernels' network)."""
        spec = _object(spec, "Spec", SPEC_FIELDS)
        name = spec.get("Name")
        if not isinstance(name, str) or not name.startswith(NAME_PREFIX):
            raise Refused(f"Name {name!r} does not start with {NAME_PREFIX!r}")
        if not _labelled(spec.get("Labels")):
            raise Refused(f'Labels lack "{LABEL}": "1"')
        task = _object(spec.get("TaskTemplate"), "TaskTemplate", TASK_FIELDS)
        container = _object(task.get("ContainerSpec"), "TaskTemplate.ContainerSpec", CONTAINER_FIELDS)
        image = container.get("Image")
        if not isinstance(image, str) or not self.kernel_image(image):
            raise Refused(f"image {image!r} is not a kernel image ({', '.join(self.images)})")
        user = container.get("User")
        if not isinstance(user, str) or not user.strip():
            raise Refused("User is not set: the image's default may be root")
        if any(_is_root(part) for part in user.split(":", 1)):
            raise Refused(f"User {user!r} is root")
        if container.get("ReadOnly") is not True:
            raise Refused("ReadOnly is not true: the root filesystem must be read-only")
        if not any(isinstance(cap, str) and cap.upper() == "ALL" for cap in _list(container.get("CapabilityDrop"), "CapabilityDrop")):
            raise Refused('CapabilityDrop does not hold "ALL"')
        if _list(container.get("CapabilityAdd"), "CapabilityAdd"):
            raise Refused("CapabilityAdd is not empty")
        privileges = container.get("Privileges")
        if privileges is not None and (not isinstance(privileges, dict) or any(privileges.values())):
            raise Refused("Privileges are set (credential spec, SELinux, seccomp or AppArmor)")
        if container.get("Isolation") not in (None, "", "default"):
            raise Refused(f"Isolation {container.get('Isolation')!r} is not the default")
        for index, item in enumerate(_list(container.get("Mounts"), "Mounts")):
            mount = _object(item, f"Mounts[{index}]", MOUNT_FIELDS)
            if mount.get("Type") == "volume" and self.volume_mount(mount):
                continue
            if mount.get("Type") != "tmpfs" or mount.get("Source"):
                raise Refused(
                    f"Mounts[{index}] is a {mount.get('Type')!r} mount of {mount.get('Source')!r}: only tmpfs mounts are allowed, "
                    "and the shared volume's own (MSB_SHARED_VOLUME_NAME) at its guest path"
                )
        secret_ids = []
        for index, item in enumerate(_list(container.get("Secrets"), "Secrets")):
            reference = _object(item, f"Secrets[{index}]", SECRET_REF_FIELDS)
            target = _object(reference.get("File"), f"Secrets[{index}].File", SECRET_FILE_FIELDS)
            if not isinstance(target.get("Name"), str) or not _FILE_NAME.match(target["Name"]) or target["Name"] in (".", ".."):
                raise Refused(f"Secrets[{index}].File.Name {target.get('Name')!r} is not a plain file name")
            if not isinstance(reference.get("SecretID"), str) or not reference["SecretID"]:
                raise Refused(f"Secrets[{index}] names no SecretID")
            secret_ids.append(reference["SecretID"])
        if task.get("Runtime") not in (None, "", "container"):
            raise Refused(f"TaskTemplate.Runtime {task.get('Runtime')!r} is not a container (a plugin runs privileged)")
        network_ids = []
        for where, networks in (("TaskTemplate.Networks", task.get("Networks")), ("Networks", spec.get("Networks"))):
            for index, item in enumerate(_list(networks, where)):
                target = _object(item, f"{where}[{index}]", NETWORK_REF_FIELDS).get("Target")
                if isinstance(target, str) and _HEX64.match(target):
                    network_ids.append(target)  # the kernels' network by its ID: the caller asks the engine
                elif target != self.network:
                    raise Refused(f"network {target!r} is not the kernels' network {self.network!r}")
        endpoint = _object(spec.get("EndpointSpec"), "EndpointSpec", ENDPOINT_FIELDS)
        if _list(endpoint.get("Ports"), "EndpointSpec.Ports"):
            raise Refused("EndpointSpec.Ports publishes ports: kernels are reached on their network only")
        mode = _object(spec.get("Mode"), "Mode", MODE_FIELDS)
        if len(mode) > 1:
            raise Refused("Mode names replicated twice")
        for key, value in mode.items():
            replicated = _object(value, f"Mode.{key}", REPLICATED_FIELDS)
            if replicated.get("Replicas") not in (None, 1) or isinstance(replicated.get("Replicas"), bool):
                raise Refused(f"Mode is not one replica (Replicas {replicated.get('Replicas')!r})")
        resources = _object(task.get("Resources"), "TaskTemplate.Resources", RESOURCES_FIELDS)
        limits = _object(resources.get("Limits"), "TaskTemplate.Resources.Limits", LIMITS_FIELDS)
        for field in ("NanoCPUs", "MemoryBytes", "Pids"):
            if not _positive(limits.get(field)):
                raise Refused(f"Resources.Limits.{field} is not a positive limit")
        return secret_ids, network_ids

    def check_network(self, body: dict[str, Any]) -> None:
        body = _object(body, "network", NETWORK_CREATE_FIELDS)
        if body.get("Name") != self.network:
            raise Refused(f"network name {body.get('Name')!r} is not the kernels' network {self.network!r}")
        if body.get("Driver") != "overlay":
            raise Refused(f"Driver {body.get('Driver')!r} is not overlay")
        if body.get("Internal") is not True and not self.allow_network:
            raise Refused("Internal is not true: kernels would reach outside (MSB_ALLOW_NETWORK is off)")
        if body.get("Attachable") is not True:
            raise Refused("Attachable is not true")
        if body.get("Ingress"):
            raise Refused("Ingress is set: the kernels' network is not the routing mesh")
        if body.get("Options"):
            raise Refused("Options are set: the kernels' network takes the driver's defaults")

    @staticmethod
    def check_object(kind: str, body: dict[str, Any]) -> None:
        """A secret (a kernel's connection file) or a config (an owner's heartbeat)."""
        body = _object(body, kind, OBJECT_CREATE_FIELDS)
        name = body.get("Name")
        if not isinstance(name, str) or not name.startswith(NAME_PREFIX):
            raise Refused(f"Name {name!r} does not start with {NAME_PREFIX!r}")
        if not _labelled(body.get("Labels")):
            raise Refused(f'Labels lack "{LABEL}": "1"')


def split_path(path: str) -> tuple[str, str]:
    """(version prefix, the rest): "/v1.41/services/create" -> ("/v1.41", "/services/create")."""
    match = _VERSION.match(path)
    return (match.group(0), path[match.end() :]) if match else ("", path)


def classify(method: str, path: str) -> str:
    """The kind of call (read, create or delete) the swarm backend makes with method and path (its version stripped); else Refused."""
    segments = path.split("/")[1:]
    if not path.startswith("/") or any(segment in ("", ".", "..") for segment in segments):
        raise Refused("its path is not in normal form")
    for methods, pattern in READS:
        if method in methods and pattern.match(path):
            return "read"
    if method == "POST" and path in CREATES:
        return "create"
    if method == "DELETE" and DELETE_PATH.match(path):
        return "delete"
    raise Refused(NOT_A_CALL)


def parse_body(body: bytes) -> dict[str, Any]:
    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for key, value in pairs:
            if key in found:
                raise Refused(f"its body repeats the key {key!r}")
            found[key] = value
        return found

    try:
        value = json.loads(body, object_pairs_hook=unique)
    except (ValueError, UnicodeDecodeError):
        raise Refused("its body is not JSON") from None
    if not isinstance(value, dict):
        raise Refused("its body is not a JSON object")
    return value
