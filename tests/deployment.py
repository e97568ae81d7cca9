"""A real `onepiece up` run as a subprocess, and small helpers for end-to-end tests."""

from __future__ import annotations

import contextlib
import io
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import imageio.v3 as iio
import numpy as np
import psutil
from PIL import Image


class Up:
    """`onepiece up` as a subprocess, with its output collected line by line."""

    def __init__(self, topology: Path, logs: Path, nm: str, python: str = sys.executable,
                 cwd: Path | None = None) -> None:
        self.nm, self.logs = nm, logs
        self.proc = subprocess.Popen(
            [python, "-m", "onepiece", "up", "--topology", str(topology), "--logs", str(logs)], cwd=cwd,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)  # ends at the output's end
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            self.output.append(line)
            m = re.search(pattern, line)
            if m:
                return m
        raise AssertionError(f"no line matching {pattern!r} in {timeout}s; output:\n{''.join(self.output)}")

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def routes(self, set_name: str = "set0") -> dict:
        from onepiece.nm.client import NmClient

        client = NmClient(self.nm)
        try:
            return client.routes(set_name)
        finally:
            client.close()

    def stop(self) -> None:
        """SIGTERM, then (after a bounded wait) kill whatever is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                for child in psutil.Process(self.proc.pid).children(recursive=True):
                    child.kill()
                self.proc.kill()


@contextlib.contextmanager
def serving(topology: Path, logs: Path, nm: str, timeout: float = 240.0) -> Iterator[Up]:
    """`onepiece up` of ``topology`` once it serves the API (its ``url`` set); stopped on the way out."""
    dep = Up(topology, logs, nm)
    try:
        dep.url = dep.wait_for(r"serves the API at (http://\S+)", timeout=timeout).group(1)
        yield dep
    finally:
        dep.stop()


def decode_mp4(data: bytes) -> np.ndarray:
    return iio.imread(data, extension=".mp4")


def png(width: int, height: int) -> bytes:
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
