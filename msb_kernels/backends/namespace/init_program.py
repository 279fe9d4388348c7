"""The namespace sandbox's launcher and init; runs as ``python -S .../nsinit.py`` (a script, for a fast start),
or in a fork of a fork server (forkserver_program.py calls launch() with its own kernel start and reaper).

The host side (namespace/backend.py) writes one JSON line, the launch plan, to stdin. Then:

1. The launcher opens the sandbox's cgroups' procs files. With MSB_ALLOW_NETWORK it forks
   the network helper (slirp4netns) while still in the host's network namespace. Then it
   unshares mount, pid, net, ipc and uts namespaces (plus a user namespace when the host
   is not root, and the cgroup namespace when there are no cgroups).
2. It forks the sandbox's init (pid 1), and puts init (and the helper) in the cgroups
   while init builds a fresh root: a read-only tmpfs holding read-only binds of what a
   kernel needs, a private /dev with its own devpts, /tmp and home on the sandbox's disk
   (a loop-mounted image, once the host has formatted it; RAM when the host cannot), the
   kernel's io dir, the shared volume; then pivot_root, loopback up. With a network, it
   waits for the helper's tap0 and adds the routes that fence off the host and the LAN,
   while it still holds CAP_NET_ADMIN over the namespace. Init then waits until it is in
   its cgroups, and unshares its cgroup namespace there.
3. Init gives up host privileges for good: an unprivileged uid when the host is
   root, no_new_privs, and a user namespace where it is uid 1000.
4. With MSB_TRANSPORT=tcp it forks the relay (see _relay). Then it forks the kernel
   and becomes a tiny reaper that forwards signals to the kernel and kills the sandbox
   when the owner's lifeline closes (an exec of REAPER; forked kernels' inits run it in place).
5. The launcher prints ``{"pid": <init's host pid>}`` (or ``{"error": ...}``),
   waits for the host to close stdin (it has taken a pidfd by then), and exits.

Only the standard library is used: this code runs before and inside the sandbox.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import resource
import select
import socket
import struct
import sys
from collections.abc import Callable

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
SYS_MOVE_MOUNT, AT_FDCWD, MOVE_MOUNT_F_EMPTY_PATH = 429, -100, 4
MS_RELATIME = 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NAME = 15
LINUX_CAPABILITY_VERSION_3 = 0x20080522
PR_SET_NO_NEW_PRIVS = 38
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
RTM_NEWROUTE = 24
NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE = 0x4, 0x200, 0x400
RT_TABLE_MAIN, RTPROT_STATIC, RTN_UNICAST, RTN_PROHIBIT = 254, 4, 1, 8
RTA_DST, RTA_GATEWAY = 1, 5
NETWORK_READY_TIMEOUT = 10.0
RELAY_NAME = b"msb-relay"
LOOP_CTL_GET_FREE = 0x4C82
LOOP_CONFIGURE = 0x4C0A
LO_FLAGS_AUTOCLEAR = 4
LO_FLAGS_DIRECT_IO = 16
# struct loop_config: fd, block_size, struct loop_info64 (lo_flags at offset 52), 64 reserved bytes.
LOOP_CONFIG = struct.Struct("=II52xI176x64x")

PIVOT_ROOT_SYSCALL = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217, "armv7l": 218, "i686": 217}


def _definitions(relative: str) -> dict:
    """A file of the package's, read by path: this script runs with no import path of the package's (see its docstring)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), relative)
    definitions: dict = {"__name__": "msb_guest", "__file__": path}
    with open(path) as source:
        exec(compile(source.read(), path, "exec"), definitions)  # our own file, beside this one
    return definitions


_GUEST = _definitions("backends/core/guest.py")
SANDBOX_USER, SANDBOX_HOME, SYSTEM_DIRS, ETC_ENTRIES, REAPER = (
    _GUEST[name] for name in ("SANDBOX_USER", "SANDBOX_HOME", "SYSTEM_DIRS", "ETC_ENTRIES", "REAPER")
)
_RELAY = _definitions("egress/relay_program.py")  # the byte relay: the egress route's, and the tcp transport's
_netlink = _definitions("egress/netlink.py")["request"]  # the routes that fence off the host and the LAN
# /dev/tty is the opening process's own controlling terminal: inside, always one of the sandbox's ptys.
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")


_libc = ctypes.CDLL(None, use_errno=True)
StartKernel = Callable[[dict, int], None]
BecomeReaper = Callable[[dict, int, list[int]], None]


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _pivot_root(new_root: str, put_old: str) -> None:
    number = PIVOT_ROOT_SYSCALL.get(os.uname().machine)
    if number is None:
        raise OSError(f"pivot_root: unsupported architecture {os.uname().machine}")
    _check(_libc.syscall(number, new_root.encode(), put_old.encode()), "pivot_root")


def _write(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def _enter_user_namespace(flags: int, inner_uid: int) -> None:
    """Unshare a user namespace (with flags) where this process's ids appear as inner_uid."""
    outer_uid, outer_gid = os.geteuid(), os.getegid()  # read before: after unshare they read as 65534
    _unshare(CLONE_NEWUSER | flags)
    for name, text in (("setgroups", "deny"), ("uid_map", f"{inner_uid} {outer_uid} 1"), ("gid_map", f"{inner_uid} {outer_gid} 1")):
        try:
            _write(f"/proc/self/{name}", text)
        except OSError as exc:
            raise OSError(exc.errno, f"writing /proc/self/{name}: {exc.strerror}") from None


def _locked_flags(source: str) -> int:
    """Flags a read-only remount must keep, or an unprivileged remount fails with EPERM."""
    flag = os.statvfs(source).f_flag
    flags = 0
    for st, ms in (
        (os.ST_NOEXEC, MS_NOEXEC),
        (os.ST_NOATIME, MS_NOATIME),
        (os.ST_NODIRATIME, MS_NODIRATIME),
        (os.ST_RELATIME, MS_RELATIME),
    ):
        if flag & st:
            flags |= ms
    return flags


def _mountpoint(target: str, is_dir: bool) -> None:
    if is_dir:
        os.makedirs(target, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        if not os.path.exists(target):
            open(target, "w").close()


def _attach(tree: int, target: str) -> None:
    """Attach the host's idmapped mount of a directory (core/idmap.py's attach: this script imports nothing of ours)."""
    _mountpoint(target, True)
    _check(_libc.syscall(SYS_MOVE_MOUNT, tree, b"", AT_FDCWD, target.encode(), MOVE_MOUNT_F_EMPTY_PATH), f"attach {target}")
    os.close(tree)


def _bind(source: str, target: str, *, readonly: bool) -> None:
    _mountpoint(target, os.path.isdir(source))
    _mount(source, target, None, MS_BIND | MS_REC)
    flags = MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | _locked_flags(source)
    if readonly:
        flags |= MS_RDONLY
    _mount(None, target, None, flags)


def _attach_loop(image: str) -> tuple[str, int]:
    """Attach image to a free loop device that detaches itself once nothing holds it (autoclear)."""
    backing = os.open(image, os.O_RDWR | os.O_CLOEXEC)
    control = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    try:
        for _ in range(32):  # another process may take the free device first
            device = f"/dev/loop{fcntl.ioctl(control, LOOP_CTL_GET_FREE)}"
            loop = os.open(device, os.O_RDWR | os.O_CLOEXEC)
            for flags in (LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO, LO_FLAGS_AUTOCLEAR):
                try:
                    fcntl.ioctl(loop, LOOP_CONFIGURE, LOOP_CONFIG.pack(backing, 0, flags))
                    return device, loop
                except OSError as exc:
                    if exc.errno == errno.EBUSY:
                        break
                    if exc.errno != errno.EINVAL or not flags & LO_FLAGS_DIRECT_IO:
                        os.close(loop)
                        raise OSError(exc.errno, f"attaching the sandbox's disk to {device}: {exc.strerror}") from None
            os.close(loop)
        raise OSError(errno.EBUSY, "no free loop device for the sandbox's disk")
    finally:
        os.close(control)
        os.close(backing)


def _mount_scratch(plan: dict, root: str) -> None:
    """/tmp and home on one filesystem of the flavor's disk size, so together they stop at it."""
    scratch = plan["scratch_mount"]
    if plan.get("scratch_image"):
        if plan.get("scratch_ready_fd") is not None:  # the host formats the disk while the root is being built
            formatted = os.read(plan["scratch_ready_fd"], 1)
            os.close(plan["scratch_ready_fd"])
            if formatted != b"1":
                raise OSError("the sandbox's disk was not formatted (mkfs.ext4 failed; the host's log says why)")
        device, loop = _attach_loop(plan["scratch_image"])
        try:  # noinit_itable: the image reads as zeros, so no background thread writes the inode tables
            _mount(device, scratch, "ext4", MS_NOSUID | MS_NODEV, "noinit_itable,nobarrier")
        finally:
            os.close(loop)  # the mount holds the device now; when it goes, autoclear detaches it
    else:
        _mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0755,size={plan['scratch_bytes']}")
    for name, mode, target in (("tmp", 0o1777, "/tmp"), ("home", 0o700, SANDBOX_HOME)):
        place = f"{scratch}/{name}"
        os.mkdir(place)
        os.chmod(place, mode)
        os.chown(place, plan["home_uid"] if name == "home" else 0, plan["home_gid"] if name == "home" else 0)
        _bind(place, root + target, readonly=False)


def _placeholders(plan: dict, root: str, *, before_scratch: bool) -> None:
    """A pooled sandbox's empty directories where its hand-out mounts (core/handout.py): a tmpfs of root's each, for
    the host to make and attach its taker's in (the root is read-only). Those under /tmp or home after those, the others
    before, so that home shows in a /home of them."""
    for path in plan.get("placeholders") or ():
        late = any(path == top or path.startswith(top + "/") for top in ("/tmp", SANDBOX_HOME))
        if late != before_scratch:
            os.makedirs(root + path, mode=0o755, exist_ok=True)
            _mount("tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")


def _build_root(plan: dict) -> None:
    root = plan["root_dir"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=16m")

    for name in SYSTEM_DIRS:
        source = "/" + name
        if os.path.islink(source):
            os.symlink(os.readlink(source), root + source)
        elif os.path.isdir(source):
            _bind(source, root + source, readonly=True)
    os.makedirs(root + "/etc", mode=0o755, exist_ok=True)
    for name in ETC_ENTRIES:
        source = "/etc/" + name
        if os.path.islink(source) and not os.path.exists(source):
            continue
        if os.path.islink(source) and name == "localtime":
            os.symlink(os.readlink(source), root + source)
        elif os.path.exists(source):
            _bind(source, root + source, readonly=True)
    _write(
        root + "/etc/passwd",
        f"root:x:0:0::/root:/usr/sbin/nologin\n{SANDBOX_USER}:x:1000:1000::{SANDBOX_HOME}:/bin/sh\nnobody:x:65534:65534::/nonexistent:/usr/sbin/nologin\n",
    )
    _write(root + "/etc/group", f"root:x:0:\n{SANDBOX_USER}:x:1000:\nnogroup:x:65534:\n")
    _write(root + "/etc/hostname", plan["hostname"] + "\n")
    _write(root + "/etc/hosts", f"127.0.0.1\tlocalhost {plan['hostname']}\n::1\tlocalhost ip6-localhost\n")
    nameservers = ["127.0.0.1"] if plan.get("egress") else (plan.get("network") or {}).get("nameservers", ())
    _write(root + "/etc/resolv.conf", "".join(f"nameserver {a}\n" for a in nameservers))

    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)

    os.makedirs(root + "/dev")
    _mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    for name in DEVICES:
        _mountpoint(root + "/dev/" + name, False)
        _mount("/dev/" + name, root + "/dev/" + name, None, MS_BIND)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, root + "/dev/" + name)
    # A devpts of its own: the sandbox sees and gets only its own terminals, never the host's.
    os.makedirs(root + "/dev/pts")
    _mount("devpts", root + "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, f"newinstance,ptmxmode=0666,mode=0620,gid={plan['home_gid']}")
    os.symlink("pts/ptmx", root + "/dev/ptmx")
    os.makedirs(root + "/dev/shm")
    _mount("tmpfs", root + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={plan['shm_bytes']}")

    _placeholders(plan, root, before_scratch=True)
    _mount_scratch(plan, root)
    _placeholders(plan, root, before_scratch=False)
    os.makedirs(root + "/run")
    _mount("tmpfs", root + "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k")
    # After the tmpfs mounts, so what lies under /tmp or /home stays visible. Lab's root first: an interpreter
    # inside it is then bound read-only on top, even where the root is writable.
    shown = []
    for path, writable, tree in plan.get("host_dirs") or ():
        if tree is not None:  # the host's idmapped mount of it (core/idmap.py): its owner's files are ours
            _attach(tree, root + path)
            shown.append(path + "/")
        elif os.path.isdir(path):
            _bind(path, root + path, readonly=not writable)
            shown.append(path + "/")
    for path in plan["readonly_paths"]:
        inside = any(path.startswith(top) for top in shown)
        if os.path.exists(path) and (inside or not os.path.exists(root + path)):
            _bind(path, root + path, readonly=True)

    _bind(plan["io_dir"], root + plan["guest_io_dir"], readonly=False)
    _bind(plan["host_dir"], root + plan["guest_host_dir"], readonly=True)  # what the host wrote: the kernel's to read
    if plan.get("shared"):
        host_path, guest_path = plan["shared"]
        if plan.get("shared_fd") is not None:  # the host's idmapped mount of it (core/idmap.py): its owner's files are ours
            _attach(plan["shared_fd"], root + guest_path)
        else:
            _bind(host_path, root + guest_path, readonly=False)

    os.chdir(root)
    _pivot_root(".", ".")
    _check(_libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")
    _mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def _add_route(destination: str, route_type: int, gateway: str | None = None) -> None:
    address, _, bits = destination.partition("/")
    body = struct.pack("=BBBBBBBBI", socket.AF_INET, int(bits or 32), 0, 0, RT_TABLE_MAIN, RTPROT_STATIC, 0, route_type, 0)
    for kind, value in ((RTA_DST, address), (RTA_GATEWAY, gateway)):
        if value:
            body += struct.pack("=HH", 8, kind) + socket.inet_aton(value)
    try:
        _netlink(RTM_NEWROUTE, NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL, body)
    except OSError as exc:
        raise OSError(exc.errno, f"adding the route for {destination}: {exc.strerror}") from None


def _start_network_helper(network: dict, ready_write: int, exit_read: int) -> tuple[int, int]:
    """Fork the helper (slirp4netns) while still in the host's network namespace; it waits for init's pid.
    Returns the pipe to send that pid on, and the helper's own pid.

    It serves the sandbox's tap device from the host side, writes to ready_write once the
    interface is configured, and quits when exit_read reaches EOF: init holds the write end,
    so the helper goes when the sandbox does, however it ends.
    """
    pid_read, pid_write = os.pipe()
    helper = os.fork()
    if helper == 0:
        try:
            os.close(pid_write)
            target = os.read(pid_read, 32).decode().strip()
            if not target:
                os._exit(0)
            log = os.open(network["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            null = os.open("/dev/null", os.O_RDWR)
            os.dup2(null, 0)
            os.dup2(null, 1)  # not the launcher's stdout: the host reads that until EOF
            os.dup2(log, 2)
            os.setsid()
            for fd in (ready_write, exit_read):
                os.set_inheritable(fd, True)
            argv = [*network["helper"], f"--ready-fd={ready_write}", f"--exit-fd={exit_read}"]
            if network.get("join_user_namespace"):
                argv.append(f"--userns-path=/proc/{target}/ns/user")
            os.execv(argv[0], [*argv, target, network["interface"]])
        except BaseException as exc:
            os.write(2, f"cannot start {network['helper'][0]}: {exc}\n".encode())
        os._exit(127)
    os.close(pid_read)
    return pid_write, helper


def _await_network(ready_read: int) -> None:
    poller = select.poll()
    poller.register(ready_read, select.POLLIN)
    if not poller.poll(int(NETWORK_READY_TIMEOUT * 1000)):
        raise RuntimeError(f"the network helper did not configure the sandbox's interface within {NETWORK_READY_TIMEOUT:.0f} s")
    if not os.read(ready_read, 16):
        raise RuntimeError("the network helper exited before the sandbox's interface was up")
    os.close(ready_read)


def _restrict_routes(network: dict) -> None:
    """Routes the sandboxed code cannot change (no CAP_NET_ADMIN over this namespace once privileges drop):
    the host's own addresses and the LAN are prohibited, so connect() fails at once and nothing is sent;
    the host's DNS servers stay reachable through the helper's gateway."""
    for nameserver in network["nameservers"]:
        _add_route(nameserver, RTN_UNICAST, network["gateway"])
    for destination in network["prohibited"]:
        _add_route(destination, RTN_PROHIBIT)


def _drop_privileges(plan: dict) -> None:
    if plan["rootful"]:
        uid, gid = plan["uid"], plan["gid"]
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)  # from root to non-root: every capability is gone
        # A uid change makes /proc/self root-owned; we must still write our own uid_map.
        _check(_libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(dumpable)")
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
    _enter_user_namespace(0, 1000)
    # No namespaces inside the sandbox: nested user namespaces are the door to the rest,
    # and an unprivileged attack surface of the host kernel.
    _write("/proc/sys/user/max_user_namespaces", "0")


def _apply_fallback_limits(plan: dict) -> None:
    """Limits that hold without cgroups; with cgroups only RLIMIT_CORE is set here."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if plan.get("nproc_limit"):
        resource.setrlimit(resource.RLIMIT_NPROC, (plan["nproc_limit"], plan["nproc_limit"]))
    if plan.get("cpu_affinity"):
        allowed = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, allowed[: plan["cpu_affinity"]])


def drop_capabilities() -> None:
    """Give up the capabilities init holds over the sandbox's own user namespace: an exec as uid 1000 would drop
    them; the relay and a forked kernel never exec."""
    header = struct.pack("=Ii", LINUX_CAPABILITY_VERSION_3, 0)
    _check(_libc.capset(header, bytes(24)), "capset")


def die_with_parent(signum: int) -> None:
    """Have the kernel send signum to this process when its parent ends (0: nothing)."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0), "prctl(pdeathsig)")


def close_descriptors_but(kept: list[int]) -> None:
    """Close every descriptor above 2 that is not kept: a fork, unlike an exec, closes none by itself."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in kept:
            try:
                os.close(fd)
            except OSError:
                continue  # the directory listdir held open


def prepare_kernel_process(plan: dict) -> None:
    """What every kernel process gets before its code runs, exec'd or forked (forkserver_program.py)."""
    os.setpgid(0, 0)
    os.dup2(0, 1)  # /dev/null: kernels print connection banners there; stderr (crashes) reaches the host
    if plan.get("data_limit"):
        resource.setrlimit(resource.RLIMIT_DATA, (plan["data_limit"], plan["data_limit"]))
    try:
        os.chdir(plan.get("working_dir") or SANDBOX_HOME)
    except OSError:  # the notebook's directory went away, or is not shown: start at home, as without a Lab root
        os.chdir(SANDBOX_HOME)
    os.umask(0o002)
    for directory in plan.get("kernel_dirs", ()):
        os.makedirs(directory, exist_ok=True)  # on sys.path from the start, so what lands there imports at once
    for source, destination in plan.get("kernel_copies", ()):
        copy_file(source, destination)


def copy_file(source: str, destination: str) -> None:
    """The kernel's own copy of a file the host wrote for it read-only, made as its user in its own directory (which
    the host cleared before this start: the copy is new, and never through a link)."""
    with open(source, "rb") as handle:
        data = handle.read()
    fd = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def exec_kernel(plan: dict, error_pipe: int) -> None:
    """Start the kernel as a new program; the error pipe is close-on-exec, so its EOF tells init the exec worked."""
    try:
        prepare_kernel_process(plan)
        os.execvpe(plan["argv"][0], plan["argv"], plan["env"])
    except BaseException as exc:  # report to init, which reports to the host
        os.write(error_pipe, f"cannot start kernel {plan['argv'][0]!r}: {exc}".encode())
        os._exit(127)


def _run_init(
    plan: dict,
    status_pipe: int,
    network_ready: int | None,
    network_exit: int | None,
    cgroups_joined: int | None,
    start_kernel: StartKernel,
    become_reaper: BecomeReaper,
) -> None:
    """pid 1 of the sandbox: build it, start the kernel, become the reaper."""
    try:
        os.setsid()
        null = os.open("/dev/null", os.O_RDWR)
        os.dup2(null, 0)  # the launcher's pipes to the host stay with the launcher
        os.dup2(2, 1)
        os.close(null)
        _build_root(plan)
        _loopback_up()
        egress = _RELAY["bind_listeners"](plan["egress"]["listeners"]) if plan.get("egress") else []  # while init may bind port 53
        if network_ready is not None:
            _await_network(network_ready)
            _restrict_routes(plan["network"])
        _check(_libc.sethostname(plan["hostname"].encode(), len(plan["hostname"])), "sethostname")
        if cgroups_joined is not None:
            if os.read(cgroups_joined, 1) != b"1":
                raise RuntimeError("the launcher could not put the sandbox in its cgroups")
            os.close(cgroups_joined)
            _unshare(CLONE_NEWCGROUP)  # rooted at the sandbox's own cgroup, now that init is in it
        _drop_privileges(plan)
        _apply_fallback_limits(plan)
        listeners = plan.get("listen_fds") or []
        if listeners and os.fork() == 0:
            try:
                _relay(listeners)
            finally:
                os._exit(1)
        for fd in listeners:
            os.close(fd)  # before the kernel exists: only the relay holds the host's sockets
        if egress and os.fork() == 0:
            try:
                start_egress_relay(plan, egress)
            finally:
                os._exit(1)
        for fd, _, _ in egress:
            os.close(fd)
        error_read, error_write = os.pipe()  # close-on-exec: EOF means the exec worked
        kernel = os.fork()
        if kernel == 0:
            os.close(error_read)
            start_kernel(plan, error_write)
        os.close(error_write)
        failure = os.read(error_read, 4096)
        if failure:
            raise RuntimeError(failure.decode(errors="replace"))
    except BaseException as exc:
        os.write(status_pipe, f"sandbox setup failed: {exc}".encode())
        os._exit(1)
    os.write(status_pipe, b"ok")
    os.close(status_pipe)
    become_reaper(plan, kernel, [fd for fd in (plan.get("lifeline_fd"), network_exit) if fd is not None])


def start_egress_relay(plan: dict, egress: list[list]) -> None:
    """The egress relay (msb_kernels/egress/relay_program.py), in this forked child of init: a session of its own,
    holding only its listeners, so the kernel's interrupts never reach it and it holds nothing of init's."""
    os.setsid()
    _libc.prctl(PR_SET_NAME, b"msb-egress", 0, 0, 0)
    drop_capabilities()
    close_descriptors_but([fd for fd, _, _ in egress])
    _RELAY["relay"](egress, _RELAY["proxy_connector"](plan["egress"]["socket"]))


def reaper_arguments(plan: dict, kernel: int) -> list[str]:
    lifeline = plan.get("lifeline_fd")
    return [str(kernel), str(-1 if lifeline is None else lifeline), plan["guest_io_dir"] + "/exit_status", "undumpable"]


def exec_reaper(plan: dict, kernel: int, kept_fds: list[int]) -> None:
    """Init becomes REAPER, a small interpreter of its own. kept_fds: the lifeline, and the network
    helper's exit pipe (the helper quits when it closes)."""
    for fd in kept_fds:
        os.set_inheritable(fd, True)
    python = plan["python"]
    os.execve(python, [python, "-I", "-S", "-c", REAPER, *reaper_arguments(plan, kernel)], {"PATH": "/usr/bin:/bin"})


def _relay(listeners: list[int]) -> None:
    """The tcp transport: copy bytes between the host's loopback and the kernel's, both ways.

    listeners are TCP sockets the host bound on its own 127.0.0.1, in the host's network
    namespace; each accepted connection is joined to the same port on the sandbox's own
    127.0.0.1, where the kernel binds. Such a socket could be disconnected and reconnected
    anywhere the host can reach, so no sandboxed process may ever hold one: the relay is
    forked before the kernel and made undumpable at once (no ptrace, no /proc/<pid>/fd, no
    pidfd_getfd for the kernel's processes), and init closes its own copies before the kernel exists.
    """
    _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(undumpable)")
    _libc.prctl(PR_SET_NAME, RELAY_NAME, 0, 0, 0)
    drop_capabilities()
    close_descriptors_but(listeners)  # nothing of init's but the listeners
    _RELAY["relay"]([[fd, "kernel", "tcp"] for fd in listeners], _RELAY["connector"]({"dial": "127.0.0.1"}))


def _helper_log_tail(network: dict) -> str:
    try:
        with open(network["log"], errors="replace") as handle:
            tail = handle.read()[-600:].strip()
    except OSError:
        return ""
    return f" ({os.path.basename(network['helper'][0])} said: {tail})" if tail else ""


def launch(plan: dict, start_kernel: StartKernel = exec_kernel, become_reaper: BecomeReaper = exec_reaper) -> dict:
    """Build the sandbox the plan describes and start its kernel with start_kernel, in a forked child of init that
    must close the error pipe once the kernel runs (or write why it cannot); then init runs become_reaper. The report
    for the host: init's pid, or the error. Called by main(), and by forkserver_program.py in a fork of the server."""
    try:
        # The sandbox's own directories (its root's mountpoints, /home, /etc) must have the modes written here, not
        # what the operator's umask leaves of them: with umask 077 a 0700 /home kept the kernel out of its home.
        # This process is the sandbox's alone (a script, or a fork of the fork server); the kernel sets its own.
        os.umask(0o022)
        if plan.get("oom_score_adj") is not None:  # before any fork: the network helper, init and the kernel inherit it
            try:
                with open("/proc/self/oom_score_adj", "w") as score:
                    score.write(str(plan["oom_score_adj"]))
            except OSError:
                pass  # a host whose /proc refuses it: the sandbox still starts, as any process would
        if plan.get("lifeline_fd") is not None:
            os.set_inheritable(plan["lifeline_fd"], False)  # init passes it on to the reaper, never to the kernel
        for fd in (plan.get("scratch_ready_fd"), plan.get("shared_fd"), *(entry[2] for entry in plan.get("host_dirs") or ())):
            if fd is not None:
                os.set_inheritable(fd, False)
        for fd in plan.get("listen_fds") or []:
            os.set_inheritable(fd, False)  # inherited by forks only: the relay's, never an exec's
        # Opened now, while the host's cgroup mounts are in view: init is put in them once it exists (below).
        cgroup_procs = [os.open(procs, os.O_WRONLY | os.O_CLOEXEC) for procs in plan["cgroup_procs"]]
        network_ready = network_exit = helper_pid_pipe = helper = None
        if plan.get("network"):
            network_ready, ready_write = os.pipe()
            exit_read, network_exit = os.pipe()
            helper_pid_pipe, helper = _start_network_helper(plan["network"], ready_write, exit_read)
            os.close(ready_write)
            os.close(exit_read)
        flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
        if not cgroup_procs:
            flags |= CLONE_NEWCGROUP  # with cgroups, init unshares it once it is in the sandbox's own
        if plan["rootful"]:
            _unshare(flags)
        else:
            _enter_user_namespace(flags, 0)
        status_read, status_write = os.pipe()
        joined_read, joined_write = os.pipe() if cgroup_procs else (None, None)
        init = os.fork()
        if init == 0:
            os.close(status_read)
            if joined_write is not None:
                os.close(joined_write)
            if helper_pid_pipe is not None:
                os.close(helper_pid_pipe)
            _run_init(plan, status_write, network_ready, network_exit, joined_read, start_kernel, become_reaper)
        os.close(status_write)
        join_failure = ""
        if cgroup_procs:
            os.close(joined_read)
            # While init builds the root: a process's first move into a cgroup v1 hierarchy waits out an RCU grace
            # period (some 10 ms here), which before the fork was all start time. Init starts no other process,
            # and runs nothing of the kernel's, until it reads the byte. The helper's memory and CPU count toward
            # the flavor too.
            try:
                for fd in cgroup_procs:
                    for pid in (init, helper):
                        if pid is not None:
                            os.write(fd, str(pid).encode())
                os.write(joined_write, b"1")
            except OSError as exc:
                join_failure = f" (joining the sandbox's cgroups: {exc})"
            finally:
                os.close(joined_write)
                for fd in cgroup_procs:
                    os.close(fd)
        if helper_pid_pipe is not None:
            os.write(helper_pid_pipe, str(init).encode())
            os.close(helper_pid_pipe)
            os.close(network_ready)
        chunks = []
        while chunk := os.read(status_read, 4096):
            chunks.append(chunk)
        status = b"".join(chunks).decode(errors="replace")
        if status != "ok":
            status += join_failure
        if status != "ok" and plan.get("network"):
            status += _helper_log_tail(plan["network"])
        return {"pid": init} if status == "ok" else {"error": status or "sandbox init exited during setup"}
    except Exception as exc:
        # The errno lets the host tell a full host (EAGAIN: no process could be made) from a fault.
        return {"error": f"sandbox launch failed: {exc}", **({"errno": exc.errno} if isinstance(exc, OSError) and exc.errno else {})}


def main() -> None:
    try:
        report = launch(json.loads(sys.stdin.readline()))
    except ValueError as exc:
        report = {"error": f"sandbox launch failed: the plan is not JSON ({exc})"}
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()
    sys.stdin.read()  # the host closes stdin once it holds a pidfd for init
    os._exit(0)


if __name__ == "__main__":
    main()
