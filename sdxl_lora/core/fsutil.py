"""Atomic file writes: a temp file in the same folder, fsync, rename; a crash leaves the old file or the new.
And the guard before a command writes (check_destination): never over what it reads, nor into a run's records."""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)


# What the writers say when the disk is full: safetensors passes the OS error on in its text ("... (os error 28)"),
# torch.save only as its own failure ("unexpected pos", "basic_ios::clear"), which never names the cause.
_DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122")
# A writer that ran out of space leaves less than a block free; the margin allows for what others write meanwhile.
_NEARLY_FULL = 2**20


def error_chain(e: BaseException) -> list[BaseException]:
    """`e`, then the error it was raised from or while handling, and so on: the first error is the last."""
    chain, seen = [], e
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    return chain


def as_disk_full(e: BaseException, target: Path) -> BaseException:
    """`e` as the OSError(ENOSPC) naming `target` when writing `target` failed because its disk is full, so the
    user reads that rather than a writer's traceback; anything else is returned as it is. Call it before
    removing what the failed write left: that clean-up frees the space whose lack is the evidence."""
    target = Path(target)
    chain = error_chain(e)
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


def check_destination(out: str | Path, overwrite: bool, reads: Iterable[str | Path | None] = (),
                      reader: str = "this command",
                      error: type[Exception] = FileExistsError,
                      exists_error: type[Exception] = FileExistsError) -> None:
    """The guard every command that writes passes before it writes `out`: refused with `error`, asked to
    overwrite or not, where `out` is, holds or lies inside what the result is made from (`reads`: adapter
    files, base models, a run's config; `reader` names what reads them in the message, "the merge"), or would
    break a run (refusal); refused with `exists_error` where `out` exists, unless `overwrite`. What writes
    into `out`'s folder that were interrupted left there goes first (clear_interrupted)."""
    why = refusal(out, reads, reader)
    if why is not None:
        raise error(why)
    clear_interrupted(Path(out).parent)
    if Path(out).exists() and not overwrite:
        raise exists_error(f"{out} already exists; choose another path or pass overwrite=True (--overwrite)")


def refusal(out: str | Path, reads: Iterable[str | Path | None] = (), reader: str = "this command") -> str | None:
    """Why nothing may be written at `out` (check_destination), as the message to show; None where it may.
    A folder written at `out` replaces it whole, with whatever lies inside; a file written inside a folder that
    is read (a PEFT folder, a model) changes what is read. `reads` entries that name no existing path (a
    built-in model's name) are skipped."""
    target = Path(out).resolve()
    damage = run_damage(target, out)
    if damage is not None:
        return damage
    for given in reads:
        if given is None or not Path(given).exists():
            continue
        source = Path(given).resolve()
        if source == target:
            said = f"{out} is what {reader} reads"
        elif source.is_relative_to(target):
            said = f"{out} holds {given}, which {reader} reads"
        elif source.is_dir() and target.is_relative_to(source) and not is_run_folder(source):
            # A run's exports go inside it: its records are run_damage's, the adapter read from it is in reads.
            said = f"{out} lies inside {given}, which {reader} reads"
        else:
            continue
        return (f"{said}: write the result to another path; what is read is never replaced (--overwrite does not "
                "change this)")
    return None


# Temp names carry the writer's process id, so a later write can tell an interrupted write's leftovers
# (their writer is gone) from a write still going on beside it, in this process or another, however long it
# takes (a merged checkpoint's folder takes minutes). An age alone could not: it would either take a slow
# writer's file from under it or leave a SIGKILLed one's litter for the next hour. The id is this machine's:
# one machine writes into a folder at a time (a run is saved by its main process; exports are commands).
_WRITING = re.compile(r"^\.(?P<name>.+)\.writing-(?P<pid>\d+)\.[a-z0-9_]{8}(?:\.tmp)?$")
# An existing folder moved aside while its replacement is renamed into place (atomic_folder).
_REPLACED = re.compile(r"^\.(?P<name>.+)\.replaced-(?P<pid>\d+)$")


def temp_prefix(name: str) -> str:
    """The start of the hidden temp name a write of `name` uses beside it (mkstemp/mkdtemp's prefix; the
    random part and any suffix follow), which clear_interrupted recognises."""
    return f".{name}.writing-{os.getpid()}."


def replaced_name(name: str) -> str:
    """Where an existing `name` waits, beside it, while its replacement is renamed into place."""
    return f".{name}.replaced-{os.getpid()}"


def clear_interrupted(folder: str | Path) -> list[Path]:
    """Remove what interrupted writes (SIGKILL, a power cut) left in `folder`: temp files and folders named by
    temp_prefix, and a folder moved aside by replaced_name (put back where its replacement never arrived),
    whose writer is no longer running. Only these names are touched. The paths removed or put back."""
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    done = []
    for entry in entries:
        match = _WRITING.match(entry.name) or _REPLACED.match(entry.name)
        if match is None:
            continue
        try:
            written = entry.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:  # another writer cleared it first
            continue
        if process_alive(int(match["pid"]), started_before=written):
            continue
        path, dest = Path(entry.path), Path(folder) / match["name"]
        try:
            if match.re is _REPLACED and not os.path.lexists(dest):
                os.replace(path, dest)  # the writer died between moving the old one aside and the new one in
                log.info("put %s back: its replacement was interrupted", dest)
            elif entry.is_dir(follow_symlinks=False):
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            continue
        except OSError as e:  # litter that cannot go (permissions) is no reason to fail the write after it
            log.warning("could not remove %s, left by an interrupted write: %s", path, e.strerror)
            continue
        log.info("removed %s, left by an interrupted write", path)
        done.append(path)
    return done


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
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(dest.name), suffix=".tmp", dir=dest.parent)
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


@contextlib.contextmanager
def atomic_folder(dest: str | Path, overwrite: bool = False,
                  exists_error: type[Exception] = FileExistsError) -> Iterator[Path]:
    """Yield a temp folder beside `dest`; fill it; on success its files are fsynced and it replaces `dest`
    (an existing one, with `overwrite`, goes only once the new one is in place), so a crash leaves the old
    folder or the new, never half of one. Refused with `exists_error` where `dest` exists, unless `overwrite`."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(dest.name), dir=dest.parent))
    try:
        with naming_a_full_disk(dest):
            yield tmp
        for root, _, files in os.walk(tmp):  # on disk before the rename makes them visible
            for name in files:
                with open(Path(root) / name, "rb+") as fh:
                    os.fsync(fh.fileno())
            fsync_dir(Path(root))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's folder is private; outputs get the usual mode
        old = None
        if os.path.lexists(dest):
            if not overwrite:
                raise exists_error(f"{dest} already exists; choose another path or pass overwrite=True "
                                   "(--overwrite)")
            old = dest.with_name(replaced_name(dest.name))
            os.replace(dest, old)
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
        if old is not None:
            shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_folder_once(dest: Path, build: Callable[[Path, Path], None], marker: str) -> Path:
    """`dest`, built once: `build(scratch, out)` writes the folder `out` inside a temp folder beside `dest`
    (with `scratch` for anything else it needs), then `out` is renamed into place, so a crash leaves no
    half-built folder. `dest/marker` existing means it is built. A process that loses a race to another
    one building the same folder keeps the winner's."""
    dest = Path(dest)
    if (dest / marker).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    clear_interrupted(dest.parent)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(dest.name), dir=dest.parent))
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


# ---- what a write must not break: a run's folder and records (core/runs.py makes them)

# What --resume and the UI read of a run besides its adapter: no command writes over these or into them.
RUN_RECORDS = {"config.toml": "config", "events.jsonl": "progress record",
               "checkpoints": "training states, which --resume continues from"}
# How deep below a destination folder a run is looked for (a runs folder, a project holding runs/): a folder
# written there replaces everything inside.
_RUN_DEPTH = 3


def is_run_folder(path: Path) -> bool:
    """Whether `path` is a run's folder: its config.toml, and its events or training states."""
    return (path / "config.toml").is_file() and ((path / "events.jsonl").is_file() or (path / "checkpoints").is_dir())


def run_damage(target: Path, shown: str | Path) -> str | None:
    """Why writing the resolved path `target` (`shown` as the user gave it) would break a run, as the message
    to show, or None: it is a run folder, or holds one, or is or lies inside a run's RUN_RECORDS. A run's
    other files (its exports/, its adapter) are for its exports to go to and replace."""
    for folder in (target, *target.parents):
        if not is_run_folder(folder):
            continue
        exports = relpath(folder / "exports")
        if folder == target:
            return (f"{shown} is the folder of run {folder.name}: a write there would replace the run, its config, "
                    f"events and training states (--overwrite does not change this); write the result to another "
                    f"path, e.g. into {exports}/")
        record = target.relative_to(folder).parts[0]
        if record in RUN_RECORDS:
            where = "is" if target == folder / record else f"lies inside {relpath(folder / record)},"
            return (f"{shown} {where} run {folder.name}'s {RUN_RECORDS[record]}: a write there would break the run "
                    f"(--overwrite does not change this); write the result to another path, e.g. into {exports}/")
        break
    held = _run_inside(target)
    if held is not None:
        return (f"{shown} holds the run folder {relpath(held)}: a folder written there would replace it with "
                "everything inside (--overwrite does not change this); write the result to another path")
    return None


def _run_inside(folder: Path) -> Path | None:
    """A run folder under `folder`, at most _RUN_DEPTH levels down (symlinks not followed), or None."""
    level = [folder] if folder.is_dir() and not folder.is_symlink() else []
    for _ in range(_RUN_DEPTH):
        level = [p for d in level for p in subfolders(d)]
        run = next((p for p in level if is_run_folder(p)), None)
        if run is not None:
            return run
    return None


def subfolders(folder: Path) -> list[Path]:
    """The folders in `folder` (symlinks not followed); none where it cannot be read."""
    try:
        return [Path(e.path) for e in os.scandir(folder) if e.is_dir(follow_symlinks=False)]
    except OSError:  # unreadable: nothing of ours can be written there either
        return []


def process_alive(pid: int, started_before: float | None = None) -> bool:
    """Whether `pid` is a live process (not a zombie), started no later than `started_before` (epoch
    seconds) when given. Without /proc (not Linux) only the first is checked."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return True
    if fields[0] == "Z":
        return False
    if started_before is None:
        return True
    try:
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        started = boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, ValueError, IndexError):
        return True
    return started <= started_before + 2.0  # btime is whole seconds


def relpath(p: Path) -> str:
    """A path as the user should see it: relative to the working folder when under it, else as given
    (an absolute path stays absolute, never `../../...`)."""
    p = Path(p)
    try:
        return str(p.absolute().relative_to(Path.cwd()))
    except ValueError:
        return str(p)
