"""Builds the optional C kernels of ``headroom.nn`` (the rest of the metadata is in pyproject.toml).

``optional=True``: where no C compiler is available the install goes on without them, and
``headroom.nn`` uses its NumPy/PyTorch code for the same results.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "headroom.nn._bitkernels",
            ["src/headroom/nn/_bitkernels.c"],
            extra_compile_args=["-O3", "-std=c11"],
            optional=True,
        )
    ]
)
