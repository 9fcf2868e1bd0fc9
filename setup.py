"""The build of tiny_mindie's C kernel library (tiny_mindie/kernels), everything else being in
setup.cfg. The extension is optional: where no C compiler is present (or it fails) the package
installs without it and the graph keeps onnxruntime's own kernels. No -march: each ISA path is
compiled for its ISA by target attributes and chosen at run time. The library embeds the digest
of its sources (tiny_mindie/kernels/sources.py), and is rebuilt whenever the build at hand
embeds another."""

import importlib.util
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

KERNELS = "tiny_mindie/kernels/"


def _load_sources():
    """kernels/sources.py, loaded by its path (nothing is installed yet)."""
    spec = importlib.util.spec_from_file_location("tm_sources", KERNELS + "sources.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sources = _load_sources()
DIGEST = sources.digest(KERNELS)


class BuildKernels(build_ext):
    """``build_ext`` that also rebuilds a library embedding another digest than the sources'
    (setuptools alone rebuilds only when a source file is newer than the library)."""

    def build_extension(self, ext):
        out = self.get_ext_fullpath(ext.name)
        if os.path.exists(out) and sources.embedded(out) != DIGEST:
            self.force = True
        super().build_extension(ext)


ext_modules = []
if sys.platform != "win32":
    ext_modules.append(Extension(
        "tiny_mindie.kernels._tm_kernels",
        sources=[KERNELS + f for f in sources.SOURCES],
        depends=[KERNELS + f for f in sources.DEPENDS],
        # -ffp-contract=off: no fused multiply-add, so every path rounds alike
        extra_compile_args=["-std=c11", "-O3", "-ffp-contract=off", "-fvisibility=hidden",
                            "-fno-math-errno", "-D_GNU_SOURCE"],
        libraries=["m", "pthread"],
        define_macros=[("TM_SOURCES_SHA256", f'"{DIGEST}"')],
        optional=True,
    ))

setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildKernels})
