"""The documentation is executable: every shell and Python block of README.md and docs/*.md runs as
written, in order, from the repository root, so a block that stops working fails CI.

Blocks are found with markdown-it-py (the CommonMark parser), one test per block. An HTML comment
right before a block, invisible on the rendered page, says how to run it:

    <!-- doc-test: skip cluster -->        needs a Kubernetes cluster (or: gpu, long: <why>, ...)
    <!-- doc-test: serves 8080/ready -->   starts a server that keeps running: it runs in the
                                           background until GET that path answers 200, and stays up
                                           for the file's later blocks (stopped at the file's end,
                                           or when the next `serves` block starts)

Every other block must exit 0 within its time limit. `loraplex` is the checkout's own (.venv/bin on
PATH); files the blocks write land in the repository root, as they would for a reader (/models,
/.loraplex and *.jsonl outputs are git-ignored or removed afterwards)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from loraplex.ports import in_use, listener

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELLS = {"bash", "sh", "shell"}
MARKER = re.compile(r"<!--\s*doc-test:\s*(skip|serves)\s*(.*?)\s*-->", re.S)
BLOCK_TIMEOUT_S = 240
SERVER_START_S = 240


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    lang: str
    code: str
    marker: tuple[str, str] | None

    @property
    def id(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def collect() -> list[Block]:
    found = []
    for doc in DOCS:
        tokens = MarkdownIt().parse(doc.read_text())
        for i, token in enumerate(tokens):
            lang = token.info.split()[0] if token.info.strip() else ""
            if token.type != "fence" or lang not in SHELLS | {"python"}:
                continue
            before = tokens[i - 1] if i and tokens[i - 1].type == "html_block" else None
            match = MARKER.search(before.content) if before is not None else None
            found.append(Block(doc, token.map[0] + 1, lang, token.content,
                               (match.group(1), match.group(2)) if match else None))
    return found


BLOCKS = collect()
pytestmark = pytest.mark.slow  # minutes: it starts `loraplex up` three times and two agents


class Servers:
    """The servers the blocks of the current file started; stopped when the next file begins."""

    def __init__(self) -> None:
        self.doc: Path | None = None
        self.running: list[tuple[subprocess.Popen, int]] = []  # (process, the port it serves)

    def enter(self, doc: Path) -> None:
        if doc != self.doc:
            self.stop()
            self.doc = doc

    def start(self, block: Block, env: dict[str, str], log: Path) -> None:
        """Stops the servers started before (one at a time: they share ports), then starts this one."""
        self.stop()
        port, _, path = block.marker[1].partition("/")
        if in_use(int(port)):  # the answer below must come from this block's server, not a leftover
            pytest.fail(f"{block.id}: port {port} is in use before the block runs ({listener(int(port))})")
        with log.open("wb") as out:
            process = subprocess.Popen(_argv(block), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        self.running.append((process, int(port)))
        url = f"http://127.0.0.1:{port}/{path or 'health'}"
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(f"{block.id}: exited with {process.returncode} while starting:\n{_tail(log)}")
            if _answers(url) and process.poll() is None:
                return
            time.sleep(0.5)
        pytest.fail(f"{block.id}: {url} did not answer 200 within {SERVER_START_S} s:\n{_tail(log)}")

    def stop(self) -> None:
        """SIGTERM, as a terminal's Ctrl-C would; the server must then free its port (nothing left behind)."""
        running, self.running = self.running, []
        for process, port in reversed(running):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
            deadline = time.monotonic() + 30
            while in_use(port) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not in_use(port), f"port {port} is still served after its block stopped: {listener(port)}"


@pytest.fixture(scope="module")
def servers():
    running = Servers()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    if not (ROOT / "models" / "tiny" / "base" / "config.json").is_file():  # a reader has it from `loraplex up`
        subprocess.run([str(Path(bin_dir) / "loraplex"), "make-tiny-model", "models/tiny"], cwd=ROOT, check=True,
                       capture_output=True)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONUNBUFFERED": "1",
            "ADMIN_KEY": "doc-test-admin-key"}  # the docs' $ADMIN_KEY, the reader's own secret


@pytest.fixture(scope="module", autouse=True)
def cleanup():
    """Remove what the blocks wrote into the checkout that was not there before (not /models or /.loraplex)."""
    before = set(_untracked())
    yield
    for path in set(_untracked()) - before:
        if path.is_file():
            path.unlink()


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_runs_as_written(block: Block, servers: Servers, env: dict[str, str], tmp_path: Path) -> None:
    servers.enter(block.doc)
    if block.marker and block.marker[0] == "skip":
        pytest.skip(f"{block.id}: {block.marker[1]}")
    if block.marker and block.marker[0] == "serves":
        servers.start(block, env, tmp_path / "server.log")
        return
    result = subprocess.run(_argv(block), cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=BLOCK_TIMEOUT_S)
    assert result.returncode == 0, f"{block.id} exited with {result.returncode}:\n{result.stdout[-3000:]}\n" \
                                   f"{result.stderr[-3000:]}"


def test_every_skip_says_why() -> None:
    for block in BLOCKS:
        if block.marker:
            assert block.marker[1], f"{block.id}: a doc-test marker without a reason or port"


# An HTTP error answer fails the block too (curl itself exits 0 on a 4xx/5xx answer).
CURL_FAILS = 'curl() { command curl --fail-with-body "$@"; }\n'


def _argv(block: Block) -> list[str]:
    if block.lang == "python":
        return [sys.executable, "-c", block.code]
    return ["bash", "-e", "-o", "pipefail", "-c", CURL_FAILS + block.code]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:] if log.exists() else ""


def _untracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True,
                         text=True).stdout
    return [ROOT / line for line in out.splitlines()]
