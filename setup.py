"""mpicoll: MPI collectives for distributed SGD (ring, parallel and automatic allreduce, ...)."""

import pathlib
import re

from setuptools import find_packages, setup

HERE = pathlib.Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "mpicoll" / "__init__.py").read_text()).group(1)

setup(
    name="mpicoll",
    version=VERSION,
    description="MPI collective communication for distributed SGD: a drop-in mpi4py communicator",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # The CUDA sources in the top-level kernels/ folder ship as package data of mpicoll.
    packages=[*find_packages(include=["mpicoll", "mpicoll.*"]), "mpicoll.kernels"],
    package_dir={"mpicoll.kernels": "kernels"},
    package_data={"mpicoll.kernels": ["*.cu", "*.cuh"]},
    install_requires=["mpi4py>=4.0", "numpy>=1.23", "threadpoolctl"],
    extras_require={
        # The MPICH wheel: an MPI for machines that have none.  On a cluster,
        # leave it out and mpi4py uses the system's MPI.
        "mpich": ["mpich"],
        "plot": ["matplotlib"],
        # The default training data (scikit-learn's handwritten digits, shipped inside the package).
        "data": ["scikit-learn"],
        # Fused CPU kernels; without them the kernel layer runs on numpy.
        "numba": ["numba>=0.59"],
        # Device arrays: CuPy's binary wheel and Numba's CUDA target, for CUDA 12 (gpu) or 13 (gpu-cuda13).
        # (The plain "cupy" package builds from source; pick the cupy-cudaXXx wheel of your CUDA.)
        "gpu": ["cupy-cuda12x", "numba>=0.59", "numba-cuda[cu12]"],
        "gpu-cuda12": ["cupy-cuda12x", "numba>=0.59", "numba-cuda[cu12]"],
        "gpu-cuda13": ["cupy-cuda13x", "numba>=0.59", "numba-cuda[cu13]"],
        # mpicoll.torch: PyTorch tensors, models and optimizers (any torch build; pick yours from pytorch.org).
        "torch": ["torch"],
        # The tests also run the Numba CUDA kernels under Numba's CUDA simulator, and mpicoll.torch on
        # torch's CPU build (pinned: an unpinned torch pulls a CUDA build of several GB).
        "test": ["pytest>=7", "pytest-mpi>=0.6", "matplotlib", "numba>=0.59", "numba-cuda", "scikit-learn",
                 "torch==2.13.0"],
    },
    entry_points={"console_scripts": ["mpicoll = mpicoll.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: System :: Distributed Computing",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
