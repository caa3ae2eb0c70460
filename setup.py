"""The optional C extension of the fs tier (everything else is in pyproject.toml).

``kvbridge.offload._fsio`` reads a load's and writes a store's block files without the
GIL (:mod:`kvbridge.offload.fs_fast`). It is optional: where no C compiler or Python
headers exist, the build of it fails, setuptools goes on without it, and the fs tier
reads and writes its files the plain way (logged once; ``kvbridge doctor`` says which).
"""

from setuptools import Extension, setup
from setuptools.command.build_py import build_py


class BuildPy(build_py):
    """The repository root is the package ``kvbridge``: leave this build script out of it."""

    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        return [m for m in super().find_package_modules(package, package_dir)
                if not (package == "kvbridge" and m[1] == "setup")]


# setuptools' build backend runs this file as __main__; importing it does nothing
if __name__ == "__main__":
    setup(cmdclass={"build_py": BuildPy},
          ext_modules=[Extension("kvbridge.offload._fsio", sources=["offload/_fsio.c"],
                                 extra_compile_args=["-O2", "-std=c11", "-D_GNU_SOURCE"],
                                 optional=True)])
