"""Two properties of a Sort-of-CLEVR folder that bound what any head on our object boxes can reach
(results/vqa/sort-of-clevr-objects-e24/README.md quotes them):

1. How often a relational answer changes when every object's centre is redrawn with Gaussian
   noise of standard deviation sigma per axis (a detector that localises with that error).
2. How many images have two objects centred in one cell of the label grid (the detectors' boxes
   are those cells, so the two share a box), and the share of test questions per type that ask
   about, or are answered by, such an object (count: any object of the image).

    python -m probattn_tools.diagnostics.sort_of_clevr_bounds data/vqa/sort-of-clevr [--sigma 0.77 1.45 1.78] [--draws 10]

The objects are regenerated from meta.json's generator settings with python/probattn_tools/data/vqa.py's own
functions (the script checks them against the stored labels), since the data file keeps only one
object per cell.
"""

import argparse
import json
import os

import numpy as np
from safetensors.numpy import load_file

from probattn_tools.data import vqa as V


def regenerate(gen, n):
    """Every image's (centres, shapes), drawing from the generator's stream in its order."""
    if gen.get("source") != "python/probattn_tools/data/vqa.py sort-of-clevr":
        raise SystemExit(f"error: not a Sort-of-CLEVR folder written by python/probattn_tools/data/vqa.py: {gen}")
    rng = np.random.default_rng(gen["seed"])
    per_kind = gen["questions_per_image"] // 2
    objects = []
    for _ in range(n):
        centres = V.place_objects(rng, gen["size"], gen["half_width"], len(V.COLORS))
        shapes = rng.integers(0, 2, len(V.COLORS))
        objects.append((centres, shapes))
        for relational in (False, True):
            kinds = [t for t in V.TYPES if (t in V.RELATIONAL) == relational]
            for _ in range(per_kind):
                rng.integers(len(kinds)), rng.integers(len(V.COLORS))
    return objects


def target(kind, k, centres):
    d = ((centres - centres[k]) ** 2).sum(1).astype(float)
    d[k] = np.inf if kind == "closest" else -np.inf
    return int(d.argmin() if kind == "closest" else d.argmax())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", help="a folder written by python/probattn_tools/data/vqa.py sort-of-clevr")
    p.add_argument("--sigma", type=float, nargs="+", default=[0.77, 1.45, 1.78], help="per-axis centre noise in pixels")
    p.add_argument("--draws", type=int, default=10, help="noise draws per question")
    args = p.parse_args()
    for name in ("data.safetensors", "meta.json"):
        if not os.path.isfile(os.path.join(args.data, name)):
            raise SystemExit(f"error: {os.path.join(args.data, name)} does not exist (write the data with python/probattn_tools/data/vqa.py sort-of-clevr)")
    d = load_file(os.path.join(args.data, "data.safetensors"))
    meta = json.load(open(os.path.join(args.data, "meta.json")))
    gen, types, vocab, colors = meta["generator"], meta["types"], meta["vocab"], meta["colors"]
    size, grid = gen["size"], gen["grid"]
    objects = regenerate(gen, d["images"].shape[0])
    for i in range(0, len(objects), 97):
        if not (V.aux_labels(*objects[i], size, grid)[0] == d["aux_color"][i]).all():
            raise SystemExit(f"error: regenerated objects of image {i} differ from the stored labels")

    def cell(c):
        return min(c[1] * grid // size, grid - 1), min(c[0] * grid // size, grid - 1)

    shared_images = sum(len({cell(c) for c in cs}) < len(cs) for cs, _ in objects)
    print(f"images with two objects centred in one {size / grid:.3g}-pixel cell: {shared_images} of {len(objects)}")
    rng = np.random.default_rng(0)
    for kind in types:
        idx = np.where(d["test_type"] == types.index(kind))[0]
        touched, changed = 0, {s: 0 for s in args.sigma}
        for q in idx:
            centres, shapes = objects[d["test_image"][q]]
            k = next(colors.index(vocab[t]) for t in d["test_tokens"][q] if vocab[t] in colors)
            cells = [cell(c) for c in centres]
            shared = {j for j in range(len(cells)) if cells.count(cells[j]) > 1}
            involved = set(range(len(cells))) if kind == "count" else {k}
            if kind in ("closest", "furthest"):
                involved.add(target(kind, k, centres))
                answer = shapes[target(kind, k, centres)]
                for s in args.sigma:
                    for _ in range(args.draws):
                        changed[s] += shapes[target(kind, k, centres + rng.normal(0, s, centres.shape))] != answer
            touched += bool(involved & shared)
        line = f"{kind:10s} n={len(idx):5d}  object in a shared cell: {100 * touched / len(idx):5.2f}%"
        if kind in ("closest", "furthest"):
            line += "  answer changed by centre noise: " + ", ".join(f"σ={s}: {100 * changed[s] / (len(idx) * args.draws):.2f}%" for s in args.sigma)
        print(line)


if __name__ == "__main__":
    main()
