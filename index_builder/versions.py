"""A datastore's next version, made beside it and put in its place at once.

`build`, `add` and `forget` work in a hidden sibling `.<name>.partial`, which a rerun of the same
command resumes (`prepare_workdir`). `add` and `forget` start it from the serving version's files
as hard links (`link_version`): nothing is copied, and a changed file is written under a new
inode (`replace_array`), never into a link, so the serving version stays byte-identical until the
finished directory takes its place in one atomic exchange (`publish`).

`add`, `forget`, `compact` and `calibrate` hold the datastore's writer lock, the hidden sibling
`.<name>.lock` (`one_writer`), so a second one (another process, another server sharing the
directory) is refused at once instead of deleting the first one's work or publishing a version
made from the one the first replaces. A server's add or compact takes the lock itself before it
answers and runs the command in a child that it holds the lock for (`lock_held_for_child`).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import inspect
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
from filelock import FileLock, Timeout

from knnlm_core.datastore import read_manifest
from knnlm_core.errors import DatastoreError, ErrorKind
from knnlm_core.files import write_json_atomic
from knnlm_core.manifest import MANIFEST, Manifest

logger = logging.getLogger("index_builder")

_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def read_with_documents(path: str | Path, job: str) -> tuple[Path, Manifest]:
    """The datastore at `path` and its manifest, refused if it records no documents to `job` by."""
    root = Path(path).resolve()
    manifest = read_manifest(root)
    if manifest.documents is None or manifest.provenance is None:
        raise DatastoreError(
            f"datastore {root.name} records no documents (built from keys, or before knnlm-index recorded them), "
            f"so it cannot {job}; rebuild it with `knnlm-index build`"
        )
    return root, manifest


def writer_lock(datastore: Path) -> FileLock:
    """The lock a process holds while it writes a version of `datastore`: one instance per path
    in a process, so a command that runs another (add --recalibrate) takes it again."""
    return FileLock(datastore.with_name(f".{datastore.name}.lock"), is_singleton=True)


def taken_writer_lock(datastore: Path) -> FileLock | None:
    """`datastore`'s writer lock, taken by this thread; None while another process (or thread) holds it."""
    lock = writer_lock(datastore)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return None
    return lock


def being_written(datastore: Path) -> bool:
    """Whether another process (or thread) holds `datastore`'s writer lock now."""
    lock = taken_writer_lock(datastore)
    if lock is not None:
        lock.release()
    return lock is None


LOCK_HELD_BY_PARENT = "KNNLM_WRITER_LOCK_HELD_BY"  # "<parent pid>:<datastore>" (lock_held_for_child)


def lock_held_for_child(datastore: Path) -> dict[str, str]:
    """The environment of a child process that runs a command on `datastore` while this process
    holds its writer lock (and stays alive until the child exits)."""
    return {LOCK_HELD_BY_PARENT: f"{os.getpid()}:{datastore.expanduser().resolve()}"}


def _held_by_parent(datastore: Path) -> bool:
    return os.environ.get(LOCK_HELD_BY_PARENT) == f"{os.getppid()}:{datastore}"


def busy_error(name: str) -> DatastoreError:
    """The refusal of a change to a datastore another process is changing."""
    return DatastoreError(
        f"datastore {name!r} is being changed by another process (another server's add, forget or compact, or a "
        "knnlm-index add, forget, compact or calibrate): retry when it is done",
        ErrorKind.BUSY,
    )


def one_writer(param: str):
    """Run the decorated command holding the writer lock of the datastore its argument `param`
    names (or with the lock its parent process holds for it); refused as busy while another
    process holds it."""

    def wrap(command):
        signature = inspect.signature(command)

        @functools.wraps(command)
        def locked(*args, **kwargs):
            datastore = Path(signature.bind(*args, **kwargs).arguments[param]).expanduser().resolve()
            if not datastore.is_dir() or _held_by_parent(datastore):  # refused by the command, naming it; held for us
                return command(*args, **kwargs)
            lock = taken_writer_lock(datastore)
            if lock is None:
                raise busy_error(datastore.name)
            try:
                return command(*args, **kwargs)
            finally:
                lock.release()

        return locked

    return wrap


def workdir(output: Path) -> Path:
    return output.with_name(f".{output.name}.partial")


def prepare_workdir(work: Path, identity: dict) -> bool:
    """Resume `work` if it holds this very job (True); start it afresh if it holds another (False)."""
    job_id = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    marker = work / "build.json"
    if work.exists():
        if marker.exists() and json.loads(marker.read_text()).get("build_id") == job_id:
            return True
        shutil.rmtree(work)
    work.mkdir(parents=True)
    write_json_atomic(marker, {"build_id": job_id, **identity})
    return False


def link_version(root: Path, work: Path, manifest: Manifest) -> None:
    """Hard links in `work` to every data file of the version at `root` that `work` lacks."""
    for entry in manifest.files():
        target = work / entry.path
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(root / entry.path, target)


def replace_array(path: Path, array: np.ndarray) -> None:
    """Write `array` to `path` as a new file: a hard link there is replaced, its inode untouched."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


def publish(work: Path, output: Path) -> Manifest:
    """Drop `work`'s scratch files, then put it in `output`'s place: readers see the old version or
    the new one, whole (on Linux one exchange of the two directories; elsewhere two renames)."""
    manifest = Manifest.model_validate_json((work / MANIFEST).read_text())
    keep = {MANIFEST} | {f.path.split("/")[0] for f in manifest.files()}
    for item in work.iterdir():
        if item.name not in keep:
            shutil.rmtree(item) if item.is_dir() else item.unlink()
    if not output.exists():
        os.replace(work, output)
    elif not _exchange(work, output):
        old = output.with_name(f".{output.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(output, old)
        os.replace(work, output)
        work = old
    shutil.rmtree(work, ignore_errors=True)  # the replaced version: readers holding its files keep them
    return manifest


def _exchange(a: Path, b: Path) -> bool:
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EXDEV, errno.ENOTSUP):
        return False
    raise OSError(code, f"could not put {a.name} in the place of {b.name}: {os.strerror(code)}")
