# Everything is in pyproject.toml; this file only adds the ring buffer's C atomics, built with
# cffi at install time (setuptools has no pyproject field for cffi_modules).
from setuptools import setup

setup(cffi_modules=["transport/ring/_atomics_build.py:ffibuilder"])
