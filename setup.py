"""The build of tiny_mindie's C kernel library (tiny_mindie/kernels), everything else being in
setup.cfg. The extension is optional: where no C compiler is present (or it fails) the package
installs without it and the graph keeps onnxruntime's own kernels. No -march: each ISA path is
compiled for its ISA by target attributes and chosen at run time."""

import importlib.util
import sys

from setuptools import Extension, setup

KERNELS = "tiny_mindie/kernels/"


def sources_digest() -> str:
    """kernels/sources.py's digest of the C sources, loaded by path (nothing is installed yet)."""
    spec = importlib.util.spec_from_file_location("tm_sources", KERNELS + "sources.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.digest(KERNELS)


ext_modules = []
if sys.platform != "win32":
    ext_modules.append(Extension(
        "tiny_mindie.kernels._tm_kernels",
        sources=[KERNELS + f for f in ("dispatch.c", "kern_portable.c", "kern_x86.c",
                                       "kern_x86_16.c", "kern_neon.c", "kern_gather.c",
                                       "ort_op.c")],
        depends=[KERNELS + f for f in ("tm_kernels.h", "kern_impl.h", "kern_x86_512.h")],
        # -ffp-contract=off: no fused multiply-add, so every path rounds alike
        extra_compile_args=["-std=c11", "-O3", "-ffp-contract=off", "-fvisibility=hidden",
                            "-fno-math-errno", "-D_GNU_SOURCE"],
        libraries=["m", "pthread"],
        define_macros=[("TM_SOURCES_SHA256", f'"{sources_digest()}"')],
        optional=True,
    ))

setup(ext_modules=ext_modules)
