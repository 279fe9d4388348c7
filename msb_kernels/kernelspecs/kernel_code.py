"""Source code that runs inside the kernels, one piece per template and purpose.

Templates (msb_kernels.kernelspecs.templates) choose among these; nothing here runs on the host.
Startup files run before the user's first cell; command runners are what execute_command
sends as an execute request.
"""

# Python startup: a MemoryError also prints what the flavor's limit was and how to get more.
PYTHON_MEMORY_HINT = """\
def _msb_install_memory_hint():
    import sys
    message = {message!r}

    def _on_memory_error(shell, etype, value, tb, tb_offset=None):
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
        print(message, file=sys.stderr)

    get_ipython().set_custom_exc((MemoryError,), _on_memory_error)


_msb_install_memory_hint()
del _msb_install_memory_hint
"""


# Python startup: sys.stdout.flush() and sys.stderr.flush() return at once when nothing is waiting to be sent.
# ipykernel's OutStream.flush always hands two callbacks to its IOPub thread and waits for the second, and
# every execute request flushes both streams three times, so a cell that printed nothing paid twelve thread
# wake-ups: 1.05 ms of a `1+1` to its idle status on a 2-core VM (a plain ipykernel with and without, interleaved). With an empty
# buffer and no flush pending, everything written before has already been handed to the IOPub thread, which
# sends in order, so the idle status still follows every stream message. A forked child keeps the full
# flush, and so does an OutStream without these fields (an ipykernel other than 6.29 to 7.x).
PYTHON_QUICK_FLUSH = """\
def _msb_install_quick_flush():
    import sys
    from ipykernel.iostream import OutStream

    if getattr(OutStream.flush, "msb_quick_flush", False):
        return
    if not all(hasattr(sys.stdout, name) for name in ("_buffers", "_buffer_lock", "_flush_pending", "_is_master_process")):
        return
    full_flush = OutStream.flush

    def flush(self):
        if self._is_master_process():
            with self._buffer_lock:
                if not self._buffers and not self._flush_pending:
                    return
        full_flush(self)

    flush.msb_quick_flush = True
    flush.__doc__ = full_flush.__doc__
    OutStream.flush = flush


_msb_install_quick_flush()
del _msb_install_quick_flush
"""


# jupyter_server (a plain `jupyter lab` running these kernelspecs; our gateway gives each socket its own)
# uses a client's session id as its ZMQ identity, and JupyterLab reconnects with the same session id
# while the old socket is still open. ipykernel sets ZMQ_ROUTER_HANDOVER on its ROUTER sockets, so the
# newest peer takes the identity over; tslab does not, and keeps answering the dead peer: the notebook
# hangs. Loaded with NODE_OPTIONS=--require, so node processes the user starts load it too; there
# zeromq is not beside the main script and it does nothing.
NODE_ROUTER_HANDOVER = """\
"use strict";
(() => {
  let zmq;
  try {
    const main = require("fs").realpathSync(process.argv[1] || "");
    if (!main.includes("/tslab/")) return;
    zmq = require(require.resolve("zeromq", { paths: [require("path").dirname(main)] }));
  } catch {
    return;
  }
  const bind = zmq.Router.prototype.bind;  // inherited from the native Socket, read-only: define, not assign
  Object.defineProperty(zmq.Router.prototype, "bind", {
    configurable: true, writable: true,
    value: function (...args) {
      this.handover = true;
      return bind.apply(this, args);
    },
  });
})();
"""


# The command runners start argv (no shell), copy its stdout and stderr to the kernel's streams as
# they come, and print ``marker:<exit status>`` last. On an interrupt they kill the process group.
PYTHON_COMMAND_RUNNER = r"""
import codecs, os, selectors, signal, subprocess, sys

def run(argv, marker):
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    except FileNotFoundError:
        sys.stderr.write("command not found: %s\n" % argv[0])
        code = 127
    except PermissionError as exc:
        sys.stderr.write("cannot run %s: %s\n" % (argv[0], exc.strerror))
        code = 126
    except OSError as exc:
        sys.stderr.write("cannot run %s: %s\n" % (argv[0], exc))
        code = 126
    else:
        targets = {proc.stdout.fileno(): (sys.stdout, codecs.getincrementaldecoder("utf-8")("replace")),
                   proc.stderr.fileno(): (sys.stderr, codecs.getincrementaldecoder("utf-8")("replace"))}
        selector = selectors.DefaultSelector()
        for fd in targets:
            selector.register(fd, selectors.EVENT_READ)
        try:
            while targets:
                for key, _ in selector.select(0.5):
                    stream, decoder = targets[key.fd]
                    data = os.read(key.fd, 65536)
                    if data:
                        stream.write(decoder.decode(data))
                    else:
                        stream.write(decoder.decode(b"", final=True))
                        selector.unregister(key.fd)
                        del targets[key.fd]
                    stream.flush()
            code = proc.wait()
        except KeyboardInterrupt:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                proc.kill()
            proc.wait()
            sys.stderr.write("\n[interrupted: the command was killed]\n")
            code = 130
        finally:
            selector.close()
            proc.stdout.close()
            proc.stderr.close()
        if code < 0:
            code = 128 - code
    sys.stdout.flush()
    sys.stderr.flush()
    sys.stdout.write("%s:%d\n" % (marker, code))
    sys.stdout.flush()
"""

NODE_COMMAND_RUNNER = r"""await new Promise((resolve) => {
  const argv = ARGV;
  const marker = MARKER;
  let finished = false;
  let child = null;
  const onSigint = () => { if (child) { try { process.kill(-child.pid, "SIGKILL"); } catch (e) { child.kill("SIGKILL"); } } };
  const done = (code) => {
    if (finished) { return; }
    finished = true;
    process.removeListener("SIGINT", onSigint);
    process.stdout.write(marker + ":" + code + "\n");
    resolve(undefined);
  };
  process.on("SIGINT", onSigint);
  try {
    child = require("child_process").spawn(argv[0], argv.slice(1), { stdio: ["ignore", "pipe", "pipe"], detached: true });
  } catch (e) {
    process.stderr.write("cannot run " + argv[0] + ": " + e.message + "\n");
    done(126);
    return;
  }
  child.stdout.on("data", (d) => process.stdout.write(d.toString()));
  child.stderr.on("data", (d) => process.stderr.write(d.toString()));
  child.on("error", (e) => {
    if (Reflect.get(e, "code") === "ENOENT") { process.stderr.write("command not found: " + argv[0] + "\n"); done(127); }
    else { process.stderr.write("cannot run " + argv[0] + ": " + e.message + "\n"); done(126); }
  });
  child.on("close", (code, signal) => {
    if (signal === "SIGKILL" || signal === "SIGINT") { process.stderr.write("\n[interrupted: the command was killed]\n"); }
    done(code === null ? 130 : code);
  });
})"""


# upload_file / download_file (mcp_bridge/files.py): one step of a transfer, run silently in a Python kernel, inside
# its sandbox, as its user. REQUEST is the step as JSON; the answer is one JSON line before the marker. A path must
# resolve (symlinks in its directories followed) under one of the request's roots; the file itself is never followed
# if it is a symlink, and only regular files are read. An upload goes to a temporary file beside the target, opened
# O_EXCL|O_NOFOLLOW, and is renamed over it at the end: a symlink planted at the target is replaced, never written
# through. The sandbox is the boundary either way; these checks make a stray path a clear error, not a surprise.
PYTHON_FILE_STEP = r"""
def _msb_file_step(request, marker):
    import base64, hashlib, json, os, stat, sys
    answer = {}
    try:
        roots = [os.path.realpath(root) for root in request["roots"]]
        given = request["path"]
        # A relative path is the kernel's, as open() in a cell reads it: from its working directory (the notebook's folder).
        path = os.path.normpath(given if os.path.isabs(given) else os.path.join(os.getcwd(), given))
        directory = os.path.realpath(os.path.dirname(path))
        target = os.path.join(directory, os.path.basename(path))
        if not any(target.startswith(r.rstrip("/") + "/") for r in roots):
            raise PermissionError(13, "outside the session's files (" + ", ".join(request["roots"]) + ")", given)
        step = request["step"]
        temporary = os.path.join(directory, ".msb-upload-" + request.get("nonce", ""))
        if step == "write":
            if not request["offset"]:
                os.makedirs(directory, exist_ok=True)
            flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_APPEND if request["offset"] else os.O_CREAT | os.O_EXCL)
            fd = os.open(temporary, flags, 0o644)
            try:
                data = base64.b64decode(request["data"])
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            answer = {"written": request["offset"] + len(data)}
        elif step == "commit":
            if os.path.isdir(target) and not os.path.islink(target):
                raise IsADirectoryError(21, "a directory is there", given)
            if os.path.lexists(target) and not request["overwrite"]:
                raise FileExistsError(17, "a file is there already (pass overwrite=true to replace it)", given)
            os.rename(temporary, target)
            step = "stat"
        elif step == "abort":
            if os.path.lexists(temporary):
                os.unlink(temporary)
            answer = {"aborted": True}
        if step in ("stat", "read"):
            fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode):
                    raise IsADirectoryError(21, "not a regular file", given)
                if info.st_size > request["max_bytes"]:
                    raise OSError(27, "%d bytes, more than the %d one call may move" % (info.st_size, request["max_bytes"]), given)
                answer = {"path": target, "size": info.st_size}
                if step == "stat" or request["offset"] == 0:
                    digest = hashlib.sha256()
                    while chunk := os.read(fd, 1 << 20):
                        digest.update(chunk)
                    answer["sha256"] = digest.hexdigest()
                if step == "read":
                    os.lseek(fd, request["offset"], os.SEEK_SET)
                    data, wanted = b"", request["length"]
                    while len(data) < wanted and (chunk := os.read(fd, wanted - len(data))):
                        data += chunk
                    answer["data"] = base64.b64encode(data).decode()
            finally:
                os.close(fd)
    except (OSError, ValueError) as exc:
        answer = {"error": type(exc).__name__, "errno": getattr(exc, "errno", None), "message": getattr(exc, "strerror", None) or str(exc)}
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.write("%s:0\n" % marker)
    sys.stdout.flush()

_msb_file_step(REQUEST, MARKER)
"""


# Python launcher for a kernel that may hold no TCP socket (gVisor's tcp transport, whose kernels runsc checkpoints):
# ipykernel binds the pipe that forked subprocesses send their output through on tcp://127.0.0.1, and this runsc
# cannot save a TCP endpoint that epoll watches. The same pipe, on a Unix socket in the sandbox's own tmpfs; where
# ipykernel's IOPubThread no longer has these methods, it is left as it is (and a checkpoint says why it failed).
# Run as `python -c <this> <ipykernel's arguments>`; PIPE is replaced with the socket's path.
PYTHON_UNIX_PIPE_LAUNCHER = """\
import os, sys
import zmq
from ipykernel import iostream, kernelapp

PIPE = "ipc://" + PIPE_PATH + "-%d" % os.getpid()


def _setup_pipe_in(self):
    self._pipe_uuid = os.urandom(16)
    pipe_in = self.socket.context.socket(zmq.PULL)
    pipe_in.linger = 0
    pipe_in.bind(PIPE)
    self._pipe_port = 0
    self._pipe_in = iostream.ZMQStream(pipe_in, self.io_loop)
    self._pipe_in.on_recv(self._handle_pipe_msg)


def _setup_pipe_out(self):
    context = zmq.Context()
    pipe_out = context.socket(zmq.PUSH)
    pipe_out.linger = 3000
    pipe_out.connect(PIPE)
    return context, pipe_out


if all(hasattr(iostream.IOPubThread, name) for name in ("_setup_pipe_in", "_setup_pipe_out", "_handle_pipe_msg")):
    iostream.IOPubThread._setup_pipe_in = _setup_pipe_in
    iostream.IOPubThread._setup_pipe_out = _setup_pipe_out
del _setup_pipe_in, _setup_pipe_out
sys.exit(kernelapp.launch_new_instance())
"""


# The one placement of the user site, for the kernel's startup and for pip: <base>/lib/pythonX.Y/site-packages (one
# per Python X.Y) after the standard library and before the environment's site-packages. Computed here, not read from
# site: a kernel forked from a server that computed it under another environment would keep the server's.
PYTHON_USER_SITE = r"""
def _msb_user_site():
    import os, site, sys, sysconfig

    base = os.environ.get("PYTHONUSERBASE")
    if not base:
        return None
    user_site = sysconfig.get_path("purelib", os.name + "_user", vars={"userbase": base})
    site.USER_BASE, site.USER_SITE = base, user_site
    if user_site not in sys.path:
        packages = set(site.getsitepackages())
        at = next((i for i, entry in enumerate(sys.path) if entry in packages), len(sys.path))
        sys.path.insert(at, user_site)
    return user_site
"""

# What a pooled kernel does when the pool hands it out (msb_kernels.provisioning.pool), once its person's volume is shown: their
# own packages as the startup would have put them (PYTHON_USER_PACKAGES), and the notebook's folder as its working dir.
PYTHON_HAND_OUT = (
    PYTHON_USER_SITE
    + r"""
def hand_out(working_dir):
    import importlib, os, site, sys

    user_site = _msb_user_site()
    if user_site is not None:
        sys.path_importer_cache.pop(user_site, None)  # noted missing while the pool held the kernel
        if os.path.isdir(user_site):
            site.addsitedir(user_site)
    importlib.invalidate_caches()
    if working_dir is not None:
        os.chdir(working_dir)
"""
)

# A person's own packages (msb_kernels/identity/volumes.py, "user packages"): `pip install --user` into
# PYTHONUSERBASE, a directory of the person's own volume that the provisioner names per environment. Run as
# `python msb_pip.py ARGS` by the %pip magic below, for --user and for what must see the user's site (uninstall,
# list, freeze, show). It is pip as a Python without a venv runs it: a venv that hides the system's site-packages
# makes Python leave the user site off sys.path, so pip refuses --user there; these kernels put it on sys.path
# themselves (PYTHON_USER_PACKAGES), so pip may install there and upgrade and uninstall what is there.
PYTHON_PIP_RUNNER = (
    PYTHON_USER_SITE
    + r"""
import os, runpy, site, sys

NO_VOLUME = (
    "pip install --user: the packages you keep live in your own directory of the gateway's shared volume, and this "
    "kernel has none: its operator enables it with MSB_SHARED_VOLUME_PATH (see docs/teams.md, \"Your own packages\").\n"
    "Without --user, `%pip install NAME` installs for this kernel only."
)


def main():
    base = os.environ.get("PYTHONUSERBASE")
    if "--user" in sys.argv[1:] and not base:
        sys.stderr.write(NO_VOLUME + "\n")
        return 1
    if base:
        try:
            from pip._internal.utils import virtualenv
        except ImportError:
            sys.stderr.write("pip is not installed in this kernel's environment\n")
            return 1
        # Before pip imports the rest of itself: its modules take these two functions by name.
        virtualenv.running_under_virtualenv = lambda: False
        virtualenv.virtualenv_no_global = lambda: False
        site.ENABLE_USER_SITE = True
        # PEP 668: with the venv hidden, pip read Debian's EXTERNALLY-MANAGED beside the base interpreter's standard
        # library and refused ("externally-managed-environment"). What --user installs goes to the person's own base,
        # never the system's, which the sandbox shows read-only anyway.
        os.environ["PIP_BREAK_SYSTEM_PACKAGES"] = "1"
        os.environ.pop("PIP_TARGET", None)  # the kernel's own directory for a plain install; pip refuses it with --user
        _msb_user_site()
    sys.argv[0] = "pip"
    runpy.run_module("pip", run_name="__main__", alter_sys=True)
    return 0


sys.exit(main())
"""
)

# Python startup: the person's own packages (PYTHONUSERBASE, set where the kernel has its person's volume) go on
# sys.path where Python puts a user site, after the standard library and before the environment's site-packages, so
# a package of theirs shadows the environment's. Only now, after the kernel's own imports: no package of theirs can
# stop their kernels from starting. %pip runs pip through RUNNER where --user or the user site matters.
PYTHON_USER_PACKAGES = (
    PYTHON_USER_SITE.replace("{", "{{").replace("}", "}}")
    + r"""
def _msb_install_user_packages(runner):
    import importlib, os, re, shlex, site, sys

    user_site = _msb_user_site()
    if user_site is not None and os.path.isdir(user_site):
        site.addsitedir(user_site)  # its .pth files, as Python's own user site has them read
    shell = get_ipython()
    through_runner = ("uninstall", "list", "freeze", "show")
    python = shlex.quote(sys.executable)

    def pip(line):
        words = line.split()
        if "--user" in words or (words and words[0] in through_runner):
            shell.system(" ".join([python, shlex.quote(runner), line]))
        else:
            shell.system(" ".join([python, "-m", "pip", line]))
        if user_site is not None:
            sys.path_importer_cache.pop(user_site, None)  # made by this install: seen as missing until now
        importlib.invalidate_caches()
        if words and words[0] in ("install", "uninstall"):
            print("Note: you may need to restart the kernel to use updated packages.")

    pip.__doc__ = "pip in this kernel's environment; --user keeps a package in your own volume (msb-kernels)."
    shell.register_magic_function(pip, "line", "pip")

    # `!pip install --user NAME` (or pip3, python -m pip) as a line of its own, with nothing of the shell's in it, is
    # %pip's: the environment's own pip would refuse --user in its venv, and would not see the user site for the rest.
    shell_pip = re.compile(r"(\s*)!\s*(?:pip3?|python3?\s+-m\s+pip)\s+([^;&|<>`$(){{}}\\\n]*?)\s*")

    def shell_pip_as_magic(lines):
        if lines and lines[0].lstrip().startswith("%%"):
            return lines  # a cell magic's body is its own language (%%bash, %%writefile), not IPython's
        routed = []
        for line in lines:
            found = shell_pip.fullmatch(line.rstrip("\n"))
            words = found.group(2).split() if found else []
            if words and ("--user" in words or words[0] in through_runner):
                line = found.group(1) + "%pip " + found.group(2) + ("\n" if line.endswith("\n") else "")
            routed.append(line)
        return routed

    shell.input_transformers_cleanup.append(shell_pip_as_magic)


_msb_install_user_packages({runner!r})
del _msb_install_user_packages, _msb_user_site
"""
)
