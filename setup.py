"""Maps the repository folders onto the one `polyserve` distribution (DESIGN.md, Layout)."""
from setuptools import find_packages, setup

ROOTS = {"polyserve": "services", "polyserve.shared": "shared", "polyserve.proto": "proto"}
packages = [name for name in ROOTS]
for name, folder in ROOTS.items():
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]

setup(
    packages=packages,
    package_dir=ROOTS,
    package_data={"polyserve.proto": ["v1/*.json", "README.md"], "polyserve": ["core/profiles/*.json", "predictor/artifacts/*/*", "worker/engines/*.json"]},
)
