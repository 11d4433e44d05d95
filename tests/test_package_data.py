"""A non-editable install (a built wheel, installed into a fresh folder) carries the router data, the
default hooks and the compiled translations, and routes a question and speaks Chinese from there."""

from __future__ import annotations

import pytest

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

pytestmark = [pytest.mark.subprocess]

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_built_wheel_ships_the_rules_and_routes(tmp_path):
    wheel_dir, target, source = tmp_path / "wheel", tmp_path / "site", tmp_path / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("deskeye", "inference_worker"):           # a clean copy: setuptools builds in the source tree
        shutil.copytree(REPO_ROOT / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                            "-w", str(wheel_dir), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    wheel = next(wheel_dir.glob("deskeye-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "deskeye/rules/router_queries.tsv" in names and "deskeye/rules/hooks.toml" in names
    assert {f"deskeye/locale/{locale}/LC_MESSAGES/deskeye.mo" for locale in ("zh_CN", "zh_TW")} <= set(names)
    zipfile.ZipFile(wheel).extractall(target)                # what pip puts into site-packages
    env = {**os.environ, "PYTHONPATH": str(target), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    code = ("import deskeye, sys; from deskeye.cli import main; "
            "assert deskeye.__file__.startswith(sys.argv[1]), deskeye.__file__; "
            "sys.exit(main(['route', 'what time is it']))")
    routed = subprocess.run([sys.executable, "-c", code, str(target)], env=env, capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert routed.returncode == 0, routed.stderr
    assert routed.stdout.split()[0] == "quick"
    checked = subprocess.run([sys.executable, "-c", "import sys; from deskeye.cli import main; "
                              "sys.exit(main(['hooks', 'check']))"], env=env, capture_output=True, text=True,
                             timeout=120, cwd=tmp_path)
    assert checked.returncode == 0 and "deskeye/rules/hooks.toml" in checked.stdout, checked.stderr
    spoken = subprocess.run([sys.executable, "-c", "from deskeye.language import translator; "
                             "print(translator('zh_CN').gettext('Quit'), translator('zh_TW').gettext('Quit'))"],
                            env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert spoken.returncode == 0 and spoken.stdout.split() == ["退出", "結束"], spoken.stderr
