"""Package discovery that pyproject.toml cannot express: Alembic's folder of revisions (no __init__.py) and
the dashboard's files (the top-level web/ folder, installed as monitor_server.web_assets)."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["fp8_trainer*", "fp8_kernels*", "monitor_server*", "fp8_protocol*"])
    + ["monitor_server.storage.migrations.versions"]  # Alembic's folder of revisions has no __init__.py
    + ["monitor_server.web_assets", "monitor_server.web_assets.js"],  # the dashboard's files, from web/
)
