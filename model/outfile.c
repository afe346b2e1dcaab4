/* outfile.c — temporary file in the target's folder, then rename; the
 * run's inputs; output folders (outfile.h). */
#include "outfile.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------ */
/* The run's inputs                                                     */

typedef struct {
    dev_t dev;
    ino_t ino;
} file_id;

static pthread_mutex_t inputs_lock = PTHREAD_MUTEX_INITIALIZER;
static file_id *inputs;
static size_t n_inputs, cap_inputs;

static bool tracking;

void outfile_track_inputs(bool on)
{
    __atomic_store_n(&tracking, on, __ATOMIC_RELEASE);
}

static void note_id(dev_t dev, ino_t ino)
{
    if (!__atomic_load_n(&tracking, __ATOMIC_ACQUIRE))
        return;
    pthread_mutex_lock(&inputs_lock);
    bool known = false;
    for (size_t i = 0; i < n_inputs && !known; i++)
        known = inputs[i].dev == dev && inputs[i].ino == ino;
    if (!known && n_inputs == cap_inputs) {
        size_t cap = cap_inputs ? 2 * cap_inputs : 16;
        file_id *p = realloc(inputs, cap * sizeof *p);
        if (p) {
            inputs = p;
            cap_inputs = cap;
        }
    }
    if (!known && n_inputs < cap_inputs)
        inputs[n_inputs++] = (file_id){dev, ino};
    pthread_mutex_unlock(&inputs_lock);
}

void outfile_note_input(const char *path)
{
    struct stat sb;
    if (path && stat(path, &sb) == 0 && !S_ISDIR(sb.st_mode))
        note_id(sb.st_dev, sb.st_ino);
}

void outfile_note_input_fd(int fd)
{
    struct stat sb;
    if (fd >= 0 && fstat(fd, &sb) == 0 && !S_ISDIR(sb.st_mode))
        note_id(sb.st_dev, sb.st_ino);
}

void outfile_forget_inputs(void)
{
    pthread_mutex_lock(&inputs_lock);
    free(inputs);
    inputs = NULL;
    n_inputs = cap_inputs = 0;
    pthread_mutex_unlock(&inputs_lock);
}

static bool is_input(const struct stat *sb)
{
    pthread_mutex_lock(&inputs_lock);
    bool hit = false;
    for (size_t i = 0; i < n_inputs && !hit; i++)
        hit = inputs[i].dev == sb->st_dev && inputs[i].ino == sb->st_ino;
    pthread_mutex_unlock(&inputs_lock);
    return hit;
}

/* The verdict on what lstat found at an output path (sb NULL: nothing). */
static int judge_target(const char *path, const struct stat *sb, kv_err *e)
{
    if (!sb)
        return 0;
    if (S_ISLNK(sb->st_mode))
        return kv_errf(e, "%s: is a symbolic link; kvdiff never writes through one (give the "
                          "path it points to, or a new path)", path);
    if (!S_ISREG(sb->st_mode))
        return kv_errf(e, "%s: is %s, not a regular file; kvdiff writes only a new path or a "
                          "regular file", path, outfile_kind(sb->st_mode));
    if (is_input(sb))
        return kv_errf(e, "%s: is one of this run's inputs; writing there would destroy it "
                          "(choose another output path)", path);
    return 0;
}

int outfile_check_target(const char *path, kv_err *e)
{
    struct stat sb;
    if (!path || !*path)
        return kv_errf(e, "empty output path");
    if (lstat(path, &sb) == 0)
        return judge_target(path, &sb, e);
    if (errno == ENOENT)
        return 0;
    return kv_errf(e, "%s: cannot write: %s", path, strerror(errno));
}

/* ------------------------------------------------------------------ */
/* Temporary files still open, for a signal to remove                    */

#define LIVE_SLOTS 16
static char live[LIVE_SLOTS][PATH_MAX];
static volatile sig_atomic_t live_used[LIVE_SLOTS];

static int live_add(const char *dir_path, const char *tmp)
{
    for (int i = 0; i < LIVE_SLOTS; i++)
        if (!__atomic_exchange_n(&live_used[i], 1, __ATOMIC_ACQ_REL)) {
            int n = snprintf(live[i], sizeof live[i], "%s%s", dir_path, tmp);
            if (n < 0 || (size_t)n >= sizeof live[i]) {
                live_used[i] = 0;
                return -1;
            }
            __atomic_store_n(&live_used[i], 2, __ATOMIC_RELEASE);
            return i;
        }
    return -1;   /* more at once than slots: that one is not cleaned on a signal */
}

static void live_drop(int slot)
{
    if (slot >= 0 && slot < LIVE_SLOTS)
        __atomic_store_n(&live_used[slot], 0, __ATOMIC_RELEASE);
}

static void on_signal_clean(int sig)
{
    for (int i = 0; i < LIVE_SLOTS; i++)
        if (__atomic_load_n(&live_used[i], __ATOMIC_ACQUIRE) == 2)
            unlink(live[i]);
    signal(sig, SIG_DFL);
    raise(sig);
}

void outfile_clean_on_signal(void)
{
    static const int sigs[3] = {SIGINT, SIGTERM, SIGHUP};
    for (int i = 0; i < 3; i++) {
        struct sigaction old, sa;
        if (sigaction(sigs[i], NULL, &old) != 0 || old.sa_handler != SIG_DFL)
            continue;   /* ignored (nohup) or handled: left as it is */
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_signal_clean;
        sigaction(sigs[i], &sa, NULL);
    }
}

/* ------------------------------------------------------------------ */
/* Whole files                                                          */

static void outfile_clear(outfile *o)
{
    live_drop(o->live);
    if (o->dirfd >= 0)
        close(o->dirfd);
    free(o->path);
    free(o->tmp);
    memset(o, 0, sizeof *o);
    o->fd = o->dirfd = o->live = -1;
}

/* A fresh name ".NAME.XXXXXX" created in dirfd with O_EXCL | O_NOFOLLOW;
 * returns the descriptor or -1 with errno. */
static int make_temp(int dirfd, const char *name, char *tmp, size_t n)
{
    static unsigned counter;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t x = ((uint64_t)getpid() << 32) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20);
    for (int tries = 0; tries < 100; tries++) {
        x = x * 6364136223846793005ULL + 1442695040888963407ULL +
            __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED);
        unsigned long long v = (x >> 16) & 0xffffffffffULL;
        if ((size_t)snprintf(tmp, n, ".%s.%010llx", name, v) >= n) {
            errno = ENAMETOOLONG;
            return -1;
        }
        int fd = openat(dirfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
        if (fd >= 0 || errno != EEXIST)
            return fd;
    }
    errno = EEXIST;
    return -1;
}

int outfile_open_fd(outfile *o, const char *path, int *fd, kv_err *e)
{
    memset(o, 0, sizeof *o);
    o->fd = o->dirfd = o->live = -1;
    *fd = -1;
    if (!path || !*path)
        return kv_errf(e, "empty output path");
    const char *slash = strrchr(path, '/');
    const size_t dir_len = slash ? (size_t)(slash - path) + 1 : 0;
    const char *base = path + dir_len;
    if (!*base || !strcmp(base, ".") || !strcmp(base, ".."))
        return kv_errf(e, "%s: cannot write: names a folder, not a file", path);
    o->path = strdup(path);
    o->tmp = malloc(strlen(base) + 16);
    char *dir = strndup(path, dir_len ? dir_len : 0);
    if (!o->path || !o->tmp || !dir) {
        free(dir);
        outfile_clear(o);
        return kv_errf(e, "%s: cannot write: out of memory", path);
    }
    o->name = o->path + dir_len;
    o->dirfd = open(dir_len ? dir : ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    const int derr = errno;
    free(dir);
    if (o->dirfd < 0) {
        outfile_clear(o);
        return kv_errf(e, "%s: cannot write: %s", path,
                       derr == ENOTDIR ? "its folder is not a folder" : strerror(derr));
    }
    struct stat sb;
    const bool there = fstatat(o->dirfd, o->name, &sb, AT_SYMLINK_NOFOLLOW) == 0;
    if (!there && errno != ENOENT) {
        int err = errno;
        outfile_clear(o);
        return kv_errf(e, "%s: cannot write: %s", path, strerror(err));
    }
    if (judge_target(path, there ? &sb : NULL, e) < 0) {
        outfile_clear(o);
        return -1;
    }
    *fd = make_temp(o->dirfd, o->name, o->tmp, strlen(o->name) + 16);
    if (*fd < 0) {
        int err = errno;
        outfile_clear(o);
        return kv_errf(e, "%s: cannot write: %s", path, strerror(err));
    }
    /* openat applied the umask to 0666, as for any other output file. */
    o->fd = *fd;
    char dir_path[PATH_MAX];
    snprintf(dir_path, sizeof dir_path, "%.*s", (int)(o->name - o->path), o->path);
    o->live = live_add(dir_path, o->tmp);
    return 0;
}

int outfile_open(outfile *o, const char *path, kv_err *e)
{
    int fd;
    if (outfile_open_fd(o, path, &fd, e) < 0)
        return -1;
    o->fd = -1;   /* the stream owns it */
    if (!(o->f = fdopen(fd, "w"))) {
        int err = errno;
        close(fd);
        unlinkat(o->dirfd, o->tmp, 0);
        kv_errf(e, "%s: cannot write: %s", path, strerror(err));
        outfile_clear(o);
        return -1;
    }
    return 0;
}

int outfile_commit(outfile *o, kv_err *e)
{
    if (!o->path)
        return kv_errf(e, "outfile_commit: no file open");
    int err = 0;
    if (o->f) {
        /* fflush first: what is still buffered fails here with its own
         * errno (ENOSPC, EFBIG); an earlier failed write left ferror set. */
        err = fflush(o->f) != 0 ? errno : 0;
        if (!err && ferror(o->f))
            err = errno ? errno : EIO;
        if (!err && fsync(fileno(o->f)) != 0 && errno != EINVAL && errno != EROFS)
            err = errno;
        if (fclose(o->f) != 0 && !err)
            err = errno ? errno : EIO;
        o->f = NULL;
    } else if (o->fd >= 0) {
        if (fsync(o->fd) != 0 && errno != EINVAL && errno != EROFS)
            err = errno;
        if (close(o->fd) != 0 && !err)
            err = errno;
        o->fd = -1;
    }
    /* The target again: something may have been put there meanwhile. */
    struct stat sb;
    int rc = 0;
    if (!err) {
        const bool there = fstatat(o->dirfd, o->name, &sb, AT_SYMLINK_NOFOLLOW) == 0;
        if (!there && errno != ENOENT)
            err = errno;
        else if (judge_target(o->path, there ? &sb : NULL, e) < 0)
            rc = -1;
    }
    if (!err && rc == 0 && renameat(o->dirfd, o->tmp, o->dirfd, o->name) != 0)
        err = errno;
    if (err || rc < 0) {
        unlinkat(o->dirfd, o->tmp, 0);
        if (err)
            kv_errf(e, "%s: write failed: %s", o->path, strerror(err));
        outfile_clear(o);
        return -1;
    }
    fsync(o->dirfd);   /* the rename itself on disk; best effort */
    outfile_clear(o);
    return 0;
}

int outfile_place(const char *from, const char *path, kv_err *e)
{
    int rc = outfile_check_target(path, e);
    if (rc == 0 && rename(from, path) != 0)
        rc = kv_errf(e, "%s: write failed: %s", path, strerror(errno));
    if (rc < 0)
        unlink(from);
    return rc;
}

void outfile_abort(outfile *o)
{
    if (!o || !o->path)   /* empty: never opened, or already committed */
        return;
    if (o->f)
        fclose(o->f);
    else if (o->fd >= 0)
        close(o->fd);
    o->f = NULL;
    o->fd = -1;
    if (o->dirfd >= 0 && o->tmp && o->tmp[0])
        unlinkat(o->dirfd, o->tmp, 0);
    outfile_clear(o);
}

/* ------------------------------------------------------------------ */
/* Folders                                                              */

static int make_dir(const char *path, bool follow, bool *created, kv_err *e)
{
    bool dummy;
    if (!created)
        created = &dummy;
    *created = false;
    if (!path || !*path)
        return kv_errf(e, "empty output folder");
    if (mkdir(path, 0777) == 0) {
        *created = true;
        return 0;
    }
    const int err = errno;
    struct stat sb;
    if (err != EEXIST)
        return kv_errf(e, "%s: cannot create the folder: %s", path, strerror(err));
    if (lstat(path, &sb) != 0)
        return kv_errf(e, "%s: cannot create the folder: %s", path, strerror(errno));
    if (S_ISLNK(sb.st_mode)) {
        if (!follow)
            return kv_errf(e, "%s: is a symbolic link where kvdiff keeps its own folder; "
                              "it is never followed (remove it, or choose another output "
                              "folder)", path);
        if (stat(path, &sb) != 0)
            return kv_errf(e, "%s: is a symbolic link to nothing", path);
    }
    if (!S_ISDIR(sb.st_mode))
        return kv_errf(e, "%s: exists and is %s, not a folder", path, outfile_kind(sb.st_mode));
    if (access(path, W_OK | X_OK) != 0)
        return kv_errf(e, "%s: folder is not writable", path);
    return 0;
}

int outfile_user_dir(const char *path, bool *created, kv_err *e)
{
    return make_dir(path, true, created, e);
}

int outfile_tool_dir(const char *path, bool *created, kv_err *e)
{
    return make_dir(path, false, created, e);
}

/* ------------------------------------------------------------------ */
/* Names                                                                */

/* path with its folder resolved: realpath(folder) + "/" + name. A path
 * whose folder does not exist resolves to itself. */
static void resolve(const char *path, char *out, size_t n)
{
    const char *slash = strrchr(path, '/');
    char dir[PATH_MAX], real[PATH_MAX];
    const char *name = slash ? slash + 1 : path;
    if (!slash)
        snprintf(dir, sizeof dir, ".");
    else if (slash == path)
        snprintf(dir, sizeof dir, "/");
    else
        snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
    if (!realpath(dir, real)) {
        snprintf(out, n, "%s", path);
        return;
    }
    snprintf(out, n, "%s/%s", strcmp(real, "/") ? real : "", name);
}

bool outfile_same(const char *a, const char *b)
{
    struct stat sa, sb;
    if (stat(a, &sa) == 0 && stat(b, &sb) == 0)
        return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
    char ra[PATH_MAX + 256], rb[PATH_MAX + 256];
    resolve(a, ra, sizeof ra);
    resolve(b, rb, sizeof rb);
    return strcmp(ra, rb) == 0;
}

const char *outfile_kind(unsigned mode)
{
    switch (mode & S_IFMT) {
    case S_IFREG: return "a regular file";
    case S_IFDIR: return "a directory";
    case S_IFCHR:
    case S_IFBLK: return "a device";
    case S_IFIFO: return "a FIFO";
    case S_IFSOCK: return "a socket";
    case S_IFLNK: return "a symbolic link";
    default: return "not a regular file";
    }
}
