/* h5edit.h — what tests that edit a dump by hand share: HDF5 attribute
 * writes, as a runtime (or a hand) that wrote the file so would. */
#ifndef KV_TEST_H5EDIT_H
#define KV_TEST_H5EDIT_H

#include <hdf5.h>

/* Sets (replacing) the variable-length string attribute name of obj;
 * asserts it was written. */
void test_set_str_attr(hid_t obj, const char *name, const char *value);

#endif
