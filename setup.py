"""Only what setup.cfg cannot say: `patches/` is the source root of the
`odb_factory_patches` package (patches/odb_factory_patches/), and odb_factory_hook.pth
ships at the top of site-packages, so a plain `llamafactory-cli` (and each torchrun
worker) applies the patches."""

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

PTH = "odb_factory_hook.pth"


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH, str(Path(self.build_lib) / PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [str(Path(self.build_lib) / PTH)]


setup(
    packages=find_packages(include=["odb_factory", "odb_factory.*"]) + ["odb_factory_patches"],
    package_dir={"odb_factory_patches": "patches/odb_factory_patches"},
    cmdclass={"build_py": build_py_with_pth},
)
