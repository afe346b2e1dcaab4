/* outfile.c — temporary file in the target's folder, then rename
 * (outfile.h). */
#include "outfile.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static void outfile_clear(outfile *o)
{
    free(o->path);
    free(o->tmp);
    o->f = NULL;
    o->path = o->tmp = NULL;
}

int outfile_open(outfile *o, const char *path, kv_err *e)
{
    memset(o, 0, sizeof *o);
    const char *slash = strrchr(path, '/');
    const size_t dir_len = slash ? (size_t)(slash - path) + 1 : 0;
    const char *base = path + dir_len;
    if (!*base)
        return kv_errf(e, "%s: cannot write: names a folder, not a file", path);
    const size_t n = strlen(path) + sizeof "/..XXXXXX";
    o->path = strdup(path);
    o->tmp = malloc(n);
    if (!o->path || !o->tmp) {
        outfile_clear(o);
        return kv_errf(e, "%s: cannot write: out of memory", path);
    }
    snprintf(o->tmp, n, "%.*s.%s.XXXXXX", (int)dir_len, path, base);
    int fd = mkstemp(o->tmp);
    if (fd < 0) {
        int err = errno;
        outfile_clear(o);
        return kv_errf(e, "%s: cannot write: %s", path, strerror(err));
    }
    /* mkstemp makes 0600; an output file is as readable as any other. */
    mode_t mask = umask(0);
    umask(mask);
    if (fchmod(fd, 0666 & ~mask) != 0 || !(o->f = fdopen(fd, "w"))) {
        int err = errno;
        close(fd);
        unlink(o->tmp);
        outfile_clear(o);
        return kv_errf(e, "%s: cannot write: %s", path, strerror(err));
    }
    return 0;
}

int outfile_commit(outfile *o, kv_err *e)
{
    if (!o->f)
        return kv_errf(e, "outfile_commit: no file open");
    /* fflush first: what is still buffered fails here with its own errno
     * (ENOSPC, EFBIG); an earlier failed write left ferror set. */
    int err = fflush(o->f) != 0 ? errno : 0;
    if (!err && ferror(o->f))
        err = errno ? errno : EIO;
    if (fclose(o->f) != 0 && !err)
        err = errno ? errno : EIO;
    o->f = NULL;
    if (!err && rename(o->tmp, o->path) != 0)
        err = errno;
    if (err) {
        unlink(o->tmp);
        kv_errf(e, "%s: write failed: %s", o->path, strerror(err));
        outfile_clear(o);
        return -1;
    }
    outfile_clear(o);
    return 0;
}

void outfile_abort(outfile *o)
{
    if (!o)
        return;
    if (o->f) {
        fclose(o->f);
        unlink(o->tmp);
    }
    outfile_clear(o);
}

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
    default: return "not a regular file";
    }
}
