"""The two Rust artifacts of the wheel, built by setuptools-rust (pyproject.toml has the rest).

- libmemsnap.so, the root package's cdylib, goes into the `memsnap` Python package as a
  plain file for LD_PRELOAD (`memsnap.library_path()` returns it). It is no Python extension
  module, so it keeps its own name, without an interpreter tag.
- the `memsnap` binary of crates/cli goes into the wheel's scripts, so pip puts it on PATH.

Both are release builds, also for `pip install -e .` (setuptools-rust would otherwise build
debug artifacts there, and the hooks would run unoptimized in the program under study).

Nothing in the wheel depends on the Python version, so its tag is py3-none-<platform>;
scripts/build-wheel.sh turns linux_x86_64 into the manylinux tag that auditwheel finds.
"""

import os

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext
from setuptools_rust import Binding, RustBin, RustExtension
from setuptools_rust.build import build_rust

LIBRARY = "memsnap.libmemsnap"


class BuildExt(build_ext):
    # Called with the dotted name or, by get_ext_fullpath, with its last part only.
    def get_ext_filename(self, fullname):
        if fullname.split(".")[-1] == LIBRARY.split(".")[-1]:
            return os.path.join(*fullname.split(".")) + ".so"
        return super().get_ext_filename(fullname)


class BuildRust(build_rust):
    """Says, before cargo starts, that the build takes minutes.

    pip shows nothing of a build backend's output unless run with -v (only "still
    running..." once a minute), so the note goes to the terminal itself when there is one,
    once per build; without a terminal (CI, logs) nothing is written.
    """

    def run(self):
        try:
            with open("/dev/tty", "w") as tty:
                tty.write(
                    "memsnap: cargo builds libmemsnap.so and the memsnap command (release): "
                    "4 to 8 minutes on 2 cores the first time, about 2 after a cargo build "
                    "of the clone, seconds when pip built them before; `pip install -v .` "
                    "shows cargo's progress\n"
                )
        except OSError:
            pass
        super().run()


class BdistWheel(bdist_wheel):
    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


# setuptools' own build folders go under cargo's target/, which git already ignores.
BUILD_DIR = os.path.join("target", "python-build")
os.makedirs(BUILD_DIR, exist_ok=True)

setup(
    rust_extensions=[
        RustExtension(
            LIBRARY,
            path="Cargo.toml",
            binding=Binding.NoBinding,
            cargo_manifest_args=["--locked"],
            debug=False,
        ),
        RustBin(
            "memsnap", path="crates/cli/Cargo.toml", cargo_manifest_args=["--locked"], debug=False
        ),
    ],
    cmdclass={"build_ext": BuildExt, "build_rust": BuildRust, "bdist_wheel": BdistWheel},
    options={"build": {"build_base": BUILD_DIR}, "egg_info": {"egg_base": BUILD_DIR}},
)
