"""Building images: layered, content-addressed, stored in the data directory.

Sources: the host's own /usr bound read-only under a small generated root skeleton (`host`, the fast
default: nothing is copied), a directory or tarball copied into one layer, or a Debian minbase made by
debootstrap. File ownership is shifted into the sandboxes' host uid range so the sandbox root owns its
files. A layer's id is the SHA-256 of its content (paths, modes, owners, link targets, file bytes), so
building the same content twice stores it once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tarfile
from pathlib import Path

from agentenv.runtime.store import HOST_UID, UID_RANGE, Store

log = logging.getLogger(__name__)

SKELETON_DIRS = ("bin", "dev", "etc", "home", "proc", "root", "run", "tmp", "usr", "var", "var/tmp", "mnt", "opt")
REQUIRED_DIRS = ("dev", "proc", "usr", "tmp", "root", "etc")
"""Directories every image root has: mount points for the sandbox and the default cwd."""

_ETC = {
    "etc/passwd": "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "etc/group": "root:x:0:\nnogroup:x:65534:\n",
    "etc/hosts": "127.0.0.1 localhost\n::1 localhost\n",
    "etc/hostname": "sandbox\n",
    "etc/resolv.conf": "",
    "etc/nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
}


def content_id(root: Path) -> str:
    """SHA-256 over a deterministic walk of `root` (relative path, type, mode, owner, target or bytes)."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            st = path.lstat()
            h.update(f"{path.relative_to(root)}\0{st.st_mode:o}\0{st.st_uid}\0{st.st_gid}\0".encode())
            if stat.S_ISLNK(st.st_mode):
                h.update(os.readlink(path).encode())
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
    return h.hexdigest()


def _shift_owner(root: Path) -> None:
    """Map owners 0..65535 to the sandboxes' host range (uid u becomes HOST_UID + u)."""
    for dirpath, dirnames, filenames in os.walk(root):
        # each directory once, as the walk's `dirpath` (a link to a directory is listed, never walked)
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        for name in [*links, *filenames, None]:
            path = Path(dirpath) if name is None else Path(dirpath) / name
            st = path.lstat()
            uid = HOST_UID + st.st_uid if st.st_uid < UID_RANGE else HOST_UID + 65534
            gid = HOST_UID + st.st_gid if st.st_gid < UID_RANGE else HOST_UID + 65534
            os.lchown(path, uid, gid)


def _ensure_required(root: Path) -> None:
    """The mount points and /tmp (mode 1777) every root needs, and the root directory itself, owned by root."""
    os.lchown(root, 0, 0)
    for name in REQUIRED_DIRS:
        target = root / name
        if not target.exists() and not target.is_symlink():
            target.mkdir()
            os.chmod(target, 0o1777 if name == "tmp" else 0o755)  # not in mkdir: the umask would clear bits


def _link_usr_dirs(root: Path) -> None:
    """`/bin`, `/sbin`, `/lib`, `/lib64` as links into /usr (merged-/usr layout) where the root lacks them."""
    for link in ("bin", "sbin", "lib", "lib64"):
        target = f"usr/{link}"
        if Path("/" + target).exists() and not os.path.lexists(root / link):
            os.symlink(target, root / link)


def _commit_layer(store: Store, staging: Path) -> str:
    """Shift owners, hash, and move `staging` into the store (or drop it if that content exists)."""
    _ensure_required(staging)
    _shift_owner(staging)
    layer = "i" + content_id(staging)[:40]
    final = store.layers / layer
    if final.exists():
        shutil.rmtree(staging.parent)
        return layer
    final.mkdir()
    os.rename(staging, final / "diff")
    shutil.rmtree(staging.parent, ignore_errors=True)
    return layer


def _staging(store: Store) -> Path:
    tmp = store.layers / f".build-{os.getpid()}-{os.urandom(4).hex()}"
    (tmp / "diff").mkdir(parents=True)
    return tmp / "diff"


def build_host(store: Store, name: str = "host") -> dict:
    """The default image: a generated root skeleton; the host's /usr is bound read-only at start."""
    with store.locked():
        root = _staging(store)
        for d in SKELETON_DIRS:
            (root / d).mkdir(parents=True, exist_ok=True)
        os.chmod(root / "tmp", 0o1777)
        os.chmod(root / "var/tmp", 0o1777)
        os.chmod(root / "root", 0o700)
        (root / "bin").rmdir()
        _link_usr_dirs(root)
        for rel, text in _ETC.items():
            (root / rel).write_text(text)
        manifest = {"name": name, "layers": [_commit_layer(store, root)], "usr_bind": True, "template": None}
        store.save_image(name, manifest)
    return manifest


def _copy_special_aware(src: str, dst: str) -> None:
    """`copytree`'s copy function: regular files by content, FIFOs re-created, device nodes and sockets skipped.

    A plain `copy2` opens a device node and reads it, forever for `/dev/zero` (a debootstrap root holds such nodes):
    sandboxes get their own `/dev` and every root is mounted nodev, so image layers never need device nodes.
    """
    mode = os.lstat(src).st_mode
    if stat.S_ISREG(mode):
        shutil.copy2(src, dst)
    elif stat.S_ISFIFO(mode):
        os.mkfifo(dst, stat.S_IMODE(mode))
        shutil.copystat(src, dst)
    else:
        log.debug("image build: skipping special file %s", src)


def _tar_filter_no_devices(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo | None:
    """tarfile's "tar" filter, and device members dropped (see `_copy_special_aware`)."""
    if member.ischr() or member.isblk():
        return None
    return tarfile.tar_filter(member, path)


def build_from_path(store: Store, name: str, source: Path, *, usr_bind: bool = False) -> dict:
    """An image from a directory or a tarball (`.tar`, `.tar.gz`, ...): one layer holding its files.

    Raises:
        FileNotFoundError: `source` does not exist.
        ValueError: `source` is neither a directory nor a tarball.
    """
    source = Path(source)
    if not source.exists():
        raise FileNotFoundError(f"source {str(source)!r} does not exist")
    with store.locked():
        root = _staging(store)
        try:
            if source.is_dir():
                shutil.copytree(source, root, symlinks=True, dirs_exist_ok=True, copy_function=_copy_special_aware)
            elif tarfile.is_tarfile(source):
                with tarfile.open(source) as tar:
                    tar.extractall(root, filter=_tar_filter_no_devices)
            else:
                raise ValueError(f"source {str(source)!r} is neither a directory nor a tarball")
            if usr_bind:  # the host's /usr comes at start; its merged-/usr links are this layer's to make
                _link_usr_dirs(root)
            layer = _commit_layer(store, root)
        except BaseException:
            shutil.rmtree(root.parent, ignore_errors=True)
            raise
        manifest = {"name": name, "layers": [layer], "usr_bind": usr_bind, "template": None}
        store.save_image(name, manifest)
    return manifest


def build_debootstrap(store: Store, name: str, suite: str = "bookworm", mirror: str | None = None) -> dict:
    """A Debian minbase root made by `debootstrap --variant=minbase` (needs the package and a Debian mirror).

    Raises:
        FileNotFoundError: debootstrap is not installed.
        RuntimeError: debootstrap failed (its output is in the message).
    """
    exe = shutil.which("debootstrap")
    if exe is None:
        raise FileNotFoundError("debootstrap is not installed: apt-get install debootstrap")
    staging = Path(store.layers / f".deboot-{os.getpid()}")
    staging.mkdir()
    try:
        cmd = [exe, "--variant=minbase", suite, str(staging)] + ([mirror] if mirror else [])
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"debootstrap failed ({done.returncode}): {done.stderr[-2000:]}")
        return build_from_path(store, name, staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
