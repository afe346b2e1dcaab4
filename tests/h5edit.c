/* h5edit.c — see h5edit.h. */
#include "h5edit.h"

#include <check.h>

void test_set_str_attr(hid_t obj, const char *name, const char *value)
{
    if (H5Aexists(obj, name) > 0)
        ck_assert(H5Adelete(obj, name) >= 0);
    hid_t t = H5Tcopy(H5T_C_S1), s = H5Screate(H5S_SCALAR);
    H5Tset_size(t, H5T_VARIABLE);
    hid_t a = H5Acreate2(obj, name, t, s, H5P_DEFAULT, H5P_DEFAULT);
    ck_assert(a >= 0 && H5Awrite(a, t, &value) >= 0);
    H5Aclose(a);
    H5Sclose(s);
    H5Tclose(t);
}
