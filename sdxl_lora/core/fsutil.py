"""Atomic file writes: a temp file in the same folder, fsync, rename; a crash leaves the old file or the new."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path


# What the writers say when the disk is full: safetensors passes the OS error on in its text ("... (os error 28)"),
# torch.save only as its own failure ("unexpected pos", "basic_ios::clear"), which never names the cause.
_DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122")
# A writer that ran out of space leaves less than a block free; the margin allows for what others write meanwhile.
_NEARLY_FULL = 2**20


def as_disk_full(e: BaseException, target: Path) -> BaseException:
    """`e` as the OSError(ENOSPC) naming `target` when writing `target` failed because its disk is full, so the
    user reads that rather than a writer's traceback; anything else is returned as it is. Call it before
    removing what the failed write left: that clean-up frees the space whose lack is the evidence."""
    target = Path(target)
    chain, seen = [], e
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    for err in chain:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return OSError(err.errno, os.strerror(err.errno), str(target))  # a temp file's name means nothing
    # torch's error says nothing of the disk: a disk found (nearly) full right after the failure decides.
    folder = next((p for p in (target, *target.parents) if p.is_dir()), None)
    try:
        free = shutil.disk_usage(folder).free if folder is not None else None
    except OSError:
        free = None
    if any(t in str(err) for err in chain for t in _DISK_FULL_TEXT) or (free is not None and free < _NEARLY_FULL):
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))
    return e


@contextlib.contextmanager
def naming_a_full_disk(target: str | Path) -> Iterator[None]:
    """An error of the writes inside becomes the OSError(ENOSPC) naming `target` where the disk is full
    (as_disk_full). Inside whatever removes what a failed write left, so the disk is measured first."""
    try:
        yield
    except Exception as e:
        full = as_disk_full(e, Path(target))
        if full is e:
            raise
        raise full from e


def check_destination(out: str | Path, overwrite: bool, reads: Iterable[str | Path] = (), reader: str = "this",
                      error: type[Exception] = FileExistsError,
                      exists_error: type[Exception] = FileExistsError) -> None:
    """Refuse to write `out` over what the result is made from (`reads`: base models, adapters; `out` itself or
    a folder holding one), asked or not, with `error`; and over anything that exists unless `overwrite`, with
    `exists_error`. `reader` names what reads them in the message ("the merge")."""
    target = Path(out).resolve()  # a folder written at `out` replaces it whole, with whatever lies inside
    source = next((Path(s) for s in reads if Path(s).exists() and Path(s).resolve().is_relative_to(target)), None)
    if source is not None:
        raise error(f"{out} is or holds {source}, which {reader} reads: write the result elsewhere (what is read is "
                    "never replaced)")
    if Path(out).exists() and not overwrite:
        raise exists_error(f"{out} already exists; choose another path or pass overwrite=True (--overwrite)")


def fsync_dir(path: Path) -> None:
    # The rename is only durable once the folder entry itself is on disk.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(dest: str | Path) -> Iterator[Path]:
    """Yield a temp path beside `dest`; write it; on success it is fsynced and renamed onto `dest`."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        with naming_a_full_disk(dest):
            yield tmp_path
        # mkstemp makes the file private (0600), and some writers replace it; outputs get the usual
        # mode (0666 less the umask) so other users' tools (a ComfyUI service, say) can read them.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp_path, 0o666 & ~umask)
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, dest)
        fsync_dir(dest.parent)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def atomic_write_bytes(dest: str | Path, data: bytes) -> Path:
    with atomic_path(dest) as tmp:
        tmp.write_bytes(data)
    return Path(dest)


def atomic_write_text(dest: str | Path, text: str) -> Path:
    return atomic_write_bytes(dest, text.encode("utf-8"))


def atomic_save(dest: str | Path, writer: Callable[[Path], None]) -> Path:
    """Call writer(tmp_path) (e.g. safetensors' save_file) and move the result onto dest atomically."""
    with atomic_path(dest) as tmp:
        writer(tmp)
    return Path(dest)


def build_folder_once(dest: Path, build: Callable[[Path, Path], None], marker: str) -> Path:
    """`dest`, built once: `build(scratch, out)` writes the folder `out` inside a temp folder beside `dest`
    (with `scratch` for anything else it needs), then `out` is renamed into place, so a crash leaves no
    half-built folder. `dest/marker` existing means it is built. A process that loses a race to another
    one building the same folder keeps the winner's."""
    dest = Path(dest)
    if (dest / marker).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        build(tmp / "_scratch", tmp / "out")
        try:
            os.replace(tmp / "out", dest)
        except OSError:
            if not (dest / marker).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
