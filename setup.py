"""Build hook for the compiled UCX binding; all metadata lives in pyproject.toml.

``cffi_modules`` makes setuptools compile ``ray_velo.ucx._ucx_binding`` from the builder in
``ray_velo/ucx/_build.py``, against the headers of the ``libucx-cu12`` build requirement.
"""

from setuptools import setup  # type: ignore[import-untyped]

setup(cffi_modules=["ray_velo/ucx/_build.py:ffibuilder"])
