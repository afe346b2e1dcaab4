/* infile.c — regular files of bounded size only (infile.h). */
#include "infile.h"

#include <errno.h>
#include <fcntl.h>
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
        rc = kv_errf(e, "%s: not a regular file (%s)", path,
                     S_ISFIFO(sb.st_mode) ? "a FIFO" : S_ISDIR(sb.st_mode) ? "a folder"
                     : S_ISCHR(sb.st_mode) || S_ISBLK(sb.st_mode) ? "a device" : "a socket");
    else if ((long long)sb.st_size > max_bytes)
        rc = kv_errf(e, "%s: %lld bytes; at most %lld are read", path, (long long)sb.st_size,
                     max_bytes);
    else if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0)
        rc = kv_errf(e, "%s: %s", path, strerror(errno));
    FILE *f = rc == 0 ? fdopen(fd, "rb") : NULL;
    if (!f) {
        if (rc == 0)
            kv_errf(e, "%s: %s", path, strerror(errno));
        close(fd);
        errno = 0;   /* not ENOENT: the file is there and refused */
    }
    return f;
}
