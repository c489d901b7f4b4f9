"""Planetoid citation graphs (Cora, Citeseer, Pubmed): verify, download, convert.

  convert   read the canonical ind.<name>.* files, check their checksums, and write one
            safetensors file for `probattn gat` (features, labels, edges, split); with
            --unverified, files that are not the canonical ones too (a graph of your own)
  synth     write a small random graph in the same file format (for tests and examples)
  download  fetch the canonical files (kimiyoung/planetoid on GitHub) and verify them
  verify    check the files in a folder against the known checksums

The files are Python 2 pickles of scipy CSR matrices, numpy arrays and a dict of lists
(kimiyoung/planetoid's data/ folder). They are read with a restricted unpickler that accepts only those
globals, so scipy is not needed and nothing else in a file can run.

Processing follows the GCN/GAT loaders (tkipf/gcn, PetarV-/GAT): features = vstack(allx, tx) and
labels = vstack(ally, ty), test rows reordered to test.index; Citeseer's isolated test nodes are
padded with zero rows; features are row-normalized; the graph is symmetrized, de-duplicated, and
every node gets a self-loop (GAT's adj + I). Split: train = the labelled x rows, val = the next
500 nodes, test = test.index.
"""

import argparse
import collections
import hashlib
import io
import os
import pickle
import sys
import urllib.request

import numpy as np
import torch
from safetensors.torch import save_file

PARTS = ["x", "y", "tx", "ty", "allx", "ally", "graph", "test.index"]
URL = "https://github.com/kimiyoung/planetoid/raw/master/data/ind.{name}.{part}"
# sha256 of the canonical files (kimiyoung/planetoid's data/ folder); for ind.pubmed.allx only its git blob
# id is known: the upstream repository's id for the file.
SHA256 = {
    "cora": {
        "x": "23cfa55d91c6f624233f5eb7b6e3f141f1bd2b2ae39608a63cf5d084bb27baab",
        "y": "94465c14eb53e04ca262198dcbb2521ee8af60fb3f3d546cd6ca24a511b0e7d1",
        "tx": "b9afbaa4a400df991f6f02ef677e1e44da55ffc04801fd02f9e673987829226a",
        "ty": "41f5ac76596a1699cc33f53084a2419e92961c42bb75f36fc38e616d348532ad",
        "allx": "9419ba2f26f5c35243db64aba110e0f35a04851609e0dc5433450676ca6b8543",
        "ally": "2b998f5cc7fedc86e7f97ca2498f47a1ffc1462c29e2d578b23bf3f62b6e7d71",
        "graph": "58f13302f39dde8852dad6fe6d15b89b077b6d7f837626bce671ef80344b383d",
        "test.index": "297ce89af2b51a6a194181c7dbe1796c6a1cf9cd9349a88383b1b1e227867875",
    },
    "citeseer": {
        "x": "d20de19150741e555de0ed037195630fc194114ebc7fd72ced62810148aa22f6",
        "y": "8ba87e515d8e3ee3cf52f6d2c5b86aa73f11ecad825a808455209ec26cd54924",
        "tx": "539a8906a2da97628d212f2fdd668c109a8b3f0d36574b59e5d3fd5b5303da21",
        "ty": "55e5bd1ba1e733a04598753ad1a8d57957f4b8f89e74519f41f4f4938767e4ce",
        "allx": "2ac30345d95c9ec933a817ee0bdd6a5f077f8c184a20e696910192d534414668",
        "ally": "f704b2d986dde6c2669934de1f3ae5696a6cf9455c0f6b2646a2d135ea0a1c95",
        "graph": "d79a4ef9d3e7169aee8946145f6b7306e35bc79bffad26346cfb94e10e9912a7",
        "test.index": "2af990671580b6b2df5d158d1038f8292e30c9cd821b5453f399659b25b723d4",
    },
    "pubmed": {
        "x": "fbe9cb5c47200d1b7769a26e579be3b7130b556831f9d850e77c4c74f2599b33",
        "y": "e6c807633307a07ed659249006536a147c7999c797f11a2560752990181b41b3",
        "tx": "4eb5f5d0f30f26497eb0ac6ac9719d09c67e284f1ed0385c93f3ef27a671da3d",
        "ty": "ee2e0d4819d9fbcc403689c3bf2e49face401b605932f093bc58ab6461130fdd",
        "ally": "0c37bbe3b5014ec365e9d393cf4791925e5ed94fb194305d74f064a8d7b50f0e",
        "graph": "5b89f0036ca22909471f1e6558eb42fa06e0c730a577bde5b058b40638f81dc9",
        "test.index": "b101d421688bbaecbd82e8a18f1e282378d6830f3a37666f28ebc47f844341b5",
    },
}
GIT_BLOB = {("pubmed", "allx"): "3b86bccf08111c37c632a9dd8ab63db25ea76361"}


class DataError(Exception):
    """A missing or corrupt data file; the message names it and says how to get it."""


def how_to_get(name, part):
    url = URL.format(name=name, part=part)
    return (f"download it with `python -m probattn_tools.data.planetoid download --dir DIR --names {name}` "
            f"or by hand from {url}")


def check_file(folder, name, part, verify=True):
    path = os.path.join(folder, f"ind.{name}.{part}")
    if not os.path.isfile(path):
        hint = ""
        if name == "pubmed" and part == "allx":
            hint = (" (this copy of Pubmed is incomplete; after downloading, check it with "
                    f"`git hash-object ind.pubmed.allx` = {GIT_BLOB[('pubmed', 'allx')]})")
        raise DataError(f"{path} is missing: {how_to_get(name, part)}{hint}")
    data = open(path, "rb").read()
    if not verify:
        return data
    if (name, part) in GIT_BLOB:
        got = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        expected = GIT_BLOB[(name, part)]
    else:
        got, expected = hashlib.sha256(data).hexdigest(), SHA256[name][part]
    if got != expected:
        raise DataError(f"{path} is corrupt or not the canonical file (checksum {got}, expected {expected}): "
                        f"{how_to_get(name, part)}")
    return data


class _Csr:
    """Stands in for scipy.sparse.csr_matrix: keeps the pickled state."""

    def __setstate__(self, state):
        self.__dict__.update(state)

    def toarray(self):
        rows, cols = self._shape
        dense = np.zeros((rows, cols), dtype=np.float32)
        for r in range(rows):
            start, end = self.indptr[r], self.indptr[r + 1]
            dense[r, self.indices[start:end]] = self.data[start:end]
        return dense


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module.startswith("scipy.sparse") and name == "csr_matrix":
            return _Csr
        if module in ("numpy.core.multiarray", "numpy._core.multiarray") and name == "_reconstruct":
            return np.ndarray.__reduce__(np.zeros(0))[0]
        if module == "numpy" and name in ("ndarray", "dtype"):
            return getattr(np, name)
        if module == "collections" and name == "defaultdict":
            return collections.defaultdict
        if module in ("__builtin__", "builtins") and name == "list":
            return list
        raise pickle.UnpicklingError(f"unexpected global {module}.{name}")


def load_part(folder, name, part, verify=True):
    data = check_file(folder, name, part, verify)
    if part == "test.index":
        return np.array([int(line) for line in data.decode().split()], dtype=np.int64)
    try:
        obj = _Unpickler(io.BytesIO(data), encoding="latin1").load()
    except Exception as e:  # noqa: BLE001 - any unpickling failure means an unusable file
        raise DataError(f"{folder}/ind.{name}.{part} could not be read ({e}): {how_to_get(name, part)}")
    return obj.toarray() if isinstance(obj, _Csr) else obj


def convert(folder, name, out, verify=True):
    x, y, tx, ty, allx, ally, graph, test_index = (load_part(folder, name, p, verify) for p in PARTS)
    test_sorted = np.sort(test_index)
    if name == "citeseer":
        # Isolated nodes in the test range have no rows in tx/ty: pad them with zeros.
        full = np.arange(test_sorted.min(), test_sorted.max() + 1)
        tx_ext = np.zeros((len(full), tx.shape[1]), dtype=np.float32)
        tx_ext[test_sorted - test_sorted.min()] = tx
        ty_ext = np.zeros((len(full), ty.shape[1]), dtype=ty.dtype)
        ty_ext[test_sorted - test_sorted.min()] = ty
        tx, ty = tx_ext, ty_ext
    features = np.vstack([allx, tx]).astype(np.float32)
    labels = np.vstack([ally, ty])
    features[test_index] = features[test_sorted]
    labels[test_index] = labels[test_sorted]
    rowsum = features.sum(1, keepdims=True)
    features = np.divide(features, rowsum, out=np.zeros_like(features), where=rowsum != 0)
    n = features.shape[0]
    pairs = {(int(u), int(v)) for u, vs in graph.items() for v in vs}
    pairs |= {(v, u) for u, v in pairs}
    pairs |= {(i, i) for i in range(n)}
    edges = np.array(sorted(pairs), dtype=np.int64)  # rows (dst, src)
    if edges.max() >= n:
        raise DataError(f"{folder}/ind.{name}.graph names node {edges.max()} but there are {n} nodes")
    tensors = {
        "features": torch.from_numpy(features),
        "labels": torch.from_numpy(labels.argmax(1).astype(np.int64)),
        "labelled": torch.from_numpy(labels.sum(1) > 0),
        "edge_dst": torch.from_numpy(edges[:, 0].copy()),
        "edge_src": torch.from_numpy(edges[:, 1].copy()),
        "train_idx": torch.arange(len(y), dtype=torch.int64),
        "val_idx": torch.arange(len(y), len(y) + 500, dtype=torch.int64),
        "test_idx": torch.from_numpy(test_sorted),
    }
    tmp = out + ".tmp"
    save_file(tensors, tmp, metadata={"dataset": name})
    os.replace(tmp, out)


def _csr_pickle(dense):
    """A dense matrix pickled as a scipy CSR matrix is (the global scipy.sparse.csr.csr_matrix,
    its state a dict), written without scipy: the global by hand, then the state as pickle writes
    it. Protocol 3, whose raw bytes need no helper global (upstream's protocol 2 files are
    Python 2's, whose strings are the bytes)."""
    rows, cols = np.nonzero(dense)
    indptr = np.searchsorted(rows, np.arange(dense.shape[0] + 1)).astype(np.int32)
    state = {"_shape": dense.shape, "indptr": indptr, "indices": cols.astype(np.int32),
             "data": dense[rows, cols].astype(np.float32), "maxprint": 50, "format": "csr"}
    body = pickle.dumps(state, protocol=3)
    # PROTO 3, GLOBAL, EMPTY_TUPLE, NEWOBJ; the state without its PROTO and STOP; BUILD, STOP.
    return b"\x80\x03cscipy.sparse.csr\ncsr_matrix\n)\x81" + body[2:-1] + b"b."


def synth(folder, name, nodes, features, classes, labelled, test, seed):
    """A random graph of `nodes` nodes in Planetoid's file format under the name `name`: `labelled`
    training rows (x, y), every non-test row in allx/ally, the last `test` nodes as tx/ty with a
    shuffled test.index, and a graph whose neighbours are mostly of the same class."""
    if nodes < labelled + 500 + test:
        raise DataError(f"synth: {nodes} nodes cannot hold {labelled} train, 500 validation and {test} test nodes")
    rng = np.random.default_rng(seed)
    label = rng.integers(0, classes, nodes)
    onehot = np.eye(classes, dtype=np.int32)[label]
    # Bag-of-words features: a few words per node, most from its class's share of the vocabulary.
    x = np.zeros((nodes, features), dtype=np.float32)
    share = features // classes
    for i in range(nodes):
        own = label[i] * share + rng.integers(0, share, 4)
        x[i, own] = 1.0
        x[i, rng.integers(0, features, 2)] = 1.0
    graph = collections.defaultdict(list)
    for i in range(nodes):
        same = np.flatnonzero(label == label[i])
        for j in list(rng.choice(same, 2)) + [int(rng.integers(0, nodes))]:
            if j != i:
                graph[i].append(int(j))
    first_test = nodes - test
    order = rng.permutation(test) + first_test  # test.index lists the test nodes in any order
    parts = {
        "x": _csr_pickle(x[:labelled]),
        "y": pickle.dumps(onehot[:labelled], protocol=3),
        "allx": _csr_pickle(x[:first_test]),
        "ally": pickle.dumps(onehot[:first_test], protocol=3),
        "tx": _csr_pickle(x[np.sort(order)]),
        "ty": pickle.dumps(onehot[np.sort(order)], protocol=3),
        "graph": pickle.dumps(graph, protocol=3),
        "test.index": "".join(f"{i}\n" for i in order).encode(),
    }
    os.makedirs(folder, exist_ok=True)
    for part, data in parts.items():
        path = os.path.join(folder, f"ind.{name}.{part}")
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.replace(path + ".tmp", path)


def download(folder, names):
    os.makedirs(folder, exist_ok=True)
    for name in names:
        for part in PARTS:
            path = os.path.join(folder, f"ind.{name}.{part}")
            try:
                check_file(folder, name, part)
                continue  # already there and intact
            except DataError:
                pass
            url = URL.format(name=name, part=part)
            print(f"downloading {url}")
            try:
                with urllib.request.urlopen(url, timeout=60) as response:
                    data = response.read()
            except OSError as e:  # URLError and socket timeouts are OSErrors
                raise DataError(f"could not fetch {url}: {e}") from e
            with open(path + ".tmp", "wb") as f:
                f.write(data)
            os.replace(path + ".tmp", path)
            check_file(folder, name, part)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("convert")
    p.add_argument("--dir", required=True, help="folder with the ind.<name>.* files")
    p.add_argument("--name", required=True, choices=sorted(SHA256))
    p.add_argument("--out", required=True, help="safetensors file to write")
    p.add_argument("--unverified", action="store_true",
                   help="read files whose checksums are not the canonical ones (a graph of your own)")
    p = sub.add_parser("synth")
    p.add_argument("--dir", required=True)
    p.add_argument("--name", required=True, choices=sorted(SHA256), help="the file names to write (ind.NAME.*)")
    p.add_argument("--nodes", type=int, default=700)
    p.add_argument("--features", type=int, default=60)
    p.add_argument("--classes", type=int, default=3)
    p.add_argument("--labelled", type=int, default=30)
    p.add_argument("--test", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("download")
    p.add_argument("--dir", default=os.path.join(os.environ.get("PROBATTN_DATA") or "data", "planetoid"))
    p.add_argument("--names", nargs="+", default=sorted(SHA256), choices=sorted(SHA256))
    p = sub.add_parser("verify")
    p.add_argument("--dir", required=True)
    p.add_argument("--names", nargs="+", default=sorted(SHA256), choices=sorted(SHA256))
    args = parser.parse_args()
    try:
        if args.command == "convert":
            convert(args.dir, args.name, args.out, verify=not args.unverified)
        elif args.command == "synth":
            synth(args.dir, args.name, args.nodes, args.features, args.classes, args.labelled, args.test, args.seed)
        elif args.command == "download":
            download(args.dir, args.names)
        else:
            for name in args.names:
                for part in PARTS:
                    check_file(args.dir, name, part)
                print(f"{name}: all {len(PARTS)} files intact")
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
