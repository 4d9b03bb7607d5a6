"""Where the broker's socket lives, and the private directories its clients trust:
owned by the right user, not writable by anyone else (docs/design.md "Trust")."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Collection

log = logging.getLogger("lmcache_ec_broker.config")

SOCKET_ENV = "LMCACHE_EC_BROKER_SOCKET"


def tmp_socket_dir() -> str:
    """The first choice of the default socket's directory without XDG_RUNTIME_DIR: a
    predictable name in world-writable /tmp, which another user can take first."""
    return f"/tmp/lmcache-ec-broker-{os.getuid()}"


def home_socket_dir() -> str | None:
    """Where the default socket goes when another user took ``tmp_socket_dir`` first:
    under $HOME, which others cannot write (None without a usable home)."""
    home = os.path.expanduser("~")
    return os.path.join(home, ".lmcache-ec-broker") if os.path.isabs(home) else None


def private_socket_dir() -> str:
    """The per-user directory of the default socket when there is no XDG_RUNTIME_DIR:
    ``tmp_socket_dir()`` unless it exists and is not this user's directory (another
    user took the name first, issue 40: that must not keep the broker from starting),
    then ``home_socket_dir()``. Broker and clients of one uid derive the same one from
    the file system; both log the switch."""
    tmp = tmp_socket_dir()
    try:
        st = os.lstat(tmp)
    except OSError:
        return tmp
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
        return tmp
    home = home_socket_dir()
    if home is None:
        return tmp  # check_private_dir refuses it with the fix
    log.warning(
        "%s belongs to uid %d (another user took the name first); the default socket "
        "is in %s instead. Set XDG_RUNTIME_DIR or --socket / %s to choose",
        tmp, st.st_uid, home, SOCKET_ENV,
    )  # fmt: skip
    return home


def default_socket_dirs() -> tuple[str, ...]:
    """Every directory ``private_socket_dir`` may answer (a client checks a socket in
    any of them: the answer can change between computing a path and connecting)."""
    home = home_socket_dir()
    return (tmp_socket_dir(),) if home is None else (tmp_socket_dir(), home)


def default_socket_path() -> str:
    """$LMCACHE_EC_BROKER_SOCKET, else $XDG_RUNTIME_DIR/lmcache-ec-broker.sock,
    else <private_socket_dir()>/broker.sock (a directory only that user may write:
    a socket directly in world-writable /tmp could be bound first by another user)."""
    env = os.environ.get(SOCKET_ENV)
    if env:
        return env
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "lmcache-ec-broker.sock")
    return os.path.join(private_socket_dir(), "broker.sock")


def check_private_dir(path: str, owners: Collection[int] | None = None) -> None:
    """Refuse a socket directory another user could have prepared: it must be a real
    directory (not a symlink), owned by one of ``owners`` (default: this uid), that no
    one else may write to. Raises ValueError naming the problem and the fix."""
    allowed = {os.getuid()} if owners is None else set(owners)
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise ValueError(f"cannot inspect the socket directory {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(
            f"{path} is not a directory (a symlink or a file); another user may have put it "
            "there to intercept the broker's socket. Remove it, or choose a socket path with "
            f"--socket / {SOCKET_ENV}"
        )
    if st.st_uid not in allowed:
        raise ValueError(
            f"the socket directory {path} belongs to uid {st.st_uid}, not to uid "
            f"{' or '.join(map(str, sorted(allowed)))}; another user may have created it to "
            "intercept the broker's socket. Remove it (as root), or choose a socket path with "
            f"--socket / {SOCKET_ENV}"
        )
    if st.st_mode & 0o022:
        raise ValueError(
            f"the socket directory {path} has mode {stat.S_IMODE(st.st_mode):04o}: other users "
            f"can replace the socket in it. Run chmod 700 {path}"
        )


def ensure_private_dir(path: str) -> None:
    """Create ``path`` with mode 0700 if it is missing, then check it (check_private_dir).
    The broker calls this for the default socket directory before binding."""
    try:
        os.mkdir(path, 0o700)  # the umask can only narrow it
    except FileExistsError:
        pass
    except OSError as exc:
        raise ValueError(f"cannot create the socket directory {path}: {exc.strerror}") from None
    check_private_dir(path)


def ensure_socket_dir(socket_path: str, socket_mode: int = 0o600, gid: int | None = None) -> None:
    """For a socket in its per-user default directory: create and check that directory.
    Another path is the operator's choice: an existing directory is left as it is; a
    missing one (its parent must exist) is created, owned by this user, searchable
    only by whom ``socket_mode`` admits (group, with ``gid``; others)."""
    parent = os.path.dirname(os.path.abspath(socket_path))
    if parent in default_socket_dirs():
        ensure_private_dir(parent)
        return
    if os.path.isdir(parent):
        return
    mode = 0o700 | (0o050 if socket_mode & 0o060 else 0) | (0o005 if socket_mode & 0o006 else 0)
    try:
        os.mkdir(parent, 0o700)
    except FileExistsError:
        return  # made meanwhile (another start): claim_socket_path checks the rest
    except OSError as exc:
        raise ValueError(
            f"the socket's directory {parent} does not exist and cannot be created "
            f"({exc.strerror}); create it for uid {os.getuid()}, e.g. "
            f"sudo install -d -o {os.getuid()} -m 0700 {parent}"
        ) from None
    if gid is not None:
        os.chown(parent, -1, gid)
    os.chmod(parent, mode)  # after chown: never more open than it ends up
    log.info("created the socket directory %s (mode %04o)", parent, mode)
