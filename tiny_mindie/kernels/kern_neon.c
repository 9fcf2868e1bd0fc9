/* The aarch64 path (NEON with the dot product extension) is not written yet: aarch64 runs the
 * portable path. */
#include "tm_kernels.h"

typedef int tm_no_neon;  /* ISO C: a translation unit is not empty */
