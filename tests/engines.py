"""Private Docker engines and a real two-node Docker Swarm on one machine, for tests.

Why: the swarm backend must be tested against a real swarm (placement on two nodes, an overlay network between
them, a node that dies) without using or disturbing a system Docker. Each :class:`DockerEngine` is its own
``dockerd`` with its own data-root, exec-root, pidfile, socket, containerd namespaces and cgroup parent, in
private mount and UTS namespaces (the hostname is the engine's name, so swarm nodes are told apart). dockerd
20.10 and its containerd also write fixed paths (``/var/lib/docker/network/files`` for swarm's load-balancer
and ingress sandboxes, ``/etc/docker/key.json``, ``/run/docker/plugins``, ``/run/containerd/s``): in the
engine's mount namespace these are overlays whose upper layers lie in the engine's directory.

Network namespaces: a dockerd in the host's namespace is not harmless to another dockerd there. With iptables on
it flushes the shared DOCKER-ISOLATION chains at start (seen here: another daemon's isolation rules vanished),
and ``--bridge=none`` deletes whatever link is named docker0. So :class:`TwoNodeSwarm` runs *both* nodes in
network namespaces of their own, each with a stock dockerd (iptables on, docker0, docker_gwbridge), wired by veth
pairs to a bridge in a third "switch" namespace, which also has a leg in the host's namespace: the host reaches
both nodes (e.g. published ports) at their addresses, and nothing of the swarm touches the host's iptables or
links but that one veth end. An engine started without ``netns`` runs in the host's namespace in a safe mode
instead: no iptables, no ip_forward, bridges with names of its own.

Addresses: a free /20 of 198.18.0.0/16 (RFC 2544's benchmarking range, which no real network uses), chosen so it
overlaps no route or address on the host: its first /29 is the switch (host .1, manager .2, worker .3), then a /22
per engine for docker0, docker_gwbridge and local networks; the matching /20 of 198.19.0.0/16 is the swarm's
overlay pool (a /24 per network). The nodes have no default route, so no packet of theirs can leave the machine.

API (all errors that mean "cannot be had here" are EngineUnavailable)::

    EngineUnavailable(reason)
    DockerEngine(base, name, netns=None, *, pool=None, prefer_offline_images=True)
        .dir .socket .url .name .netns .timings .running
        .start(timeout=60)  .client()  .load(archive) -> tags  .kill()  .stop(timeout=5)  .log_tail()
    TwoNodeSwarm(base, heartbeat_s=1.0, *, prefer_offline_images=True)
        .manager .worker (DockerEngine)  .host_addr .manager_addr .worker_addr .timings
        .start()  .client()  .node_ids() -> {"manager": id, "worker": id}  .network(name) -> id
        .wait_node_state(node_id, state, timeout) -> s  .kill_worker(unplug=False)  .stop()
    busybox_archive(dest, tag="msbt/busybox:1") -> dest   docker-save tar of the host's static busybox

``stop()`` is idempotent, safe after a failed or partial ``start()``, and leaves no process, mount, network
namespace, link, cgroup or directory behind (the directory stays if ``MSB_TESTS_KEEP_BASE`` is set). The harness
needs root, ``dockerd``, ``ip``, ``unshare`` and ``nsenter``. This kernel has no IPVS, so swarm's VIP load
balancing and ingress routing mesh do not work here: use ``endpoint_mode="dnsrr"`` or task addresses.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import ipaddress
import json
import os
import platform
import random
import secrets
import shutil
import signal
import subprocess
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import docker

__all__ = ["DockerEngine", "EngineUnavailable", "TwoNodeSwarm", "busybox_archive"]

# Links and bridges come from 198.18.0.0/16, swarm overlays from 198.19.0.0/16: both halves of RFC 2544's range.
_RANGE = ipaddress.ip_network("198.18.0.0/16")
_SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# dockerd 20.10 speaks API 1.41; pinning it spares the SDK a version round trip per client.
_API_VERSION = "1.41"
_NODE_WAIT_S = 60.0

# Runs in the engine's new mount and UTS namespaces, then execs dockerd. $3 = 1 for an engine in a network
# namespace: a fresh sysfs shows that namespace's links (as `ip netns exec` does), with the cgroup mounts kept.
_PRELUDE = r"""
set -eu
shadow=$1; host=$2; own_sysfs=$3; shift 3
hostname "$host"
overlay() {
    mkdir -p "$shadow/$2.upper" "$shadow/$2.work"
    mount -t overlay "msbt-$2" -o "lowerdir=$1,upperdir=$shadow/$2.upper,workdir=$shadow/$2.work" "$1"
}
if [ -d /etc/docker ]; then mkdir -p "$shadow/etc-docker"; mount --bind "$shadow/etc-docker" /etc/docker; else overlay /etc etc; fi
overlay /var/lib var-lib
overlay /run run
if [ "$own_sysfs" = 1 ]; then
    mkdir -p "$shadow/cgroup"
    mount --rbind /sys/fs/cgroup "$shadow/cgroup"
    mount -t sysfs sysfs /sys
    mount --move "$shadow/cgroup" /sys/fs/cgroup
fi
exec "$@"
"""


class EngineUnavailable(Exception):
    """A private engine or swarm cannot be had on this machine; the message says why."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, env={"PATH": _SBIN_PATH, "LC_ALL": "C"}, timeout=60)
    if check and done.returncode != 0:
        raise EngineUnavailable(f"{' '.join(argv)} failed ({done.returncode}): {(done.stderr or done.stdout).strip()}")
    return done


def _dockerd() -> str | None:
    return shutil.which("dockerd", path=_SBIN_PATH)


def _require_host() -> None:
    if os.geteuid() != 0:
        raise EngineUnavailable("private Docker engines need root (namespaces, mounts, dockerd)")
    if not _dockerd():
        raise EngineUnavailable("dockerd is not installed (bash scripts/apt-install docker.io)")
    for tool in ("ip", "unshare", "nsenter", "mount"):
        if not shutil.which(tool, path=_SBIN_PATH):
            raise EngineUnavailable(f"{tool} is not installed")


def _used_networks() -> list[ipaddress.IPv4Network]:
    """The host's IPv4 addresses and routes: a block that overlaps none of them is free to use here."""
    nets = []
    for argv in (("ip", "-4", "-o", "addr", "show"), ("ip", "-4", "route", "show", "table", "all")):
        for word in _run(*argv, check=False).stdout.split():
            if word[:1].isdigit() and ("/" in word or word.count(".") == 3):
                with contextlib.suppress(ValueError):
                    nets.append(ipaddress.ip_network(word, strict=False))
    return [n for n in nets if isinstance(n, ipaddress.IPv4Network) and n.prefixlen > 0]


def _free_block(prefix: int) -> ipaddress.IPv4Network:
    used = _used_networks()
    blocks = list(_RANGE.subnets(new_prefix=prefix))
    random.shuffle(blocks)
    for block in blocks:
        if not any(block.overlaps(net) for net in used):
            return block
    raise EngineUnavailable(f"no free /{prefix} left in {_RANGE} on this host")


def _ns_inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _protected_pids() -> set[int]:
    """This process and its ancestors: a sweep must never signal them, whatever they match."""
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def _mountpoints_under(root: Path) -> list[str]:
    prefix = str(root).rstrip("/") + "/"
    points = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if point.startswith(prefix) or point == str(root):
                points.append(point)
    return points


def _unmount_and_remove(root: Path) -> None:
    """Lazily unmount anything still mounted under root (deepest first), then remove it, unless the user keeps it."""
    for point in sorted(_mountpoints_under(root), key=len, reverse=True):
        _run("umount", "-l", point, check=False)
    if not os.environ.get("MSB_TESTS_KEEP_BASE"):
        shutil.rmtree(root, ignore_errors=True)


def _wait(predicate: Callable[[], bool], timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def _parallel(calls: list[Callable[[], None]]) -> None:
    """Run the calls in threads and re-raise the first error once all are done (so a failed start still lets the
    other finish, and a failed stop still lets the other clean up)."""
    errors: list[BaseException] = []

    def guard(call: Callable[[], None]) -> None:
        try:
            call()
        except BaseException as e:  # re-raised below, once all are done
            errors.append(e)

    threads = [threading.Thread(target=guard, args=(call,)) for call in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


class DockerEngine:
    """One private dockerd: own data-root, exec-root, pidfile, unix socket, containerd namespaces and cgroup parent,
    in private mount and UTS namespaces; inside network namespace ``netns`` (which must exist) if given.

    ``pool`` (a /22) holds the engine's bridges: its first /24 is docker0's (``--bip``), its second /23 the
    ``--default-address-pool`` (a /26 per network, docker_gwbridge included); by default a free /22 of
    198.18.0.0/16. Without ``netns`` the engine is in the host's namespace, where it must not disturb another
    dockerd: it runs without iptables or ip_forward, on a docker0 and a docker_gwbridge with unique link names.
    ``prefer_offline_images`` (the default, as nothing here reaches a registry) makes swarm tasks use local images
    without trying a pull first (``DOCKER_SERVICE_PREFER_OFFLINE_IMAGE=1`` in dockerd's environment).
    """

    def __init__(
        self,
        base: Path,
        name: str,
        netns: str | None = None,
        *,
        pool: str | ipaddress.IPv4Network | None = None,
        prefer_offline_images: bool = True,
    ) -> None:
        self.base = Path(base)
        self.name = name
        self.netns = netns
        self.dir = self.base / name
        self.socket = self.dir / "docker.sock"
        self.url = f"unix://{self.socket}"
        self.log = self.dir / "dockerd.log"
        self.pool = ipaddress.ip_network(pool) if pool else None
        self.prefer_offline_images = prefer_offline_images
        tag = hashlib.sha256(str(self.dir).encode()).hexdigest()[:7]
        self.cgroup_parent = f"/msbt-{tag}"
        # Only for an engine in the host's namespace; Linux caps link names at 15 bytes.
        self._host_links = (f"msbd{tag}", f"msbg{tag}")
        self.timings: dict[str, float] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._mntns: int | None = None
        self._clients: list[docker.DockerClient] = []

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 60) -> None:
        """Start dockerd and wait for its API. On failure all is cleaned up and the error carries the log's tail."""
        _require_host()
        if self.running:
            return
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> None:
        if self.pool is None:
            self.pool = _free_block(22)
        bridge_net = next(self.pool.subnets(new_prefix=24))
        local_pool = list(self.pool.subnets(new_prefix=23))[1]
        for sub in ("data", "exec", "shadow"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        (self.dir / "daemon.json").write_text("{}\n")  # never the host's /etc/docker/daemon.json
        self.socket.unlink(missing_ok=True)
        argv = [
            _dockerd() or "dockerd",
            f"--config-file={self.dir / 'daemon.json'}",
            f"--data-root={self.dir / 'data'}",
            f"--exec-root={self.dir / 'exec'}",
            f"--host={self.url}",
            f"--pidfile={self.dir / 'docker.pid'}",
            f"--containerd-namespace={self.name}",
            f"--containerd-plugins-namespace={self.name}-plugins",
            f"--default-address-pool=base={local_pool},size=26",
            f"--cgroup-parent={self.cgroup_parent}",
            "--exec-opt=native.cgroupdriver=cgroupfs",
        ]
        if self.netns:
            argv.append(f"--bip={bridge_net[1]}/{bridge_net.prefixlen}")
            if not Path(f"/run/netns/{self.netns}").exists():
                raise EngineUnavailable(f"network namespace {self.netns} does not exist")
        else:
            docker0, _ = self._host_links
            _run("ip", "link", "add", docker0, "type", "bridge")
            _run("ip", "addr", "add", f"{bridge_net[1]}/{bridge_net.prefixlen}", "dev", docker0)
            _run("ip", "link", "set", docker0, "up")
            argv += [f"--bridge={docker0}", "--iptables=false", "--ip-forward=false", "--ip-masq=false"]
        cmd = ["unshare", "--mount", "--uts", "--propagation", "slave", "--", "sh", "-c", _PRELUDE, "sh"]
        cmd += [str(self.dir / "shadow"), self.name, "1" if self.netns else "0", *argv]
        if self.netns:
            cmd = ["nsenter", f"--net=/run/netns/{self.netns}", "--", *cmd]
        env = {"PATH": _SBIN_PATH, "LC_ALL": "C"}
        if self.prefer_offline_images:
            env["DOCKER_SERVICE_PREFER_OFFLINE_IMAGE"] = "1"
        began = time.monotonic()
        with open(self.log, "ab") as log:
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        api = docker.APIClient(base_url=self.url, version=_API_VERSION, timeout=5)

        def ready() -> bool:
            if self._proc is None or self._proc.poll() is not None:
                code = self._proc.returncode if self._proc else None
                raise EngineUnavailable(f"dockerd {self.name} exited ({code}):\n{self.log_tail()}")
            try:
                return bool(self.socket.exists() and api.ping())
            except Exception:  # any failure means "not up yet"
                return False

        try:
            if not _wait(ready, timeout):
                raise EngineUnavailable(f"dockerd {self.name} did not answer within {timeout:.0f} s:\n{self.log_tail()}")
        finally:
            api.close()
        self.timings["daemon_start_s"] = time.monotonic() - began
        self._mntns = _ns_inode(f"/proc/{self._proc.pid}/ns/mnt")
        if self._mntns == _ns_inode("/proc/self/ns/mnt"):
            self._mntns = None  # never sweep by the host's own mount namespace
        if not self.netns:
            # Swarm makes a link named docker_gwbridge unless the network exists: ours has a name of its own.
            self.client().networks.create(
                "docker_gwbridge",
                driver="bridge",
                options={
                    "com.docker.network.bridge.name": self._host_links[1],
                    "com.docker.network.bridge.enable_icc": "false",
                    "com.docker.network.bridge.enable_ip_masquerade": "false",
                },
            )

    def client(self, timeout: int = 60) -> docker.DockerClient:
        """A Docker SDK client on this engine's socket; stop() closes it."""
        c = docker.DockerClient(base_url=self.url, version=_API_VERSION, timeout=timeout)
        self._clients.append(c)
        return c

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no daemon log)"

    def load(self, archive: Path) -> list[str]:
        """``docker load`` a docker-save tar; returns the tags it brought."""
        with open(archive, "rb") as f:
            images = self.client(timeout=300).images.load(f)
        return [tag for image in images for tag in image.tags]

    def use_default_runtime(self, name: str, path: str, args: list[str], timeout: float = 30) -> None:
        """Make ``name`` (an OCI runtime at ``path``) this engine's default, as an operator does in daemon.json, and
        reload it (SIGHUP): containers started from now on run in it, swarm tasks included."""
        config = {"runtimes": {name: {"path": path, "runtimeArgs": args}}, "default-runtime": name}
        (self.dir / "daemon.json").write_text(json.dumps(config) + "\n")
        os.kill(int((self.dir / "docker.pid").read_text()), signal.SIGHUP)
        client = self.client()
        if not _wait(lambda: client.info().get("DefaultRuntime") == name, timeout, 0.2):
            raise EngineUnavailable(f"dockerd {self.name} did not take {name} as its default runtime:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL dockerd, its containerd, shims and containers together, as a node that lost power would look.
        What they leave (namespaces, cgroups, files) goes at stop()."""
        self._sweep()

    def stop(self, timeout: float = 5) -> None:
        """SIGTERM dockerd, SIGKILL whatever of the engine still lives ``timeout`` seconds later (dockerd gives each
        container its stop timeout, 10 s by default, a test's `sleep` ignores SIGTERM), then remove all it made."""
        for c in self._clients:
            with contextlib.suppress(Exception):
                c.close()
        self._clients.clear()
        if self.running and self._proc is not None:
            self._proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=timeout)
        try:
            self._sweep()
        finally:
            self._proc = None
            self._remove_cgroups()
            if not self.netns:
                for link in self._host_links:
                    if _run("ip", "link", "show", link, check=False).returncode == 0:
                        _run("ip", "link", "delete", link, check=False)
            _unmount_and_remove(self.dir)

    def leftovers(self) -> list[str]:
        """What of this engine is still on the host (processes, mounts, cgroups, links, its directory): [] after stop()."""
        left = [f"process {pid}: {_cmdline(pid)}" for pid in sorted(self._pids())]
        left += [f"mount {point}" for point in _mountpoints_under(self.dir)]
        left += [f"cgroup {top}" for top in self._cgroup_tops() if top.exists()]
        if not self.netns:
            left += [f"link {link}" for link in self._host_links if _run("ip", "link", "show", link, check=False).returncode == 0]
        if self.dir.exists() and not os.environ.get("MSB_TESTS_KEEP_BASE"):
            left.append(f"directory {self.dir}")
        return left

    def _pids(self) -> set[int]:
        """Every live process of this engine: in its mount namespace (dockerd, containerd, shims), in its cgroup
        parent (containers), in its network namespace, or naming its directory (a shim that outlived the rest)."""
        found: set[int] = set()
        netns = _ns_inode(f"/run/netns/{self.netns}") if self.netns else None
        marker = str(self.dir) + "/"
        cgroup = self.cgroup_parent + "/"
        protected = _protected_pids()
        if self._proc is not None and self._proc.poll() is None:
            found.add(self._proc.pid)
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in protected:
                continue
            pid = int(entry)
            try:
                if (
                    (self._mntns and _ns_inode(f"/proc/{pid}/ns/mnt") == self._mntns)
                    or (netns and _ns_inode(f"/proc/{pid}/ns/net") == netns)
                    or marker in _cmdline(pid)
                    or any(line.split(":", 2)[-1].startswith(cgroup) for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines())
                ):
                    found.add(pid)
            except OSError:
                continue
        return {pid for pid in found if _alive(pid)}

    def _sweep(self, timeout: float = 15) -> None:
        """SIGKILL until nothing of this engine lives (a dying dockerd may still start a shim between passes)."""
        deadline = time.monotonic() + timeout
        while pids := self._pids():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if self._proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=0.05)
            if time.monotonic() > deadline:
                raise EngineUnavailable(f"engine {self.name}: processes {sorted(pids)} survive SIGKILL")
            time.sleep(0.05)
        # The mount namespace died with its last process, and its inode number may now be reused by another's.
        self._mntns = None
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)

    def _cgroup_tops(self) -> list[Path]:
        """The cgroup parent in each hierarchy (cgroup v1) or in the unified one."""
        root, rel = Path("/sys/fs/cgroup"), self.cgroup_parent.lstrip("/")
        tops = [root / rel]
        with contextlib.suppress(OSError):
            tops += [h / rel for h in root.iterdir() if h.is_dir()]
        return tops

    def _remove_cgroups(self) -> None:
        for top in self._cgroup_tops():
            if top.is_dir():
                for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda w: len(w[0]), reverse=True):
                    with contextlib.suppress(OSError):
                        os.rmdir(dirpath)


def busybox_archive(dest: Path, tag: str = "msbt/busybox:1", busybox: str = "/bin/busybox") -> Path:
    """Write a docker-save tar of an image that holds only the host's static busybox (``bash scripts/apt-install
    busybox-static``) as /bin/busybox, with sh, cp, sleep, nc and a few more applets linked to it (a swarm kernel's
    wrapper runs sh and cp). No daemon needed."""
    src = Path(busybox)
    if not src.is_file():
        raise EngineUnavailable(f"{busybox} is missing (bash scripts/apt-install busybox-static)")
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.USTAR_FORMAT) as t:
        for d, mode in (("bin", 0o755), ("tmp", 0o1777), ("run", 0o755), ("home", 0o755)):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, mode
            t.addfile(info)
        data = src.read_bytes()
        info = tarfile.TarInfo("bin/busybox")
        info.size, info.mode = len(data), 0o755
        t.addfile(info, io.BytesIO(data))
        for applet in ("sh", "cp", "sleep", "nc", "cat", "echo", "hostname", "ip", "ping", "nslookup", "wget"):
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname, info.mode = tarfile.SYMTYPE, "busybox", 0o777
            t.addfile(info)
    layer_bytes = layer.getvalue()
    layer_id = hashlib.sha256(layer_bytes).hexdigest()
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    config = json.dumps(
        {
            "architecture": arch,
            "os": "linux",
            "created": "2024-01-01T00:00:00Z",
            "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"]},
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_id}"]},
            "history": [{"created": "2024-01-01T00:00:00Z", "created_by": "tests/engines.py busybox_archive"}],
        },
        sort_keys=True,
    ).encode()
    config_name = f"{hashlib.sha256(config).hexdigest()}.json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [tag], "Layers": [f"{layer_id}/layer.tar"]}]).encode()
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(dest, mode="w") as out:
        for name, blob in ((f"{layer_id}/layer.tar", layer_bytes), (config_name, config), ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(blob), 0o644
            out.addfile(info, io.BytesIO(blob))
    return dest


class TwoNodeSwarm:
    """A swarm of two private engines, manager and worker, each in a network namespace of its own, on a switch
    the host is also plugged into (see the module docstring); the dispatcher heartbeat is ``heartbeat_s`` so that
    a killed worker is seen as down within seconds (swarm's default is 5 s, i.e. ~15 s to notice)."""

    def __init__(self, base: Path, heartbeat_s: float = 1.0, *, prefer_offline_images: bool = True) -> None:
        self.base = Path(base)
        self.tag = secrets.token_hex(3)
        self.name = f"msbt-{self.tag}"
        self.dir = self.base / self.name
        self.heartbeat_s = heartbeat_s
        self._switch_ns = f"{self.name}-s"
        self._host_link = f"msbv{self.tag}"
        self.host_addr = self.manager_addr = self.worker_addr = ""
        offline = prefer_offline_images
        self.manager = DockerEngine(self.dir, f"{self.name}-m", netns=f"{self.name}-m", prefer_offline_images=offline)
        self.worker = DockerEngine(self.dir, f"{self.name}-w", netns=f"{self.name}-w", prefer_offline_images=offline)
        self.timings: dict[str, float] = {}
        self._made: list[str] = []  # network namespaces and the host link, in the order made: only those are deleted

    def start(self) -> None:
        """The switch, both engines, ``swarm init`` on the manager and the worker joined; returns once the manager
        lists 2 ready nodes. On failure all is cleaned up."""
        _require_host()
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        began = time.monotonic()
        block = _free_block(20)
        link = next(block.subnets(new_prefix=29))
        pools = list(block.subnets(new_prefix=22))
        overlay_pool = ipaddress.ip_network(f"198.19.{block.network_address.packed[2]}.0/20")
        self.host_addr, self.manager_addr, self.worker_addr = (str(link[i]) for i in (1, 2, 3))
        self.manager.pool, self.worker.pool = pools[1], pools[2]
        self.dir.mkdir(parents=True, exist_ok=True)
        sw = self._switch_ns
        for ns in (sw, str(self.manager.netns), str(self.worker.netns)):
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
        # The bridge lives in its own namespace, whose empty iptables let bridged frames pass; in the host's,
        # br_netfilter would send them through a FORWARD chain that Docker sets to DROP.
        _run("ip", "-n", sw, "link", "add", "sw", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "sw", "up")
        _run("ip", "link", "add", self._host_link, "type", "veth", "peer", "name", "to-host", "netns", sw)
        self._made.append(self._host_link)
        _run("ip", "addr", "add", f"{self.host_addr}/{link.prefixlen}", "dev", self._host_link)
        _run("ip", "link", "set", self._host_link, "up")
        _run("ip", "-n", sw, "link", "set", "to-host", "master", "sw", "up")
        for leg, engine, addr in (("to-manager", self.manager, self.manager_addr), ("to-worker", self.worker, self.worker_addr)):
            ns = str(engine.netns)
            _run("ip", "-n", sw, "link", "add", "name", leg, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "-n", sw, "link", "set", leg, "master", "sw", "up")
            _run("ip", "-n", ns, "addr", "add", f"{addr}/{link.prefixlen}", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _parallel([self.manager.start, self.worker.start])
        self.timings["daemons_start_s"] = time.monotonic() - began

        formed = time.monotonic()
        mgr = self.manager.client()
        mgr.swarm.init(
            advertise_addr=self.manager_addr,
            listen_addr=f"{self.manager_addr}:2377",
            default_addr_pool=[str(overlay_pool)],
            subnet_size=24,
            dispatcher_heartbeat_period=int(self.heartbeat_s * 1e9),
            task_history_retention_limit=5,
        )
        mgr.swarm.reload()
        self.worker.client().swarm.join(
            remote_addrs=[f"{self.manager_addr}:2377"],
            join_token=mgr.swarm.attrs["JoinTokens"]["Worker"],
            listen_addr=f"{self.worker_addr}:2377",
            advertise_addr=self.worker_addr,
        )
        self._wait_two_ready("the swarm has not 2 ready nodes")
        self.timings["swarm_form_s"] = time.monotonic() - formed
        self.timings["start_s"] = time.monotonic() - began

    def leftovers(self) -> list[str]:
        """What of the swarm is still on the host: [] after stop()."""
        left = self.manager.leftovers() + self.worker.leftovers()
        names = _run("ip", "netns", "list", check=False).stdout.split()
        left += [f"netns {ns}" for ns in (self.manager.netns, self.worker.netns, self._switch_ns) if ns in names]
        if _run("ip", "link", "show", self._host_link, check=False).returncode == 0:
            left.append(f"link {self._host_link}")
        if self.dir.exists() and not os.environ.get("MSB_TESTS_KEEP_BASE"):
            left.append(f"directory {self.dir}")
        return left

    def client(self) -> docker.DockerClient:
        """A client on the manager, where services, tasks and nodes are seen."""
        return self.manager.client()

    def node_ids(self) -> dict[str, str]:
        """{"manager": node id, "worker": node id}."""
        return {role: e.client().info()["Swarm"]["NodeID"] for role, e in (("manager", self.manager), ("worker", self.worker))}

    def network(self, name: str) -> str:
        """An overlay network (internal, attachable) that tasks and containers on both nodes may join; made once."""
        c = self.manager.client()
        for net in c.networks.list(names=[name]):
            if net.name == name:
                return net.id
        return c.networks.create(name, driver="overlay", internal=True, attachable=True).id

    def wait_node_state(self, node_id: str, state: str, timeout: float = 30) -> float:
        """Seconds until the manager reports the node's Status.State as ``state`` ("ready", "down")."""
        c = self.manager.client()
        began = time.monotonic()
        if not _wait(lambda: c.nodes.get(node_id).attrs["Status"]["State"] == state, timeout, 0.1):
            raise EngineUnavailable(f"node {node_id} not {state} after {timeout:.0f} s: {c.nodes.get(node_id).attrs['Status']}")
        return time.monotonic() - began

    def kill_worker(self, unplug: bool = False) -> None:
        """SIGKILL the worker's dockerd, containerd, shims and containers at once. With ``unplug`` its switch port
        goes down first, so the manager's packets meet silence (a machine gone) rather than refusals (a crashed
        daemon on a live machine)."""
        if unplug:
            _run("ip", "-n", self._switch_ns, "link", "set", "to-worker", "down")
        self.worker.kill()

    def revive_worker(self) -> None:
        """The killed worker back: its switch port up and its dockerd started on the same data root, which keeps the
        node's swarm state and images, so it rejoins as itself; returns once the manager lists 2 ready nodes again.
        The session shares one swarm (tests/swarm.py): a test that kills the worker revives it for the modules after."""
        _run("ip", "-n", self._switch_ns, "link", "set", "to-worker", "up")
        # What a reboot clears (/run): the dead containerd's socket and state would stop the new one from starting.
        shutil.rmtree(self.worker.dir / "exec", ignore_errors=True)
        (self.worker.dir / "docker.pid").unlink(missing_ok=True)
        self.worker.start()
        self._wait_two_ready("the worker did not rejoin")

    def _wait_two_ready(self, failure: str) -> None:
        mgr = self.manager.client()

        def two_ready() -> bool:
            nodes = mgr.nodes.list()
            return len(nodes) == 2 and all(n.attrs["Status"]["State"] == "ready" for n in nodes)

        if not _wait(two_ready, _NODE_WAIT_S, 0.1):
            states = [(n.attrs["Description"]["Hostname"], n.attrs["Status"]) for n in mgr.nodes.list()]
            raise EngineUnavailable(f"{failure} after {_NODE_WAIT_S:.0f} s: {states}\n{self.worker.log_tail()}")

    def stop(self) -> None:
        """Both engines and everything the harness made; idempotent and safe after a partial start. The engines are
        killed, not stopped: a graceful stop waits out each task's stop grace period and keeps nothing of use."""
        try:
            _parallel([self.manager.kill, self.worker.kill])
        finally:
            self._teardown()

    def _teardown(self) -> None:
        try:
            _parallel([self.manager.stop, self.worker.stop])
        finally:
            # Once no process is left in them, deleting the namespaces takes every veth and the bridge along.
            while self._made:
                made = self._made.pop()
                if made == self._host_link:
                    if _run("ip", "link", "show", made, check=False).returncode == 0:
                        _run("ip", "link", "delete", made, check=False)
                else:
                    _run("ip", "netns", "delete", made, check=False)
            _unmount_and_remove(self.dir)
