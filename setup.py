# Everything is in pyproject.toml; this file only adds the ring buffer's compiled side (atomics,
# entry checksum, shared-memory fast path), built with cffi at install time (setuptools has no
# pyproject field for cffi_modules).
from setuptools import setup

setup(cffi_modules=["transport/ring/_atomics_build.py:ffibuilder"])
