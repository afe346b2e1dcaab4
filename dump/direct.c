/* direct.c — rows of a dataset read with pread() at the file offsets of
 * its chunks, past libhdf5 (dump_internal.h). Only for the plain case:
 * little-endian standard types, no filters, no external storage, every
 * chunk (or the contiguous block) allocated and inside the file, rows
 * that run whole through a chunk, and at most DUMP_DIRECT_MAX_CHUNKS
 * chunks. Anything else keeps libhdf5's reader.
 * The map is checked against libhdf5 on the first and last rows before it
 * is trusted, so a misread offset is refused, never compared. */
#include "dump_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#define DIRECT_HOST_OK 0
#else
#define DIRECT_HOST_OK 1
#endif

void dump_rowmap_free(dump_rowmap *m)
{
    if (!m)
        return;
    free(m->off);
    memset(m, 0, sizeof *m);
}

int dump_pread(int fd, void *buf, size_t n, int64_t off)
{
    char *p = buf;
    while (n > 0) {
        ssize_t got = pread(fd, p, n, (off_t)off);
        if (got < 0 && errno == EINTR)
            continue;
        if (got == 0)
            errno = 0;   /* the end of the file: said so by the caller */
        if (got <= 0)
            return -1;
        p += got;
        n -= (size_t)got;
        off += got;
    }
    return 0;
}

int dump_rowmap_read(const dump_rowmap *m, int fd, const char *path, int64_t row0, int64_t n,
                     void *out, kv_err *e)
{
    if (row0 < 0 || n < 0 || row0 > m->rows || n > m->rows - row0)
        return kv_errf(e, "%s: rows %lld..%lld asked of a dataset of %lld", path,
                       (long long)row0, (long long)(row0 + n - 1), (long long)m->rows);
    char *dst = out;
    while (n > 0) {
        int64_t chunk = m->chunk_rows ? row0 / m->chunk_rows : 0;
        int64_t within = m->chunk_rows ? row0 - chunk * m->chunk_rows : row0;
        int64_t take = m->chunk_rows ? m->chunk_rows - within : n;
        take = take < n ? take : n;
        const size_t bytes = (size_t)take * m->row_bytes;
        if (dump_pread(fd, dst, bytes, m->off[chunk] + within * (int64_t)m->row_bytes) < 0)
            return kv_errf(e, "%s: cannot read %zu bytes at offset %lld: %s", path, bytes,
                           (long long)(m->off[chunk] + within * (int64_t)m->row_bytes),
                           errno ? strerror(errno) : "end of file");
        dst += bytes;
        row0 += take;
        n -= take;
    }
    return 0;
}

/* Layout, filters and storage that a byte range of the file can stand in
 * for. Fills chunk_rows (0 for contiguous). */
static bool plain_layout(hid_t d, int rank, const hsize_t dims[2], int64_t *chunk_rows)
{
    hid_t dcpl = H5Dget_create_plist(d);
    bool ok = false;
    if (dcpl < 0)
        return false;
    H5D_layout_t lay = H5Pget_layout(dcpl);
    if (H5Pget_nfilters(dcpl) != 0 || H5Pget_external_count(dcpl) != 0)
        goto done;
    if (lay == H5D_CONTIGUOUS) {
        *chunk_rows = 0;
        ok = true;
    } else if (lay == H5D_CHUNKED) {
        hsize_t cd[2] = {0, 0};
        ok = H5Pget_chunk(dcpl, 2, cd) == rank && cd[0] >= 1 && cd[0] <= INT32_MAX &&
             (rank == 1 || cd[1] == dims[1]);
        *chunk_rows = (int64_t)cd[0];
    }
done:
    dump_h5_close(dcpl);
    H5Eclear2(H5E_DEFAULT);
    return ok;
}

/* The file offset of every chunk (or of the contiguous block), each
 * allocated, unfiltered, of the full size and inside the file. */
static bool locate(hid_t d, dump_rowmap *m, int64_t file_size)
{
    const int64_t span = m->chunk_rows ? m->chunk_rows : m->rows;
    int64_t bytes;
    if (__builtin_mul_overflow(span, (int64_t)m->row_bytes, &bytes) || bytes < 1)
        return false;
    m->n_off = m->chunk_rows ? (m->rows + m->chunk_rows - 1) / m->chunk_rows : 1;
    if (m->n_off > DUMP_DIRECT_MAX_CHUNKS)
        return false;
    /* every chunk holds bytes of its own in the file: more than fit are not
     * there, whatever the dataset claims (so this allocation is bounded) */
    if (m->n_off > file_size / bytes)
        return false;
    if (!(m->off = malloc((size_t)m->n_off * sizeof *m->off)))
        return false;
    for (int64_t c = 0; c < m->n_off; c++) {
        haddr_t addr = HADDR_UNDEF;
        if (m->chunk_rows) {
            hsize_t at[2] = {(hsize_t)(c * m->chunk_rows), 0}, size = 0;
            unsigned mask = 0;
            if (H5Dget_chunk_info_by_coord(d, at, &mask, &addr, &size) < 0 || mask != 0 ||
                size != (hsize_t)bytes)
                return false;
        } else {
            addr = H5Dget_offset(d);
            if (H5Dget_storage_size(d) != (hsize_t)bytes)
                return false;
        }
        if (addr == HADDR_UNDEF || addr > (haddr_t)file_size ||
            (int64_t)addr > file_size - bytes)
            return false;
        m->off[c] = (int64_t)addr;
    }
    return true;
}

bool dump_rowmap_sound(const dump_rowmap *m, uint64_t rows, size_t row_bytes,
                       int64_t file_size)
{
    if (m->rows < 0 || (uint64_t)m->rows != rows || m->row_bytes != row_bytes ||
        m->chunk_rows < 0)
        return false;
    const int64_t want = m->rows == 0      ? 0
                         : m->chunk_rows ? (m->rows + m->chunk_rows - 1) / m->chunk_rows
                                         : 1;
    if (m->n_off != want || m->n_off > DUMP_DIRECT_MAX_CHUNKS)
        return false;
    const int64_t span = m->chunk_rows ? m->chunk_rows : m->rows;
    int64_t bytes = 0;
    if (m->n_off > 0 && (__builtin_mul_overflow(span, (int64_t)m->row_bytes, &bytes) ||
                         bytes < 1 || bytes > file_size))
        return false;
    for (int64_t c = 0; c < m->n_off; c++)
        if (m->off[c] < 0 || m->off[c] > file_size - bytes)
            return false;
    return true;
}

/* Row r through the map and through libhdf5: the same bytes? */
static bool agrees(hid_t d, hid_t mtype, const dump_rowmap *m, int fd, int64_t r, int rank)
{
    char *a = malloc(m->row_bytes), *b = malloc(m->row_bytes);
    bool same = false;
    hid_t fs = H5Dget_space(d), ms = H5I_INVALID_HID;
    hsize_t start[2] = {(hsize_t)r, 0}, count[2] = {1, m->row_bytes / H5Tget_size(mtype)};
    if (a && b && fs >= 0 && H5Sselect_hyperslab(fs, H5S_SELECT_SET, start, NULL, count, NULL) >= 0 &&
        (ms = H5Screate_simple(rank, count, NULL)) >= 0 &&
        H5Dread(d, mtype, ms, fs, H5P_DEFAULT, a) >= 0 &&
        dump_rowmap_read(m, fd, "", r, 1, b, NULL) == 0)
        same = memcmp(a, b, m->row_bytes) == 0;
    dump_h5_close(ms);
    dump_h5_close(fs);
    H5Eclear2(H5E_DEFAULT);
    free(a);
    free(b);
    return same;
}

bool dump_file_plain(hid_t file)
{
    if (!DIRECT_HOST_OK)
        return false;
    unsigned intent = 0;
    hid_t fcpl = H5Fget_create_plist(file);
    hsize_t userblock = 1;
    const bool ok = fcpl >= 0 && H5Pget_userblock(fcpl, &userblock) >= 0 && userblock == 0 &&
                    H5Fget_intent(file, &intent) >= 0 && !(intent & H5F_ACC_SWMR_READ);
    dump_h5_close(fcpl);
    H5Eclear2(H5E_DEFAULT);
    return ok;
}

int dump_rowmap_build(hid_t d, hid_t std_type, int fd, int64_t file_size, dump_rowmap *m)
{
    memset(m, 0, sizeof *m);
    if (!DIRECT_HOST_OK || fd < 0)
        return 0;
    hid_t t = H5Dget_type(d), s = H5Dget_space(d);
    hsize_t dims[2] = {0, 1};
    int rank = s >= 0 ? H5Sget_simple_extent_ndims(s) : -1;
    bool ok = t >= 0 && H5Tequal(t, std_type) > 0 && (rank == 1 || rank == 2) &&
              H5Sget_simple_extent_dims(s, dims, NULL) >= 0 && dims[0] <= INT64_MAX / 2 &&
              dims[1] >= 1 && dims[1] <= INT32_MAX;
    dump_h5_close(t);
    dump_h5_close(s);
    H5Eclear2(H5E_DEFAULT);
    if (!ok || !plain_layout(d, rank, dims, &m->chunk_rows))
        return 0;
    m->rows = (int64_t)dims[0];
    m->row_bytes = (size_t)dims[1] * H5Tget_size(std_type);
    if (m->rows == 0)
        return 1;
    if (!locate(d, m, file_size)) {
        H5Eclear2(H5E_DEFAULT);
        dump_rowmap_free(m);
        return 0;
    }
    /* The offsets libhdf5 gave are taken as absolute: proven on the rows at
     * both ends, which lie in different chunks whenever there are two. */
    if (!agrees(d, std_type, m, fd, 0, rank) || !agrees(d, std_type, m, fd, m->rows - 1, rank)) {
        dump_rowmap_free(m);
        return 0;
    }
    return 1;
}
