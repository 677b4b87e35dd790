"""What a user installs: the wheel's and the sdist's contents, and the errors an optional extra's absence gives."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

NOT_SHIPPED = shutil.ignore_patterns(
    ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".cache", "results"
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[zipfile.ZipFile, tarfile.TarFile]:
    """The wheel and the sdist built from a copy of the working tree (a build writes into its source tree)."""
    source = tmp_path_factory.mktemp("source") / "infokv-rag"
    shutil.copytree(ROOT, source, ignore=NOT_SHIPPED)
    dist = source / "dist"
    build = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(dist), "."]
    subprocess.run(build, cwd=source, check=True, capture_output=True)
    sdist = "from setuptools import build_meta; build_meta.build_sdist('dist')"
    subprocess.run([sys.executable, "-c", sdist], cwd=source, check=True, capture_output=True)
    (wheel,) = dist.glob("*.whl")
    (tarball,) = dist.glob("*.tar.gz")
    return zipfile.ZipFile(wheel), tarfile.open(tarball)


def test_the_wheel_holds_the_package_its_data_its_types_and_its_licence(
    built: tuple[zipfile.ZipFile, tarfile.TarFile],
) -> None:
    names = set(built[0].namelist())
    for package in ("infokv_rag", "infokv_rag/scorers", "infokv_rag/kernels", "infokv_rag/integrations"):
        assert f"{package}/__init__.py" in names, package
    for module in ("service/routers/documents.py", "integrations/langchain.py", "kernels/__init__.py"):
        assert f"infokv_rag/{module}" in names, module
    assert "infokv_rag/py.typed" in names  # type checkers read the annotations of an installed package
    assert "infokv_rag/service/static/index.html" in names
    assert len([n for n in names if n.startswith("infokv_rag/data/surrogates/") and n.endswith(".safetensors")]) == 2
    assert len([n for n in names if n.startswith("infokv_rag/data/corpus/") and n.endswith(".txt")]) == 4
    assert not [n for n in names if n.split("/")[0] in ("kernels", "integrations", "tests", "benchmarks")]
    dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    metadata = built[0].read(f"{dist_info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert "Apache License" in built[0].read(f"{dist_info}/licenses/LICENSE").decode()
    assert "infokv-rag = infokv_rag.cli:main" in built[0].read(f"{dist_info}/entry_points.txt").decode()


def test_the_sdist_holds_what_its_tests_and_benchmarks_import(built: tuple[zipfile.ZipFile, tarfile.TarFile]) -> None:
    names = {name.split("/", 1)[1] for name in built[1].getnames() if "/" in name}
    needed = ("LICENSE", "Makefile", "tests/conftest.py", "tests/helpers.py", "benchmarks/realdocs/questions.json")
    for path in (*needed, "examples/sample/maintenance-agreement.pdf"):
        assert path in names, path
    tracked = {path.relative_to(ROOT).as_posix() for path in (ROOT / "tests").rglob("*") if path.is_file()}
    assert {path for path in tracked if "__pycache__" not in path} <= names


BLOCKER = """
import importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] == {missing!r}:
            raise ModuleNotFoundError(f"No module named {{fullname!r}}", name=fullname)
sys.meta_path.insert(0, Missing())
try:
    import {module}
except Exception as exc:
    print(type(exc).__name__, exc)
"""


@pytest.mark.parametrize(
    ("missing", "module", "extra"),
    [
        ("langchain_core", "infokv_rag.integrations.langchain", "langchain"),
        ("llama_index", "infokv_rag.integrations.llama_index", "llamaindex"),
        ("fastapi", "infokv_rag.service.app", "service"),
        # Starlette parses uploads with it: without it the service started, then answered every upload 500.
        ("python_multipart", "infokv_rag.service.app", "service"),
    ],
)
def test_a_missing_extra_is_named_when_its_module_is_imported(missing: str, module: str, extra: str) -> None:
    code = BLOCKER.format(missing=missing, module=module)
    printed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert f"pip install 'infokv-rag[{extra}]'" in printed, printed


def test_every_public_name_resolves_and_the_package_imports_no_torch_until_one_is_used() -> None:
    """What a user imports from `infokv_rag` (README's snippets: Document, Generation, Usage, StoreWriteWarning,
    load_document beside the engine) is there, each the object of its own module, and importing the package alone
    stays light, so the command line can refuse a bad document at once."""
    code = (
        "import sys, importlib, infokv_rag\n"
        "light = 'torch' not in sys.modules\n"
        "names = sorted(infokv_rag.__all__)\n"
        "assert names == sorted(set(names)), 'a name listed twice'\n"
        "assert {'Document', 'Generation', 'Usage', 'StoreWriteWarning', 'load_document'} <= set(names)\n"
        "for name in names:\n"
        "    value = getattr(infokv_rag, name)\n"
        "    module = importlib.import_module(value.__module__)\n"
        "    assert getattr(module, name) is value, name\n"
        "assert set(names) <= set(dir(infokv_rag))\n"
        "print(light)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
