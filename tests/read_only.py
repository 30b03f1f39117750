"""A read-only view of a folder (a bind mount remounted ``ro``), for the tests that load checkpoints a run may not
write to: root only, skipped otherwise, unmounted on the way out."""
from __future__ import annotations

import contextlib
import os
import subprocess

import pytest


@contextlib.contextmanager
def read_only_view(src, dst):
    if os.geteuid() != 0:
        pytest.skip("needs root for a read-only bind mount")
    dst.mkdir()
    subprocess.run(["mount", "--bind", str(src), str(dst)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(dst)], check=True)
        yield dst
    finally:
        subprocess.run(["umount", "-l", str(dst)], check=True)
