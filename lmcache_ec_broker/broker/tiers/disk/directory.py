"""The disk tier's directory: private to the broker's uid, or refused.

Checksums defend against a bad disk, not against a writer: anyone who can write
an entry file can recompute its checksum. What keeps other users from reading
entries or planting their own bytes (served to every client after promotion) is
who can reach the files. So, invariants kept here (issue 40, item 1):

- Every directory the tier creates (the directory, missing parents, quarantine/)
  is created 0700 and every file 0600 (``file.py``), whatever the umask and
  ``socket_mode``: admission to the broker never opens the files.
- An existing directory must belong to the broker's uid. One that another uid can
  write (group or others) is refused with the fix named: files planted there
  would be served. One that others may only read or enter is set to 0700, and the
  log says so; a file in it that others could write (an older broker's, made with
  ``socket_mode``) is then quarantined, not served: they could reach it. In a
  directory that was private all along, such a file is only made 0600.
- No ancestor lets another uid swap the directory: each is owned by root or the
  broker's uid, and not writable by group or others unless sticky (as /tmp).
"""

from __future__ import annotations

import logging
import os
import stat

from ..base import TierError

log = logging.getLogger("lmcache_ec_broker.disk")

PRIVATE_DIR_MODE = 0o700


def _fix(path: str) -> str:
    return f"or choose another local_disk (--local-disk) than {path}"


def _check_ancestors(path: str) -> None:
    """Refuse a directory another uid could rename away and replace (through a
    parent it may write)."""
    me = os.geteuid()
    parent = os.path.dirname(path)
    while True:
        st = os.stat(parent)
        if st.st_uid not in (0, me):
            raise TierError(
                f"local_disk {path}: its parent {parent} belongs to uid {st.st_uid}, who "
                f"could replace the directory; {_fix(path)}"
            )
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise TierError(
                f"local_disk {path}: its parent {parent} has mode "
                f"{stat.S_IMODE(st.st_mode):04o}: other users could replace the directory. "
                f"Run chmod go-w {parent} (or chmod +t {parent}), {_fix(path)}"
            )
        up = os.path.dirname(parent)
        if up == parent:
            return
        parent = up


def check_private_dir(path: str, what: str = "local_disk") -> bool:
    """``path`` exists: refuse it or make it 0700 (the module's invariants). True if
    it was private already (no other uid could reach its files)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        st = os.stat(path)  # an operator's symlink; the target is what is checked
    if not stat.S_ISDIR(st.st_mode):
        raise TierError(f"{what} {path} is not a directory; {_fix(path)}")
    me = os.geteuid()
    if st.st_uid != me:
        raise TierError(
            f"{what} {path} belongs to uid {st.st_uid}, not to the broker's uid {me}: its "
            f"entries could be read or written by that user. Run chown {me} {path} and "
            f"chmod 700 {path} (after removing files you did not write), {_fix(path)}"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise TierError(
            f"{what} {path} has mode {mode:04o}: other users can write entries there that "
            f"the broker would serve. Run chmod 700 {path} (after removing files you did "
            f"not write), {_fix(path)}"
        )
    if mode & 0o077:
        os.chmod(path, PRIVATE_DIR_MODE)
        log.warning(
            "%s %s had mode %04o: other users could read its entries; set it to 0700",
            what, path, mode,
        )  # fmt: skip
        return False
    return True


def prepare_directory(path: str) -> bool:
    """Create ``path`` (and missing parents) 0700, or check the existing one. True if
    no other uid could reach its files before (created now, or private already).
    TierError names the problem and the fix."""
    path = os.path.abspath(path)
    try:
        missing: list[str] = []
        p = path
        while not os.path.lexists(p):
            missing.append(p)
            p = os.path.dirname(p)
        for d in reversed(missing):
            try:
                os.mkdir(d, PRIVATE_DIR_MODE)  # a umask can only narrow it
            except FileExistsError:
                pass  # made meanwhile: checked below like any existing one
        private = check_private_dir(path)
        _check_ancestors(os.path.realpath(path))
        return private
    except OSError as exc:
        raise TierError(f"cannot use local_disk {path}: {exc.strerror or exc}") from exc
