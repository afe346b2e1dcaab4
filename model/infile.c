/* infile.c — regular files of bounded size only (infile.h). */
#include "infile.h"
#include "outfile.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

FILE *infile_open(const char *path, long long max_bytes, kv_err *e)
{
    /* O_NONBLOCK: opening a FIFO with no writer must not hang; it is
     * refused below, and the flag is dropped for the real reads. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        int err = errno;
        kv_errf(e, "%s: cannot open: %s", path, strerror(err));
        errno = err;
        return NULL;
    }
    struct stat sb;
    int rc = 0;
    if (fstat(fd, &sb) != 0)
        rc = kv_errf(e, "%s: %s", path, strerror(errno));
    else if (!S_ISREG(sb.st_mode))
        rc = kv_errf(e, "%s: not a regular file (%s)", path, outfile_kind(sb.st_mode));
    else if ((long long)sb.st_size > max_bytes)
        rc = kv_errf(e, "%s: %lld bytes; at most %lld are read", path, (long long)sb.st_size,
                     max_bytes);
    else if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0)
        rc = kv_errf(e, "%s: %s", path, strerror(errno));
    if (rc == 0)
        outfile_note_input_fd(fd);   /* no output of this run may replace it */
    FILE *f = rc == 0 ? fdopen(fd, "rb") : NULL;
    if (!f) {
        if (rc == 0)
            kv_errf(e, "%s: %s", path, strerror(errno));
        close(fd);
        errno = 0;   /* not ENOENT: the file is there and refused */
    }
    return f;
}

int infile_read_all(const char *path, long long max_bytes, char **text, size_t *len, kv_err *e)
{
    *text = NULL;
    *len = 0;
    FILE *f = infile_open(path, max_bytes, e);
    if (!f)
        return -1;
    /* The size was checked on the open file, but it may grow meanwhile:
     * read at most one byte past the limit to notice. */
    char *p = malloc((size_t)max_bytes + 1);
    if (!p) {
        fclose(f);
        return kv_errf(e, "%s: out of memory", path);
    }
    size_t n = fread(p, 1, (size_t)max_bytes + 1, f);
    int bad = ferror(f);
    fclose(f);
    if (bad || n > (size_t)max_bytes) {
        free(p);
        return bad ? kv_errf(e, "%s: read error", path)
                   : kv_errf(e, "%s: more than %lld bytes", path, max_bytes);
    }
    char *q = realloc(p, n + 1);
    if (q)
        p = q;
    p[n] = '\0';
    *text = p;
    *len = n;
    return 0;
}
