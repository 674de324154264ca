"""Package discovery that pyproject.toml cannot express: the top-level `kernels/` directory is installed
under the import name `fp8_kernels` (the bare name `kernels` belongs to an unrelated package on the index)."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["fp8_trainer*", "monitor_server*", "fp8_protocol*"])
    + ["monitor_server.migrations.versions"]  # Alembic's folder of revisions has no __init__.py
    + ["monitor_server.web_assets", "monitor_server.web_assets.js"]  # the dashboard's files, from web/
    + ["fp8_kernels"]
    + [f"fp8_kernels.{p}" for p in find_packages("kernels")],
)
