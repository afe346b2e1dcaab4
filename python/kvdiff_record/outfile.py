"""outfile.py -- the one discipline for every file kvdiff_record writes, the
twin of kvdiff's model/outfile.c (DESIGN.md, "Outputs").

A target that exists must be a regular file, judged without following a
link (lstat), and none of the run's inputs: those are compared by device
and inode, each input stat'ed through its links as a read of it would be,
so a hard link or a symlinked folder does not hide one. A symlink, a
FIFO, a device, a socket or a folder at the target is refused: never
followed, replaced or removed.

Dumps are written in place, so that a crash leaves the file, marked
partial, where the user asked for it (open_in_place): created with
O_CREAT | O_EXCL | O_NOFOLLOW, or, where a regular file is there already,
opened with O_NOFOLLOW after the lstat check and judged again on the open
descriptor (something may have been put there in between). Whole-file
outputs (write_whole) go to a fresh temporary file beside the target,
created the same way under a name nobody could have planted anything at,
written whole and fsync'd, and renamed over the target only after the
target is judged again.

Errors are RecorderError, naming the path and the problem in kvdiff's
own words."""

import errno
import os
import secrets
import stat

from .errors import RecorderError

# kvdiff's words for what a stat mode says a path is (outfile_kind)
_KINDS = {stat.S_IFREG: "a regular file", stat.S_IFDIR: "a directory",
          stat.S_IFCHR: "a device", stat.S_IFBLK: "a device", stat.S_IFIFO: "a FIFO",
          stat.S_IFSOCK: "a socket", stat.S_IFLNK: "a symbolic link"}


def kind(mode):
    """"a FIFO", "a device", "a directory", ... for a stat mode."""
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def input_ids(paths):
    """The (st_dev, st_ino) of every file a run reads, which no output may
    replace: each path stat'ed through its links, a folder standing for
    the files directly in it (a model folder: config.json, the
    safetensors, tokenizer.json). Missing paths are skipped. paths: one
    path or an iterable of them (None: none)."""
    if paths is None:
        return frozenset()
    if isinstance(paths, (str, bytes, os.PathLike)):
        paths = [paths]
    ids = set()
    for p in paths:
        try:
            st = os.stat(p)
        except (OSError, ValueError):
            continue
        if not stat.S_ISDIR(st.st_mode):
            ids.add((st.st_dev, st.st_ino))
            continue
        try:
            names = [e.path for e in os.scandir(p)]
        except OSError:
            continue
        for name in names:
            try:
                s = os.stat(name)
            except OSError:
                continue
            if not stat.S_ISDIR(s.st_mode):
                ids.add((s.st_dev, s.st_ino))
    return frozenset(ids)


def _judge(path, st, inputs):
    """Refuses what lstat found at an output path (st None: nothing)."""
    if st is None:
        return
    if stat.S_ISLNK(st.st_mode):
        raise RecorderError(f"{path}: is a symbolic link; kvdiff never writes through one "
                            f"(give the path it points to, or a new path)")
    if not stat.S_ISREG(st.st_mode):
        raise RecorderError(f"{path}: is {kind(st.st_mode)}, not a regular file; kvdiff "
                            f"writes only a new path or a regular file")
    if (st.st_dev, st.st_ino) in inputs:
        raise RecorderError(f"{path}: is one of this run's inputs; writing there would "
                            f"destroy it (choose another output path)")


def check_target(path, inputs=frozenset()):
    """Whether a file may be written at path: returns when path is absent
    or a regular file none of inputs (input_ids) is; else RecorderError.
    A link at path is not followed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise RecorderError(f"{path}: cannot write: {exc.strerror}") from None
    _judge(path, st, inputs)


def open_in_place(path, inputs=frozenset()):
    """Opens a dump's path for reading and writing, in place: a new file
    (O_EXCL | O_NOFOLLOW), else, after check_target, the regular file
    there (O_NOFOLLOW, never truncated here). Returns (fd, created);
    created says whether this call made the file (only such a file may
    later be removed). The caller owns fd."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    fd, created, err = -1, True, None
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        created = False
    except OSError as exc:
        err = exc.strerror
    if not created:
        check_target(path, inputs)
        try:
            # O_NONBLOCK: a FIFO put there since the check must not hang
            # the open; it is refused below on the descriptor.
            fd = os.open(path, flags | os.O_NONBLOCK)
        except OSError as exc:
            err = exc.strerror
    if err is not None:
        raise RecorderError(f"{path}: cannot create the dump: {err}")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):   # replaced between the check and the open
            raise RecorderError(f"{path}: not a regular file ({kind(st.st_mode)}); a dump is "
                                f"written to a regular file or a new path")
        _judge(path, st, inputs)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, created


def write_whole(path, data, inputs=frozenset()):
    """Writes bytes data as the whole file at path: a temporary file
    ".NAME.<random>" beside it (O_CREAT | O_EXCL | O_NOFOLLOW), written
    whole and fsync'd, then renamed over path when path is still absent
    or a regular file none of inputs is. On any error the temporary file
    is removed, path is left as it was, and RecorderError says why."""
    path = os.fspath(path)
    folder, name = os.path.split(path)
    if name in ("", ".", ".."):
        raise RecorderError(f"{path}: cannot write: names a folder, not a file")
    try:
        dirfd = os.open(folder or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise RecorderError(f"{path}: cannot write: {exc.strerror}") from None
    try:
        _judge(path, _lstat_at(path, name, dirfd), inputs)
        tmp, fd = _make_temp(path, name, dirfd)
        try:
            view = memoryview(data).cast("B")
            while view:
                view = view[os.write(fd, view):]
            try:
                os.fsync(fd)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EROFS):   # nothing to sync
                    raise
            os.close(fd)
            fd = -1
            _judge(path, _lstat_at(path, name, dirfd), inputs)   # again: it may have changed
            os.rename(tmp, name, src_dir_fd=dirfd, dst_dir_fd=dirfd)
        except BaseException as exc:
            if fd >= 0:
                os.close(fd)
            os.unlink(tmp, dir_fd=dirfd)
            if isinstance(exc, OSError):
                raise RecorderError(f"{path}: write failed: {exc.strerror}") from None
            raise
        try:
            os.fsync(dirfd)   # the rename itself on disk; best effort
        except OSError:
            pass
    finally:
        os.close(dirfd)


def _lstat_at(path, name, dirfd):
    try:
        return os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RecorderError(f"{path}: cannot write: {exc.strerror}") from None


def _make_temp(path, name, dirfd):
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        tmp = f".{name}.{secrets.token_hex(5)}"
        try:
            return tmp, os.open(tmp, flags, 0o666, dir_fd=dirfd)
        except FileExistsError:
            continue
        except OSError as exc:
            raise RecorderError(f"{path}: cannot write: {exc.strerror}") from None
    raise RecorderError(f"{path}: cannot write: no fresh temporary name beside it")
