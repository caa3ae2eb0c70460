"""The optional C extension of the fs tier (everything else is in pyproject.toml).

``kvbridge.offload._fsio`` reads a load's block files without the GIL
(:mod:`kvbridge.offload.fs_fast`). It is optional: where no C compiler or Python
headers exist, the build of it fails, setuptools goes on without it, and the fs tier
reads its files the plain way (logged once; ``kvbridge doctor`` says which).
"""

from setuptools import Extension, setup

# The repository root is the package, so a wheel carries this file as kvbridge/setup.py:
# importing it must do nothing (setuptools' build backend runs it as __main__).
if __name__ == "__main__":
    setup(ext_modules=[Extension("kvbridge.offload._fsio", sources=["offload/_fsio.c"],
                                 extra_compile_args=["-O2", "-std=c11", "-D_GNU_SOURCE"],
                                 optional=True)])
