"""Docker Swarm as a cluster engine: each kernel is one service (one replica, never restarted), over Docker's own
API client (the ``docker`` package), against DOCKER_HOST (a manager's socket, or a socket proxy in front of it).

    flavor            -> cpus and memory as both reservation and limit (a node without them is never chosen),
                         pids limit MSB_MAX_PROCESSES; read-only root; home and /tmp are tmpfs of the flavor's
                         scratch size (counted in its memory: Swarm has no per-service disk quota)
    connection keys   -> Swarm secrets, one per file, mode 0400 for the kernel's user, at /run/secrets: kept
                         encrypted in the managers' Raft log and sent only to the node that runs the kernel
    network           -> MSB_SWARM_NETWORK, an overlay made --internal (no way out) and --attachable (the
                         gateway's container joins it), endpoint mode dnsrr (no virtual IP between gateway and kernel)
    runtime           -> the node daemon's default (runsc where the operator made it so; doctor says which)
    liveness          -> one tasks/nodes/services listing a second serves every kernel's poll; a task on a node
                         that is down is lost, and says so
    owners            -> a config per owner whose labels carry its last heartbeat (configs are the one Swarm
                         object whose labels change without touching a task)
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from msb_kernels.backends.cluster.engine import Engine, KernelService, ServiceRecord, TaskState
from msb_kernels.backends.core.processes import SANDBOX_OOM_SCORE_ADJ
from msb_kernels.errors import SandboxError

log = logging.getLogger("msb_kernels")

LABEL = "msb-kernels"  # on every service, secret and config we make
LABEL_SERVICE = "msb-kernels.service"  # a secret's service
LABEL_BEAT_OWNER = "msb-kernels.beat-owner"
LABEL_BEAT = "msb-kernels.beat"
SNAPSHOT_SECONDS = 1.0  # how stale a kernel's state may be: jupyter_client polls every few seconds
STOP_GRACE_NS = 2_000_000_000
SECRETS_DIR = "/run/secrets"  # where Swarm shows a service's secrets, read-only
FILES_TMPFS_BYTES = 4 * 2**20
PENDING_STATES = {"new", "allocated", "pending", "assigned", "accepted", "preparing", "ready", "starting"}


def _timestamp(text: str | None) -> float:
    """Docker's RFC 3339 times (nanoseconds, Z) as time.time() values."""
    if not text:
        return 0.0
    head, _, rest = text.rstrip("Z").partition(".")  # Docker leaves the fraction out when it is zero
    fraction = "".join(ch for ch in rest if ch.isdigit())[:6]
    with contextlib.suppress(ValueError):
        moment = datetime.datetime.strptime(head, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=datetime.timezone.utc)
        return moment.timestamp() + (int(fraction) / 10 ** len(fraction) if fraction else 0)
    return 0.0


def docker_load(archive: Path, tag: str) -> list[str]:
    """`docker load` of a Docker-save archive into the engine at DOCKER_HOST: how a node gets an image without a registry.
    Each node that may run kernels needs it (or MSB_PYTHON_IMAGE naming the operator's registry)."""
    import docker

    print(f"$ docker load -i {archive}  (DOCKER_HOST={os.environ.get('DOCKER_HOST') or 'unix:///var/run/docker.sock'})")
    try:
        client = docker.from_env(timeout=600)
        with open(archive, "rb") as handle:
            images = client.images.load(handle)
    except docker.errors.DockerException as exc:
        raise SandboxError(
            f"docker load of {archive} failed: {exc}", ["set DOCKER_HOST to the node's engine", "run `msb-kernels doctor`"]
        ) from None
    return [tag for image in images for tag in image.tags]


def docker_save(tag: str, archive: Path) -> bool:
    """`docker save` of tag from the engine at DOCKER_HOST into archive; False where that engine does not hold it."""
    import docker

    try:
        image = docker.from_env(timeout=600).images.get(tag)
    except docker.errors.ImageNotFound:
        return False
    except docker.errors.DockerException as exc:
        raise SandboxError(f"cannot read {tag} from the Docker engine: {exc}", ["set DOCKER_HOST to the node's engine"]) from None
    print(f"$ docker save {tag} -o {archive}")
    with open(archive, "wb") as handle:
        for chunk in image.save(named=True):
            handle.write(chunk)
    return True


class DockerSwarm(Engine):
    name = "Docker Swarm"

    def __init__(self, network: str, allow_network: bool = False):
        self.network = network
        self.allow_network = allow_network
        self._client: Any = None
        self._snapshot: tuple[float, dict[str, ServiceRecord]] = (0.0, {})
        self._refreshing = threading.Lock()
        self._network_checked = False

    # -- the client -----------------------------------------------------------------

    def client(self) -> Any:
        if self._client is None:
            import docker

            try:
                self._client = docker.from_env(timeout=30)
            except docker.errors.DockerException as exc:
                raise SandboxError(
                    f"cannot reach the Docker engine ({os.environ.get('DOCKER_HOST') or 'unix:///var/run/docker.sock'}): {exc}",
                    ["set DOCKER_HOST to a swarm manager's socket (or its socket proxy)", "run `msb-kernels doctor`"],
                ) from None
        return self._client

    def availability(self) -> tuple[bool, str, list[str]]:
        try:
            import docker
        except ImportError:
            return False, "the docker package is not installed (pip install 'docker>=7')", []
        where = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
        try:
            with contextlib.closing(docker.from_env(timeout=5)) as client:
                info = client.info()
        except Exception as exc:
            return False, f"no Docker engine answers at {where} ({str(exc)[:200]}); set DOCKER_HOST", []
        swarm = info.get("Swarm") or {}
        if swarm.get("LocalNodeState") != "active":
            return False, f"the Docker engine at {where} is not in a swarm (docker swarm init)", []
        if not swarm.get("ControlAvailable"):
            return False, f"the Docker engine at {where} is a swarm worker; point DOCKER_HOST at a manager", []
        runtime = info.get("DefaultRuntime", "runc")
        warnings = []
        if runtime != "runsc":
            warnings.append(
                f"this manager's default container runtime is {runtime}, not runsc: kernels share their node's Linux kernel "
                "(make runsc the default runtime of every node's daemon for gVisor's boundary)"
            )
        nodes = swarm.get("Nodes", 0)
        return True, f"Docker Swarm {info.get('ServerVersion', '?')} via {where}: {nodes} node(s), default runtime {runtime}", warnings

    def doctor_lines(self) -> list[str]:
        try:
            client = self.client()
            lines = []
            for node in client.nodes.list():
                attrs = node.attrs
                description = attrs.get("Description") or {}
                resources = description.get("Resources") or {}
                engine = description.get("Engine") or {}
                lines.append(
                    f"swarm node {description.get('Hostname', node.id[:12])}: {attrs.get('Spec', {}).get('Role')}, "
                    f"{(attrs.get('Status') or {}).get('State')}, {resources.get('NanoCPUs', 0) / 1e9:g} CPU, "
                    f"{resources.get('MemoryBytes', 0) / 2**30:.1f} GiB, engine {engine.get('EngineVersion', '?')}"
                )
            try:
                network = client.networks.get(self.network).attrs
                lines.append(
                    f"swarm network {self.network}: {network.get('Driver')}, "
                    f"{'internal (no way out)' if network.get('Internal') else 'NOT internal: kernels reach outside'}, "
                    f"{'attachable' if network.get('Attachable') else 'not attachable'}"
                )
            except Exception:
                lines.append(f"swarm network {self.network}: missing (the first kernel creates it, internal and attachable)")
            return lines
        except Exception as exc:
            return [f"swarm: cannot list nodes: {exc}"]

    # -- the network ----------------------------------------------------------------------

    def _ensure_network(self) -> None:
        """The kernels' overlay: internal unless the operator allows the network, attachable for the gateway."""
        import docker

        if self._network_checked:
            return
        client = self.client()
        try:
            attrs = client.networks.get(self.network).attrs
        except docker.errors.NotFound:
            try:
                client.networks.create(
                    self.network, driver="overlay", internal=not self.allow_network, attachable=True, labels={LABEL: "1"}, scope="swarm"
                )
            except docker.errors.APIError as exc:
                if exc.status_code != 409:  # 409: another gateway made it first, which is as good
                    raise
            self._network_checked = True
            return
        else:
            if attrs.get("Driver") != "overlay":
                raise SandboxError(
                    f"MSB_SWARM_NETWORK={self.network} is a {attrs.get('Driver')} network, not a swarm overlay",
                    ["name an overlay network, or a new name (it is created internal and attachable)"],
                )
            if not attrs.get("Internal") and not self.allow_network:
                raise SandboxError(
                    f"MSB_SWARM_NETWORK={self.network} is not internal: its kernels could reach outside",
                    [f"docker network rm {self.network} (it is made anew, internal)", "or set MSB_ALLOW_NETWORK=true"],
                )
            if not attrs.get("Attachable"):
                raise SandboxError(
                    f"MSB_SWARM_NETWORK={self.network} is not attachable: the gateway's container cannot join it",
                    [f"docker network rm {self.network} (it is made anew, attachable)"],
                )
        self._network_checked = True

    def network_subnets(self) -> list[str]:
        self._ensure_network()
        return self.existing_subnets() or []

    def existing_subnets(self) -> list[str] | None:
        import docker

        try:
            attrs = self.client().networks.get(self.network).attrs
        except docker.errors.NotFound:
            return None
        config = (attrs.get("IPAM") or {}).get("Config") or []
        return [entry["Subnet"] for entry in config if entry.get("Subnet")]

    def image_labels(self, image: str) -> dict[str, str] | None:
        """From the manager's copy; None where the manager has none (the nodes that run kernels may)."""
        try:
            return dict(self.client().images.get(image).labels or {})
        except Exception:
            return None

    # -- kernels ----------------------------------------------------------------------------

    def run(self, service: KernelService) -> None:
        import docker
        from docker.types import EndpointSpec, Mount, Resources, RestartPolicy, SecretReference

        self._ensure_network()
        client = self.client()
        uid, _, gid = service.user.partition(":")
        secrets = []
        try:
            for index, (filename, content) in enumerate(service.files.items()):
                secret = client.secrets.create(  # Docker's names stop at 64 characters: the service's, and a number
                    name=f"{service.name}-{index}", data=content, labels={LABEL: "1", LABEL_SERVICE: service.name}
                )
                secrets.append(SecretReference(secret.id, secret.name, filename=filename, uid=uid, gid=gid or uid, mode=0o400))
            resources = Resources(
                cpu_limit=int(service.cpus * 1e9),
                cpu_reservation=int(service.cpus * 1e9),
                mem_limit=service.memory_bytes,
                mem_reservation=service.memory_bytes,
            )
            resources["Limits"]["Pids"] = service.max_processes  # API 1.41 (Docker 20.10); docker-py has no argument for it
            # ipykernel rewrites its connection file at start, and secrets are read-only: the kernel's user copies them
            # (umask 077) into a tmpfs of its own first. (Docker 20.10 drops a tmpfs mode with the sticky bit: 0o777 it is.)
            # Its oom_score_adj is raised by the kernel's own shell: Swarm's task spec has no OomScoreAdj before API 1.46
            # (Docker 27), and raising one's own needs no capability.
            setup = f"echo {SANDBOX_OOM_SCORE_ADJ} > /proc/self/oom_score_adj && umask 077 && cp {SECRETS_DIR}/* {service.files_dir}/"
            command = ["/bin/sh", "-c", f'{setup} && exec "$@"', "kernel", *service.argv]
            scratch = [Mount(service.files_dir, None, type="tmpfs", tmpfs_size=FILES_TMPFS_BYTES, tmpfs_mode=0o777)]
            scratch += [
                Mount(target, None, type="tmpfs", tmpfs_size=service.scratch_bytes, tmpfs_mode=0o777) for target in (service.home, "/tmp")
            ]
            if service.volume is not None:  # made by the engine at its first mount, from the image's (the kernel user's) /shared
                scratch.append(Mount(service.volume[1], service.volume[0], type="volume"))
            client.services.create(
                service.image,
                command=command,
                name=service.name,
                labels=service.labels,
                container_labels=service.labels,
                env=[f"{key}={value}" for key, value in service.env.items()],
                resources=resources,
                restart_policy=RestartPolicy(condition="none"),
                networks=[self.network],
                endpoint_spec=EndpointSpec(mode="dnsrr"),
                secrets=secrets,
                mounts=scratch,
                user=service.user,
                workdir=service.workdir,
                hostname="sandbox",
                read_only=True,
                cap_drop=["ALL"],
                init=True,
                stop_grace_period=STOP_GRACE_NS,
            )
            self._snapshot = (0.0, self._snapshot[1])  # the next state() looks again
        except docker.errors.APIError as exc:
            self.remove(service.name)
            raise SandboxError(f"Docker Swarm refused kernel {service.kernel_id}: {exc.explanation or exc}") from None
        except BaseException:
            self.remove(service.name)
            raise

    def remove(self, name: str) -> None:
        import docker

        client = self.client()
        with contextlib.suppress(docker.errors.NotFound):
            client.api.remove_service(name)
        for secret in client.secrets.list(filters={"label": f"{LABEL_SERVICE}={name}"}):
            for _ in range(20):  # a removed service lets go of its secrets at once, or within moments on a busy manager
                try:
                    secret.remove()
                    break
                except docker.errors.NotFound:
                    break
                except docker.errors.APIError:
                    time.sleep(0.1)

    # -- state -------------------------------------------------------------------------------

    def _list(self) -> dict[str, ServiceRecord]:
        api = self.client().api
        services = api.services(filters={"label": f"{LABEL}=1"})
        wanted = {service["ID"] for service in services}
        tasks: dict[str, dict] = {}
        for task in api.tasks():
            service_id = task.get("ServiceID")
            if service_id in wanted:
                latest = tasks.get(service_id)
                if latest is None or _timestamp(task.get("CreatedAt")) >= _timestamp(latest.get("CreatedAt")):
                    tasks[service_id] = task
        nodes = {node["ID"]: node for node in api.nodes()}
        records = {}
        for service in services:
            spec = service.get("Spec") or {}
            record = ServiceRecord(spec.get("Name", service["ID"]), dict(spec.get("Labels") or {}), _timestamp(service.get("CreatedAt")))
            record.state = self._task_state(tasks.get(service["ID"]), nodes)
            records[record.name] = record
        return records

    def _task_state(self, task: dict | None, nodes: dict[str, dict]) -> TaskState:
        if task is None:
            return TaskState("pending", reason="no task yet")
        status = task.get("Status") or {}
        state, error = status.get("State", ""), status.get("Err") or ""
        node = nodes.get(task.get("NodeID") or "")
        hostname = ((node or {}).get("Description") or {}).get("Hostname")
        container = status.get("ContainerStatus") or {}
        exit_code = container.get("ExitCode")
        if state in PENDING_STATES:
            unplaceable = state == "pending" and "no suitable node" in error
            return TaskState("pending", node=hostname, reason=error or state, unplaceable=unplaceable)
        if state == "running":
            node_state = ((node or {}).get("Status") or {}).get("State")
            if node is not None and node_state != "ready":
                message = ((node.get("Status") or {}).get("Message") or "").strip()
                return TaskState(
                    "lost", node=hostname, reason=f"its node {hostname} is {node_state}" + (f" ({message})" if message else "")
                )
            return TaskState("running", address=self._address(task), node=hostname)
        if state == "orphaned":
            return TaskState("lost", node=hostname, reason=f"its node {hostname} went away and the swarm gave the kernel up")
        if state == "complete":
            return TaskState("ended", node=hostname, exit_code=exit_code if exit_code is not None else 0)
        if state in ("failed", "rejected"):
            return TaskState("ended", node=hostname, exit_code=exit_code, reason=error or state)
        return TaskState("lost", node=hostname, exit_code=exit_code, reason=error or f"its task is {state}")

    def _address(self, task: dict) -> str | None:
        for attachment in task.get("NetworksAttachments") or []:
            network = attachment.get("Network") or {}
            if self.network in (network.get("ID"), (network.get("Spec") or {}).get("Name")):
                for address in attachment.get("Addresses") or []:
                    return address.split("/", 1)[0]
        return None

    def _records(self, max_age: float) -> dict[str, ServiceRecord]:
        with self._refreshing:  # concurrent polls share one listing
            taken, records = self._snapshot
            if time.monotonic() - taken > max_age:
                records = self._list()
                self._snapshot = (time.monotonic(), records)
            return records

    def state(self, name: str, max_age: float = SNAPSHOT_SECONDS) -> TaskState:
        record = self._records(max_age).get(name)
        if record is None:  # a listing taken while the service was being made does not hold it: look once more
            record = self._records(max_age=0).get(name)
        if record is None:
            return TaskState("lost", reason="its service is gone (removed outside msb-kernels)")
        return record.state

    def services(self) -> list[ServiceRecord]:
        return list(self._records(max_age=0).values())

    def tidy(self) -> None:
        """Secrets of services that are gone (a process killed between creating them and its service): keys nobody uses."""
        services = set(self._records(max_age=0))
        for secret in self.client().api.secrets(filters={"label": LABEL_SERVICE}):
            owner = ((secret.get("Spec") or {}).get("Labels") or {}).get(LABEL_SERVICE)
            if owner not in services and time.time() - _timestamp(secret.get("CreatedAt")) > 60:
                with contextlib.suppress(Exception):
                    self.client().api.remove_secret(secret["ID"])

    # -- owners ---------------------------------------------------------------------------------

    @staticmethod
    def _beat_prefix(owner: str) -> str:
        return "msb-beat-" + hashlib.sha256(owner.encode()).hexdigest()[:16]

    def beat(self, owner: str) -> None:
        client = self.client()
        now = time.time()
        latest = client.configs.create(
            name=f"{self._beat_prefix(owner)}-{int(now * 1000)}",
            data=owner.encode(),
            labels={LABEL: "1", LABEL_BEAT_OWNER: owner, LABEL_BEAT: f"{now:.3f}"},
        )
        for config in client.configs.list(filters={"label": f"{LABEL_BEAT_OWNER}={owner}"}):
            if config.id != latest.id:
                with contextlib.suppress(Exception):  # another process of the same owner removed it first
                    config.remove()

    def last_beats(self) -> dict[str, float]:
        beats: dict[str, float] = {}
        for config in self.client().api.configs(filters={"label": LABEL_BEAT_OWNER}):
            labels = (config.get("Spec") or {}).get("Labels") or {}
            with contextlib.suppress(KeyError, ValueError):
                owner = labels[LABEL_BEAT_OWNER]
                beats[owner] = max(beats.get(owner, 0.0), float(labels[LABEL_BEAT]))
        return beats

    def forget(self, owner: str) -> None:
        for config in self.client().configs.list(filters={"label": f"{LABEL_BEAT_OWNER}={owner}"}):
            with contextlib.suppress(Exception):
                config.remove()
