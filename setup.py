"""Build steps that pyproject.toml cannot declare.

1. build_py generates kvd/v1/kvd_pb2.py(i), the messages, from
   proto/kvd/v1/kvd.proto with grpc_tools.protoc, into the source tree, so
   normal and editable installs (and a plain checkout after `make proto`) all
   have it. The service's stub and handlers are built from its descriptor
   (kvd/wire/grpc.py).
2. The C extension kvd.io._uring (native/*.c, linked with liburing, and
   xxHash's header-only build for the L2 record checks) is optional: when the
   source, the liburing or xxHash headers (Debian liburing-dev,
   libxxhash-dev) or a compiler are missing, the build prints one line and
   goes on; kvd then uses its thread-pool I/O and checks records in Python.
"""

import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO_DIR = ROOT / "proto"
PROTO_FILE = PROTO_DIR / "kvd" / "v1" / "kvd.proto"
GENERATED = [
    ROOT / "kvd" / "v1" / name for name in ("kvd_pb2.py", "kvd_pb2.pyi")
]
NATIVE_SOURCE = ROOT / "native" / "kvd_uring.c"
# kvd.io._uring is one extension built from these files (native/README.md).
NATIVE_SOURCES = [
    ROOT / "native" / name
    for name in (
        "kvd_uring.c", "kvd_slots.c", "kvd_reads.c", "kvd_record.c", "kvd_xxh3_avx2.c",
        "kvd_xxh3_avx512.c", "kvd_copy.c", "kvd_pool.c", "kvd_net.c", "kvd_density.c",
        "kvd_plan.c",
    )
]


def generate_proto() -> None:
    """Run protoc unless every generated file is newer than the .proto."""
    proto_mtime = PROTO_FILE.stat().st_mtime
    if all(path.exists() and path.stat().st_mtime >= proto_mtime for path in GENERATED):
        return
    from grpc_tools import protoc  # build requirement (pyproject.toml)

    include = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={ROOT}",
        f"--pyi_out={ROOT}",
        str(PROTO_FILE),
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {PROTO_FILE}")
    print(f"generated {', '.join(str(p.relative_to(ROOT)) for p in GENERATED)}")


class BuildPyWithProto(build_py):
    def run(self) -> None:
        generate_proto()
        super().run()


class OptionalBuildExt(build_ext):
    """Build each extension if possible; a failure is reported, never fatal."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as error:  # compiler missing, distutils platform errors
            self._skip("all", error)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as error:  # CompileError, LinkError, missing liburing.h
            self._skip(ext.name, error)

    @staticmethod
    def _skip(name: str, error: BaseException) -> None:
        print(
            f"kvd: optional extension {name} not built ({type(error).__name__}: {error}); "
            "kvd will use thread-pool I/O instead of io_uring",
            file=sys.stderr,
        )


def extensions() -> list[Extension]:
    if not NATIVE_SOURCE.exists():
        print(f"kvd: {NATIVE_SOURCE.relative_to(ROOT)} is absent; building without kvd.io._uring")
        return []
    return [
        Extension(
            "kvd.io._uring",
            sources=[str(path.relative_to(ROOT)) for path in NATIVE_SOURCES],
            include_dirs=["native"],
            libraries=["uring"],
            # No fused multiply-add: the density plan (kvd_plan.c) rounds as numpy does.
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-std=gnu11", "-ffp-contract=off"],
            optional=True,
        )
    ]


setup(
    cmdclass={"build_py": BuildPyWithProto, "build_ext": OptionalBuildExt},
    ext_modules=extensions(),
)
