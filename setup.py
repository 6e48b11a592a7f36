"""Package discovery for setuptools (the rest of the metadata is in pyproject.toml).

Every package under agentroll/ is found; the top-level folders environments/ and tools/
install as agentroll.environments and agentroll.tools.
"""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["agentroll", "agentroll.*"]),
        "agentroll.environments",
        "agentroll.tools",
    ],
    package_dir={"agentroll.environments": "environments", "agentroll.tools": "tools"},
)
