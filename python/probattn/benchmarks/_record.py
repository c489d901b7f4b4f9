"""What the package's benchmarks share: the code's version for a record, and files written
atomically (a killed run leaves the old file or the new one, never half of one)."""

import os
import subprocess
import tempfile


def git_state():
    """`{"git_sha", "git_dirty"}` of the checkout holding this file (untracked files aside)."""
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    run = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout.strip()  # noqa: E731
    return {"git_sha": run("rev-parse", "HEAD"), "git_dirty": bool(run("status", "--porcelain", "--untracked-files=no"))}


def write_atomic(path, text):
    """Writes `text` to `path` through a temporary file in the same folder."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
