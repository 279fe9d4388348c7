"""What every sandbox's guest side shares: its user and home, the host directories it shows, the /etc entries
programs need, and the reaper its init becomes.

The one definition for the namespace and gVisor wings. No imports at all: the namespace init program
(namespace/init_program.py) reads this file by path, before any import path of the package's exists.
"""

SANDBOX_USER = "sandbox"
SANDBOX_HOME = "/home/sandbox"
# A plain `%pip install` in a kernel whose environment is read-only: into the sandbox's home, on sys.path from the start
# so that it imports at once; it lasts as long as the sandbox. (`--user` goes to the person's volume instead:
# msb_kernels/identity/volumes.py.) No progress bar: pip draws it on the pty that IPython runs it in, and under gVisor
# a bar of several packages never finished (`%pip install a b c` hung until interrupted).
USER_PACKAGES = f"{SANDBOX_HOME}/.local/site-packages"
PIP_ENV = {"PIP_TARGET": USER_PACKAGES, "PYTHONPATH": USER_PACKAGES, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_PROGRESS_BAR": "off"}
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
# Only what programs need from /etc; passwd, group, hosts and hostname are generated.
ETC_ENTRIES = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "nsswitch.conf",
    "localtime",
    "timezone",
    "ssl",
    "ca-certificates",
    "ca-certificates.conf",
    "fonts",
    "alternatives",
    "mime.types",
    "protocols",
    "services",
    "os-release",
    "debian_version",
    "inputrc",
    "terminfo",
    "matplotlibrc",
    "gai.conf",
)

# The reaper init becomes once the kernel runs: small, so the sandbox adds little memory.
REAPER = r"""
import os, select, signal, sys
kernel, lifeline, status_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if sys.argv[4:5] == ["undumpable"]:
    # The kernel runs as init's uid: it could PTRACE_ATTACH init, which then never saw its lifeline close, and the
    # sandbox outlived its owner and keeper with its disk. Undumpable, init can be traced by no one inside.
    import ctypes
    if ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        os._exit(1)
def forward(signum, frame=None):
    try:
        os.killpg(kernel, signum)
    except OSError:
        pass
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(s, forward)
wake_r, wake_w = os.pipe()
os.set_blocking(wake_w, False)
signal.set_wakeup_fd(wake_w)
signal.signal(signal.SIGCHLD, lambda *a: None)
poller = select.poll()  # not select(): the lifeline may be numbered past 1024
for fd in [wake_r] + ([lifeline] if lifeline >= 0 else []):
    poller.register(fd, select.POLLIN)
while True:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            os._exit(0)
        if pid == 0:
            break
        if pid == kernel:
            code = os.waitstatus_to_exitcode(status)
            try:  # a file descriptor opened before init gave up the right to open it, or a path
                if status_path.isdigit():
                    os.write(int(status_path), str(code).encode())
                else:
                    # The kernel could write in io/ too: what it left at the path (a FIFO, which an open would block on
                    # for good, hiding its death; a link) is replaced by a file of ours, never opened.
                    fresh = status_path + ".reaper"
                    try:
                        os.unlink(fresh)
                    except OSError:
                        pass
                    fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
                    try:
                        os.write(fd, str(code).encode())
                    finally:
                        os.close(fd)
                    os.rename(fresh, status_path)
            except OSError:
                pass
            os._exit(code if code >= 0 else 128 - code)
    ready = [fd for fd, _ in poller.poll()]
    if wake_r in ready:
        os.read(wake_r, 512)
    if lifeline in ready and not os.read(lifeline, 64):
        forward(signal.SIGKILL)
        os._exit(137)
"""
