"""Files written atomically: each goes to a temporary file beside its destination and is renamed
over it when complete, so an interrupted script leaves the previous file or none, never half of one.
Every result, table and manifest the tools write goes through here."""

import json
import os


def atomic_write_text(path, text):
    """Writes `text` to `path`."""
    path = os.fspath(path)
    partial = path + ".tmp"
    try:
        with open(partial, "w") as f:
            f.write(text)
        os.replace(partial, path)
    except BaseException:
        if os.path.exists(partial):
            os.remove(partial)
        raise


def atomic_write_json(path, data, indent=1):
    """Writes `data` as JSON to `path`, ending in a newline (`indent=None`: on one line). Data that
    JSON cannot hold raises before anything is written."""
    atomic_write_text(path, json.dumps(data, indent=indent) + "\n")
