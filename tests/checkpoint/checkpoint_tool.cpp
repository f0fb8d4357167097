// checkpoint_tool: test helper that damages a checkpoint file the way a foreign or corrupted file
// would look. Usage:
//   test_checkpoint_tool set-version FILE N          rewrite the format_version attribute
//   test_checkpoint_tool flip-byte FILE DATASET      flip one byte inside the dataset's data
//   test_checkpoint_tool drop-model FILE             remove the /model group
//   test_checkpoint_tool unlink FILE DATASET         remove one dataset
//   test_checkpoint_tool flip-bit FILE DATASET       flip the lowest bit of the byte in the middle
//                                                    of the dataset's data (one float moves 1 ulp)
//   test_checkpoint_tool set-attr FILE OBJECT NAME N  rewrite an integer attribute of a dataset
//                                                    (or of the file: OBJECT "/")
#include <hdf5.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

int main(int argc, char** argv) {
  if (argc == 4 && std::strcmp(argv[1], "set-version") == 0) {
    const long long v = std::atoll(argv[3]);
    hid_t f = H5Fopen(argv[2], H5F_ACC_RDWR, H5P_DEFAULT);
    if (f < 0) return 1;
    hid_t a = H5Aopen(f, "format_version", H5P_DEFAULT);
    const int rc = a >= 0 && H5Awrite(a, H5T_NATIVE_LLONG, &v) >= 0 ? 0 : 1;
    if (a >= 0) H5Aclose(a);
    H5Fclose(f);
    return rc;
  }
  const bool flip_byte = argc == 4 && std::strcmp(argv[1], "flip-byte") == 0;
  if (flip_byte || (argc == 4 && std::strcmp(argv[1], "flip-bit") == 0)) {
    hid_t f = H5Fopen(argv[2], H5F_ACC_RDONLY, H5P_DEFAULT);
    if (f < 0) return 1;
    hid_t d = H5Dopen2(f, argv[3], H5P_DEFAULT);
    if (d < 0) return 1;
    hsize_t offset[8];
    unsigned mask = 0;
    haddr_t addr = 0;
    hsize_t size = 0;
    herr_t rc = 0;
    hid_t plist = H5Dget_create_plist(d);
    if (H5Pget_layout(plist) == H5D_CONTIGUOUS) {
      addr = H5Dget_offset(d);
      size = H5Dget_storage_size(d);
      rc = addr == HADDR_UNDEF ? -1 : 0;
    } else {
      hid_t space = H5Dget_space(d);
      rc = H5Dget_chunk_info(d, space, 0, offset, &mask, &addr, &size);
      H5Sclose(space);
    }
    H5Pclose(plist);
    H5Dclose(d);
    H5Fclose(f);
    if (rc < 0 || size < 16) return 1;
    std::FILE* fp = std::fopen(argv[2], "r+b");
    if (!fp) return 1;
    const long pos = static_cast<long>(addr + size / 2);
    std::fseek(fp, pos, SEEK_SET);
    const int c = std::fgetc(fp);
    std::fseek(fp, pos, SEEK_SET);
    std::fputc(c ^ (flip_byte ? 0x5a : 0x01), fp);
    std::fclose(fp);
    std::printf("flipped %s %ld of %s (data of %s at %llu, %llu bytes)\n",
                flip_byte ? "byte" : "the lowest bit of byte", pos, argv[2], argv[3],
                (unsigned long long)addr, (unsigned long long)size);
    return 0;
  }
  if (argc == 3 && std::strcmp(argv[1], "drop-model") == 0) {  // a checkpoint without weights
    hid_t f = H5Fopen(argv[2], H5F_ACC_RDWR, H5P_DEFAULT);
    if (f < 0) return 1;
    const herr_t rc = H5Ldelete(f, "model", H5P_DEFAULT);
    H5Fclose(f);
    return rc < 0 ? 1 : 0;
  }
  if (argc == 4 && std::strcmp(argv[1], "unlink") == 0) {  // one tensor missing from a file
    hid_t f = H5Fopen(argv[2], H5F_ACC_RDWR, H5P_DEFAULT);
    if (f < 0) return 1;
    const herr_t rc = H5Ldelete(f, argv[3], H5P_DEFAULT);
    H5Fclose(f);
    return rc < 0 ? 1 : 0;
  }
  if (argc == 6 && std::strcmp(argv[1], "set-attr") == 0) {
    const long long v = std::strtoll(argv[5], nullptr, 10);
    hid_t f = H5Fopen(argv[2], H5F_ACC_RDWR, H5P_DEFAULT);
    if (f < 0) return 1;
    hid_t d = H5Oopen(f, argv[3], H5P_DEFAULT);  // a dataset, or "/" for the file's attributes
    hid_t a = d >= 0 ? H5Aopen(d, argv[4], H5P_DEFAULT) : -1;
    const int rc = a >= 0 && H5Awrite(a, H5T_NATIVE_LLONG, &v) >= 0 ? 0 : 1;
    if (a >= 0) H5Aclose(a);
    if (d >= 0) H5Oclose(d);
    H5Fclose(f);
    return rc;
  }
  std::fprintf(stderr,
               "usage: test_checkpoint_tool set-version FILE N | flip-byte FILE DATASET | "
               "flip-bit FILE DATASET | drop-model FILE | unlink FILE DATASET | "
               "set-attr FILE OBJECT NAME N\n");
  return 2;
}
