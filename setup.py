"""Only what setup.cfg cannot say: `patches/` is the source root of the
`odb_factory_patches` package (patches/odb_factory_patches/), odb_factory_hook.pth
ships at the top of site-packages, so a plain `llamafactory-cli` (and each torchrun
worker) applies the patches, and the flat recipes of `recipes/` ship as package data
(odb_factory/recipes_data, read by `python -m odb_factory.recipes`)."""

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

PTH = "odb_factory_hook.pth"
# what `python -m odb_factory.recipes write` needs: the flat recipes and the files they name
RECIPE_FILES = ("*.yaml", "tiny/*.yaml", "README.md", "data/dataset_info.json", "parts/deepspeed/*.json")


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH, str(Path(self.build_lib) / PTH), preserve_mode=False)
        for source, target in self._recipe_files():
            self.mkpath(str(target.parent))
            self.copy_file(str(source), str(target), preserve_mode=False)

    def _recipe_files(self):
        out = Path(self.build_lib) / "odb_factory" / "recipes_data"
        for pattern in RECIPE_FILES:
            for source in sorted(Path("recipes").glob(pattern)):
                yield source, out / source.relative_to("recipes")

    def get_outputs(self, include_bytecode=True):
        return (super().get_outputs(include_bytecode) + [str(Path(self.build_lib) / PTH)]
                + [str(target) for _, target in self._recipe_files()])


setup(
    packages=find_packages(include=["odb_factory", "odb_factory.*"]) + ["odb_factory_patches"],
    package_dir={"odb_factory_patches": "patches/odb_factory_patches"},
    cmdclass={"build_py": build_py_with_pth},
)
