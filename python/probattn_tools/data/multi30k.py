"""Multi30k task 1 German-English (raw, cased text): download and verify.

  download  fetch the canonical gzipped files (multi30k/dataset on GitHub), gunzip them, check
            their checksums, and write train|val|test.{de,en} (test = test_2016_flickr), the
            layout `probattn translate --dataset multi30k` reads
  verify    check the files in a folder against the known checksums

The checksums are those of multi30k/dataset at commit a3d2e0d2 (data/task1/raw/*.gz,
gunzipped). The default folder is multi30k/ under the data folder ($PROBATTN_DATA, else data/),
where `probattn translate` looks by default. Each file is written to a temporary name and renamed
only once its checksum is right, so nothing half-written is left behind.
"""

import argparse
import gzip
import hashlib
import os
import sys
import urllib.request

URL = "https://github.com/multi30k/dataset/raw/master/data/task1/raw/{upstream}.{lang}.gz"
UPSTREAM = {"train": "train", "val": "val", "test": "test_2016_flickr"}
SHA256 = {
    "train.de": "2c2b73fd2b548fbcde3a875e0a78d6ee94d498bfdee6bd3eae3945779e9ddf72",
    "train.en": "460a15fbd157e34a7a9957ee388c1ca247fe47af3ef25fb50442af6c274e0fc6",
    "val.de": "660e09eb7e1da2f856ea13ee5ad3cf6d36b3d5b0b733c857e94c5747a3dfc660",
    "val.en": "1f2a23d992769b5b3d209b0a10dd0b77c08cceb1f20dfb97ed0aafa49d107227",
    "test.de": "4be6b5b3236b79c25475c6bb829800a7ce559e9ba7a1f6c2394fe4d40be46d16",
    "test.en": "399a4382932c1aadd3ceb9bef1008d388a64c76d4ae4e9d4728c6f4301cac182",
}


class DataError(Exception):
    """A missing or corrupt file; the message names it and says how to get it."""


def url_of(name):
    split, lang = name.split(".")
    return URL.format(upstream=UPSTREAM[split], lang=lang)


def check_file(folder, name):
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        raise DataError(f"{path} is missing: `python -m probattn_tools.data.multi30k download --dir {folder}` fetches it")
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if digest != SHA256[name]:
        raise DataError(f"{path} has sha256 {digest}, expected {SHA256[name]}: not the canonical file "
                        f"(fetch it again with `python -m probattn_tools.data.multi30k download --dir {folder}`)")


def download(folder):
    os.makedirs(folder, exist_ok=True)
    for name in SHA256:
        try:
            check_file(folder, name)
            continue  # already there and intact
        except DataError:
            pass
        url = url_of(name)
        print(f"downloading {url}")
        try:
            with urllib.request.urlopen(url, timeout=60) as response:
                data = gzip.decompress(response.read())
        except (OSError, EOFError) as e:
            raise DataError(f"could not fetch {url}: {e}") from e
        digest = hashlib.sha256(data).hexdigest()
        if digest != SHA256[name]:
            raise DataError(f"{url} gunzipped to sha256 {digest}, expected {SHA256[name]}: upstream changed; "
                            "these checksums describe multi30k/dataset at commit a3d2e0d2")
        path = os.path.join(folder, name)
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.replace(path + ".tmp", path)
    print(f"Multi30k de-en: all {len(SHA256)} files intact in {folder}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("download")
    p.add_argument("--dir", default=os.path.join(os.environ.get("PROBATTN_DATA") or "data", "multi30k"))
    p = sub.add_parser("verify")
    p.add_argument("--dir", required=True)
    args = parser.parse_args()
    try:
        if args.command == "download":
            download(args.dir)
        else:
            for name in SHA256:
                check_file(args.dir, name)
            print(f"Multi30k de-en: all {len(SHA256)} files intact in {args.dir}")
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
