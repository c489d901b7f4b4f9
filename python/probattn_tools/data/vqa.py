"""VQA data for `probattn vqa`: images, questions, answers and auxiliary labels as tensors.

  sort-of-clevr  generate Sort-of-CLEVR (Santoro et al. 2017) with our seeded generator
  easy-vqa       convert easy-VQA (PyPI `easy-vqa`, installed on demand) to the same layout

Each writes a folder with
  data.safetensors  images (N, 3, H, W) uint8; for every split s in train/val/test:
                    s_image (Q,) int64 (row of `images`), s_tokens (Q, L) int64 (0 = padding),
                    s_answer (Q,) int64, s_type (Q,) int64 (index into meta.json's types);
                    aux_color, aux_shape (N, G, G) int64 and aux_center (N, G, G, 2) float32:
                    per grid cell, the object whose centre falls in it (0 = none), and that
                    centre's position in the image in [0, 1] (the detectors' training labels;
                    never the answers)
  meta.json         vocabulary, answers, question types, split image ranges, generator settings

Sort-of-CLEVR, from the paper's description (Santoro et al. 2017, Sec. 4 and Appendix): 75 x 75
images with 6 objects of distinct colours (red, green, blue, orange, gray, yellow), each a square
or a circle, placed without overlap on a white background. Per image, 10 non-relational questions
(the shape of the object of colour c; is it on the left or the right; at the top or the bottom)
and 10 relational ones (the shape of the object closest to c; of the object furthest from c; how
many objects have c's shape). The colour and the question kind are drawn uniformly. Images are
split by index: train, then val, then test; everything follows from --seed.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
from safetensors.torch import save_file

COLORS = ["red", "green", "blue", "orange", "gray", "yellow"]
RGB = np.array([[255, 0, 0], [0, 200, 0], [0, 0, 255], [255, 156, 0], [128, 128, 128], [255, 255, 0]], np.uint8)
SHAPES = ["square", "circle"]
TYPES = ["shape", "horizontal", "vertical", "closest", "furthest", "count"]
RELATIONAL = {"closest", "furthest", "count"}
ANSWERS = ["square", "circle", "left", "right", "top", "bottom", "1", "2", "3", "4", "5", "6"]
TEMPLATES = {
    "shape": "what is the shape of the {c} object",
    "horizontal": "is the {c} object on the left or the right",
    "vertical": "is the {c} object at the top or the bottom",
    "closest": "what is the shape of the object closest to the {c} object",
    "furthest": "what is the shape of the object furthest from the {c} object",
    "count": "how many objects have the same shape as the {c} object",
}


def place_objects(rng, size, half, count):
    """Centres of `count` objects of half-width `half`, at least 2 * half + 1 apart (no overlap)."""
    centres = []
    while len(centres) < count:
        c = rng.integers(half, size - half, 2)
        if all(np.abs(c - d).max() > 2 * half for d in centres):
            centres.append(c)
    return np.array(centres)


def draw(size, half, centres, shapes):
    img = np.full((size, size, 3), 255, np.uint8)
    yy, xx = np.mgrid[0:size, 0:size]
    for k, ((x, y), s) in enumerate(zip(centres, shapes)):
        if s == 0:
            img[y - half : y + half + 1, x - half : x + half + 1] = RGB[k]
        else:
            img[(xx - x) ** 2 + (yy - y) ** 2 <= half * half] = RGB[k]
    return img


def answer(kind, c, centres, shapes, size):
    if kind == "shape":
        return SHAPES[shapes[c]]
    if kind == "horizontal":
        return "left" if centres[c][0] < size / 2 else "right"
    if kind == "vertical":
        return "top" if centres[c][1] < size / 2 else "bottom"
    d = ((centres - centres[c]) ** 2).sum(1).astype(float)
    if kind == "count":
        return str(int((shapes == shapes[c]).sum()))
    d[c] = np.inf if kind == "closest" else -np.inf
    return SHAPES[shapes[int(d.argmin() if kind == "closest" else d.argmax())]]


def aux_labels(centres, shapes, size, grid):
    """Per grid cell: colour (1-6) and shape (1-2) of the object centred in it, and its centre."""
    color = np.zeros((grid, grid), np.int64)
    shape = np.zeros((grid, grid), np.int64)
    centre = np.zeros((grid, grid, 2), np.float32)
    for k, ((x, y), s) in enumerate(zip(centres, shapes)):
        gy, gx = min(y * grid // size, grid - 1), min(x * grid // size, grid - 1)
        color[gy, gx], shape[gy, gx] = k + 1, s + 1
        centre[gy, gx] = (x / size, y / size)
    return color, shape, centre


def sort_of_clevr(args):
    rng = np.random.default_rng(args.seed)
    n = args.train + args.val + args.test
    words = sorted({w for t in TEMPLATES.values() for w in t.format(c="").split()} | set(COLORS))
    vocab = ["<pad>"] + words
    index = {w: i for i, w in enumerate(vocab)}
    images = np.zeros((n, 3, args.size, args.size), np.uint8)
    grid = args.grid
    aux = {"aux_color": np.zeros((n, grid, grid), np.int64), "aux_shape": np.zeros((n, grid, grid), np.int64),
           "aux_center": np.zeros((n, grid, grid, 2), np.float32)}
    questions = []  # (image, tokens, answer, type)
    for i in range(n):
        centres = place_objects(rng, args.size, args.half, len(COLORS))
        shapes = rng.integers(0, 2, len(COLORS))
        images[i] = draw(args.size, args.half, centres, shapes).transpose(2, 0, 1)
        aux["aux_color"][i], aux["aux_shape"][i], aux["aux_center"][i] = aux_labels(centres, shapes, args.size, grid)
        for relational in (False, True):
            kinds = [t for t in TYPES if (t in RELATIONAL) == relational]
            for _ in range(args.questions_per_kind):
                kind, c = kinds[rng.integers(len(kinds))], int(rng.integers(len(COLORS)))
                text = TEMPLATES[kind].format(c=COLORS[c])
                questions.append((i, [index[w] for w in text.split()], ANSWERS.index(answer(kind, c, centres, shapes, args.size)), TYPES.index(kind)))
    splits = {"train": (0, args.train), "val": (args.train, args.train + args.val), "test": (args.train + args.val, n)}
    meta = {
        "dataset": "sort-of-clevr",
        "generator": {"seed": args.seed, "size": args.size, "half_width": args.half, "grid": grid,
                      "questions_per_image": 2 * args.questions_per_kind, "source": "python/probattn_tools/data/vqa.py sort-of-clevr"},
        "vocab": vocab, "answers": ANSWERS, "types": TYPES, "relational_types": sorted(RELATIONAL),
        "colors": COLORS, "shapes": SHAPES,
    }
    write(args.out, images, aux, questions, splits, meta)


# Fill ratio (shape pixels / bounding-box area) of easy-VQA's shapes on the training images:
# rectangles 0.965-1.0, circles 0.73-0.90, triangles 0.51-0.65 (600 images; docs/vqa.md).
EASY_VQA_SHAPES = ((0.93, 1), (0.69, 2), (0.0, 3))  # (lowest fill ratio, class): rectangle, circle, triangle


def easy_vqa_labels(images, grid, shape_labels="covered"):
    """Detector labels of easy-VQA images from their pixels alone (never the answers): per cell of a
    grid x grid partition, whether the shape covers it (more than 1/8 of its pixels differ from the
    background, the colour of the top-left pixel), the dominant colour bucket of its shape pixels
    (RGB each halved at 128: 8 buckets, 1-8; 0 = not covered) and the image's shape class (1
    rectangle, 2 circle, 3 triangle; 0 = not covered), told apart by how much of its bounding box
    the shape fills. Centres are not labelled (zeros). shape_labels "centre": the shape class only
    on the cell holding the centre of the shape's bounding box (one label per object, as
    Sort-of-CLEVR's), 0 elsewhere, instead of on every covered cell."""
    n, _, size, _ = images.shape
    cell = size // grid
    px = images.astype(np.int64)
    mask = np.abs(px - px[:, :, :1, :1]).sum(1) > 60  # (n, H, W)
    fill = np.zeros(n)
    centre_cell = np.zeros((n, 2), np.int64)
    for i in range(n):
        ys, xs = np.nonzero(mask[i])
        if len(ys):
            fill[i] = len(ys) / ((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
            centre_cell[i] = (min((ys.min() + ys.max()) // 2 // cell, grid - 1), min((xs.min() + xs.max()) // 2 // cell, grid - 1))
    shape = np.zeros(n, np.int64)
    for lowest, cls in reversed(EASY_VQA_SHAPES):
        shape[fill >= lowest] = cls
    shape[fill == 0] = 0
    m = mask[:, : cell * grid, : cell * grid].reshape(n, grid, cell, grid, cell)
    px = px[:, :, : cell * grid, : cell * grid].reshape(n, 3, grid, cell, grid, cell)
    bucket = (px[:, 0] // 128) * 4 + (px[:, 1] // 128) * 2 + px[:, 2] // 128  # (n, G, c, G, c) in 0..7
    counts = np.stack([((bucket == b) & m).sum((2, 4)) for b in range(8)], -1)  # (n, G, G, 8)
    covered = m.sum((2, 4)) > cell * cell // 8
    color = np.where(covered, counts.argmax(-1) + 1, 0)
    if shape_labels == "centre":
        shape_grid = np.zeros((n, grid, grid), np.int64)
        shape_grid[np.arange(n), centre_cell[:, 0], centre_cell[:, 1]] = shape
    else:
        shape_grid = np.where(covered, shape[:, None, None], 0)
    return {"aux_color": color.astype(np.int64), "aux_shape": shape_grid.astype(np.int64),
            "aux_center": np.zeros((n, grid, grid, 2), np.float32)}


def easy_vqa(args):
    try:
        import easy_vqa  # noqa: F401
    except ImportError:
        print("installing easy-vqa from PyPI into", sys.executable, file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "easy-vqa==1.0", "Pillow"], check=True)
    from easy_vqa import get_answers, get_test_image_paths, get_test_questions, get_train_image_paths, get_train_questions
    from PIL import Image

    rng = np.random.default_rng(args.seed)
    train_paths, test_paths = get_train_image_paths(), get_test_image_paths()
    ids = sorted(train_paths)
    rng.shuffle(ids)
    n_val = len(ids) // 10
    # Validation images are held out of easy-VQA's train split (it ships none); test is its test split.
    split_ids = {"val": sorted(ids[:n_val]), "train": sorted(ids[n_val:]), "test": sorted(test_paths)}
    order = [("train", train_paths), ("val", train_paths), ("test", test_paths)]
    rows, images = {}, []
    for split, paths in order:
        for image_id in split_ids[split]:
            rows[(split, image_id)] = len(images)
            images.append(np.asarray(Image.open(paths[image_id]).convert("RGB")).transpose(2, 0, 1))
    images = np.stack(images)
    answers = get_answers()
    train_q, test_q = get_train_questions(), get_test_questions()
    tokenize = lambda q: q.lower().replace("?", "").split()
    vocab = ["<pad>"] + sorted({w for q in train_q[0] for w in tokenize(q)})
    index = {w: i for i, w in enumerate(vocab)}
    types = ["shape", "color", "yes/no"]
    questions = []
    val_set = set(split_ids["val"])
    for split_name, (texts, ans, img_ids) in (("train", train_q), ("test", test_q)):
        for text, a, image_id in zip(texts, ans, img_ids):
            split = split_name if split_name == "test" else ("val" if image_id in val_set else "train")
            toks = [index[w] for w in tokenize(text) if w in index]
            kind = 2 if a in ("yes", "no") else (0 if a in ("circle", "rectangle", "triangle") else 1)
            questions.append((rows[(split, image_id)], toks, answers.index(a), kind, split))
    splits, ordered = {}, []
    for split in ("train", "val", "test"):
        qs = [q[:4] for q in questions if q[4] == split]
        splits[split] = len(ordered), len(ordered) + len(qs)
        ordered += qs
    aux = easy_vqa_labels(images, args.grid, args.shape_labels)
    image_splits = {s: (min(rows[(s, i)] for i in split_ids[s]), max(rows[(s, i)] for i in split_ids[s]) + 1) for s in split_ids}
    meta = {"dataset": "easy-vqa", "generator": {"seed": args.seed, "grid": args.grid, "source": "PyPI easy-vqa 1.0; val = 10% of its train images", "labels": "easy_vqa_labels",
                          "shape_labels": args.shape_labels},
            "vocab": vocab, "answers": answers, "types": types, "relational_types": [],
            # A cell sees a part of the shape, the questions ask about its whole form: the
            # detectors mix each region with the mean over all regions (python/probattn_tools/data/vqa_detectors.py).
            "detector_context": "global"}
    write(args.out, images, aux, ordered, image_splits, meta, question_splits=splits)


def write(out, images, aux, questions, image_splits, meta, question_splits=None):
    """Writes data.safetensors and meta.json into `out` atomically (temp folder, then rename)."""
    tensors = {"images": torch.from_numpy(np.ascontiguousarray(images))}
    tensors.update({k: torch.from_numpy(v) for k, v in aux.items()})
    length = max(len(q[1]) for q in questions)
    if question_splits is None:  # questions follow their images' split
        question_splits = {}
        for split, (a, b) in image_splits.items():
            idx = [j for j, q in enumerate(questions) if a <= q[0] < b]
            question_splits[split] = (idx[0], idx[-1] + 1)
    counts = {}
    for split, (a, b) in question_splits.items():
        qs = questions[a:b]
        tokens = np.zeros((len(qs), length), np.int64)
        for j, q in enumerate(qs):
            tokens[j, : len(q[1])] = q[1]
        tensors[f"{split}_image"] = torch.tensor([q[0] for q in qs], dtype=torch.int64)
        tensors[f"{split}_tokens"] = torch.from_numpy(tokens)
        tensors[f"{split}_answer"] = torch.tensor([q[2] for q in qs], dtype=torch.int64)
        tensors[f"{split}_type"] = torch.tensor([q[3] for q in qs], dtype=torch.int64)
        counts[split] = {"images": image_splits[split][1] - image_splits[split][0], "questions": len(qs)}
    meta["splits"] = counts
    meta["image_ranges"] = {s: list(r) for s, r in image_splits.items()}
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".vqa-data-", dir=parent)
    save_file(tensors, os.path.join(tmp, "data.safetensors"))
    with open(os.path.join(tmp, "data.safetensors"), "rb") as f:
        meta["sha256"] = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    if os.path.isdir(out):
        for name in ("data.safetensors", "meta.json"):
            if os.path.exists(os.path.join(out, name)):
                os.remove(os.path.join(out, name))
        for name in ("data.safetensors", "meta.json"):
            os.replace(os.path.join(tmp, name), os.path.join(out, name))
        os.rmdir(tmp)
    else:
        os.replace(tmp, out)
    print(json.dumps({"out": out, "splits": counts, "sha256": meta["sha256"]}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sort-of-clevr", help="generate Sort-of-CLEVR")
    s.add_argument("--out", required=True, help="output folder")
    s.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    s.add_argument("--train", type=int, default=9000, help="training images (default 9000; the RN paper used 9,800)")
    s.add_argument("--val", type=int, default=500, help="validation images (default 500)")
    s.add_argument("--test", type=int, default=500, help="test images (default 500)")
    s.add_argument("--questions-per-kind", type=int, default=10, help="relational and non-relational questions per image, each (default 10)")
    s.add_argument("--size", type=int, default=75, help="image side in pixels (default 75)")
    s.add_argument("--half", type=int, default=5, help="object half-width in pixels (default 5)")
    s.add_argument("--grid", type=int, default=5, help="auxiliary label grid side (default 5)")
    e = sub.add_parser("easy-vqa", help="convert easy-VQA")
    e.add_argument("--out", required=True, help="output folder")
    e.add_argument("--seed", type=int, default=0, help="seed of the validation hold-out (default 0)")
    e.add_argument("--grid", type=int, default=8, help="auxiliary label grid side (default 8)")
    e.add_argument("--shape-labels", choices=["covered", "centre"], default="covered",
                   help="the shape class on every covered cell (default) or only on the cell at the centre of the shape")
    args = p.parse_args()
    for name in ("train", "val", "test"):
        if getattr(args, name, 1) < 1:
            p.error(f"--{name} must be at least 1")
    sort_of_clevr(args) if args.cmd == "sort-of-clevr" else easy_vqa(args)


if __name__ == "__main__":
    main()
