"""Three small region-feature "detectors" for `probattn vqa`, trained here and saved as TorchScript.

  python -m probattn_tools.data.vqa_detectors --data DATA_DIR --out DETECTOR_DIR [--epochs 8] [--boxes K] [--seed 0]

The DNAS paper's multi-view model (Ding et al. 2020, Appendix B) fuses the box features of three
object detectors. We cannot ship VQA-v2's detectors, so each view here is a different small CNN
backbone trained, in PyTorch, on auxiliary labels of the *training* images only (never the
answers; python/probattn_tools/data/vqa.py writes the labels):

  grid    four 3x3 stride-2 convolutions: a (H/16)^2 grid of regions    labels: colour, centre
          (--grid-stride 8: the last at stride 1, an (H/8)^2 grid, for finer label grids)
  wide    5x5 stride 3, then two 3x3 stride 2: a coarser, wider grid     labels: shape, centre
  patch   non-overlapping patches (one per label cell), then 1x1 convs  labels: colour, shape, centre

Every backbone sees the image in [0, 1] with two coordinate channels appended (CoordConv), so its
region features can carry position. When the data's meta.json asks for `"detector_context":
"global"` (easy-VQA: its questions ask about the one shape's form, which no cell of a 64 x 64 image
shows on its own), each backbone mixes every region with the mean over all regions before its
output. The label heads read the regions pooled to the label grid
and are not exported.

`--boxes K` makes each detector an object detector, as the paper's views are (bottom-up attention
keeps a fixed number of boxes per image): an objectness head on the label-grid cells, trained on
whether an object's centre lies in the cell, picks the K most object-like cells, and the detector
returns their pooled features in order of objectness. Sort-of-CLEVR places 6 objects per image, so
K = 6 gives one box per object (an image whose two centres share a cell gets one background box).
A head that compares objects with each other learns from such boxes what it does not learn from the
25 cells of a grid (results/vqa/sort-of-clevr-L0/diagnostics).

With global context (easy-VQA, one shape per image), each detector that learns shape also learns the
image's shape class (the class its covered cells carry) from the mean over all regions, so that
what a glimpse spread over the image reads says the shape's form, which no single cell shows.

Each exported detector is traced with `torch.jit.trace` on the CPU and saved as
`<name>.pt`: input (B, 3, H, W) float32 in [0, 1], output (B, regions, dim) float32. PyTorch 2.11
warns that TorchScript is deprecated (in favour of torch.export, which libtorch and tch cannot
load); the warning is filtered here on purpose. `detectors.json` lists the files, shapes, label
accuracies on the validation images, and the training settings.
"""

import argparse
import hashlib
import json
import os
import tempfile
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file


class Backbone(nn.Module):
    """A CNN over the image plus coordinate channels, returning (B, regions, dim). With `context`,
    each region's features are mixed with the mean over all regions (a 1x1 convolution of both,
    then ReLU), so that a region can carry what only the whole image shows."""

    def __init__(self, layers, dim, size, context=False):
        super().__init__()
        self.body = nn.Sequential(*layers)
        self.context = context
        # The x and y coordinate channels, (1, 2, size, size), as a buffer rather than made in
        # forward: the tracer records `linspace(device=images.device)` with the device it was
        # traced on as a constant, and such a module fails on CUDA; a buffer moves with the module.
        line = torch.linspace(-1.0, 1.0, size)
        self.register_buffer("coords", torch.stack([line.view(1, size).expand(size, size), line.view(size, 1).expand(size, size)])[None].contiguous(), persistent=False)
        if context:
            self.mix = nn.Conv2d(2 * dim, dim, 1)

    def feature_map(self, images):
        """(B, dim, h', w'): the regions on their grid."""
        b, _, h, w = images.shape
        xs, ys = self.coords[:, :1], self.coords[:, 1:]
        if (h, w) != tuple(self.coords.shape[2:]):
            ys = torch.linspace(-1.0, 1.0, h, device=images.device).view(1, 1, h, 1).expand(1, 1, h, w)
            xs = torch.linspace(-1.0, 1.0, w, device=images.device).view(1, 1, 1, w).expand(1, 1, h, w)
        xs, ys = xs.expand(b, 1, h, w), ys.expand(b, 1, h, w)
        x = self.body(torch.cat([images, xs, ys], 1))  # (B, dim, h', w')
        if self.context:
            x = F.relu(self.mix(torch.cat([x, x.mean((2, 3), keepdim=True).expand_as(x)], 1)))
        return x

    def forward(self, images):
        return self.feature_map(images).flatten(2).transpose(1, 2)  # (B, regions, dim)


def portable(path):
    """The data folder as the manifest records it: relative to the working directory (the
    checkout, when probattn runs this) where it lies inside it, else absolute."""
    full = os.path.abspath(path)
    relative = os.path.relpath(full)
    return full if relative.startswith("..") else relative


def conv(cin, cout, k, s, p):
    return [nn.Conv2d(cin, cout, k, s, p), nn.BatchNorm2d(cout), nn.ReLU()]


def backbone(name, size, grid, dim, context=False, grid_stride=16):
    if name == "grid":
        # Four stride-2 convolutions: a ceil(H/16) map (5 x 5 on Sort-of-CLEVR's 75 pixels). With
        # `--grid-stride 8` the last keeps stride 1 (a ceil(H/8) map), for a label grid finer than
        # H/16, which pool() would otherwise up-sample (two label cells reading one region).
        last = 2 if grid_stride == 16 else 1
        return Backbone(conv(5, 32, 3, 2, 1) + conv(32, 64, 3, 2, 1) + conv(64, 64, 3, 2, 1) + conv(64, dim, 3, last, 1), dim, size, context)
    if name == "wide":
        return Backbone(conv(5, 48, 5, 3, 2) + conv(48, 64, 3, 2, 1) + [nn.Conv2d(64, dim, 3, 2, 1), nn.ReLU()], dim, size, context)
    if name == "patch":
        # One patch per label cell. When the grid does not divide the image (75 pixels, --grid 7),
        # patches of ceil(size / grid) pixels over the zero-padded image cover all of it, each at
        # most a pixel off its cell; floor-sized patches would leave the last pixels unseen and
        # drift up to 5 pixels from the cells. A dividing grid keeps the network it always had.
        patch = -(-size // grid)
        pad = (patch * grid - size + 1) // 2
        return Backbone(conv(5, 64, patch, patch, pad) + conv(64, 64, 1, 1, 0) + [nn.Conv2d(64, dim, 1), nn.ReLU()], dim, size, context)
    raise ValueError(name)


TASKS = {"grid": ("color", "center"), "wide": ("shape", "center"), "patch": ("color", "shape", "center")}


def pool(fmap, grid):
    """A (B, dim, h', w') feature map averaged to the (B, grid*grid, dim) label grid."""
    return F.adaptive_avg_pool2d(fmap, grid).flatten(2).transpose(1, 2)


class Objects(nn.Module):
    """The exported object detector: the backbone's regions pooled to the label grid, and the K
    cells of highest objectness, (B, K, dim), most object-like first."""

    def __init__(self, backbone, objectness, grid, boxes):
        super().__init__()
        self.backbone, self.objectness, self.grid, self.boxes = backbone, objectness, grid, boxes

    def forward(self, images):
        pooled = pool(self.backbone.feature_map(images), self.grid)  # (B, G*G, dim)
        top = self.objectness(pooled).squeeze(2).topk(self.boxes, 1).indices  # (B, K)
        return pooled.gather(1, top.unsqueeze(2).expand(-1, -1, pooled.shape[2]))


class Labelled(nn.Module):
    """A backbone with its label heads (and, for object detectors, an objectness head) on the
    regions pooled to the label grid."""

    def __init__(self, name, size, grid, dim, colors, shapes, context=False, boxes=0, image_shape=False, grid_stride=16):
        super().__init__()
        extra = (("objectness",) if boxes else ()) + (("image_shape",) if image_shape and "shape" in TASKS[name] else ())
        self.backbone, self.grid, self.tasks = backbone(name, size, grid, dim, context, grid_stride), grid, TASKS[name] + extra
        self.heads = nn.ModuleDict({"color": nn.Linear(dim, colors), "shape": nn.Linear(dim, shapes), "center": nn.Linear(dim, 2),
                                    "objectness": nn.Linear(dim, 1), "image_shape": nn.Linear(dim, shapes)})
        self.boxes = boxes

    def forward(self, images):
        pooled = pool(self.backbone.feature_map(images), self.grid)  # (B, G*G, dim)
        out = {t: self.heads[t](pooled) for t in self.tasks if t != "image_shape"}
        if "image_shape" in self.tasks:  # the mean over every region: what a glimpse spread over the image reads
            out["image_shape"] = self.heads["image_shape"](pooled.mean(1))
        return out

    def exported(self):
        """What the views are: the backbone's regions, or its K most object-like cells."""
        return Objects(self.backbone, self.heads["objectness"], self.grid, self.boxes) if self.boxes else self.backbone


def losses(out, batch):
    color, shape, center = batch
    total, stats = 0.0, {}
    occupied = color.flatten(1) > 0  # (B, G*G)
    if "color" in out:
        total = total + F.cross_entropy(out["color"].flatten(0, 1), color.flatten())
        stats["color_acc"] = (out["color"].argmax(-1) == color.flatten(1)).float().mean().item()
    if "shape" in out:
        total = total + F.cross_entropy(out["shape"].flatten(0, 1), shape.flatten())
        stats["shape_acc"] = (out["shape"].argmax(-1) == shape.flatten(1)).float().mean().item()
    if "image_shape" in out:  # the image's one shape: every covered cell carries the same class
        label = shape.flatten(1).max(1).values
        total = total + F.cross_entropy(out["image_shape"], label)
        stats["image_shape_acc"] = (out["image_shape"].argmax(-1) == label).float().mean().item()
    if "objectness" in out:
        logit = out["objectness"].squeeze(2)
        total = total + F.binary_cross_entropy_with_logits(logit, occupied.float())
        stats["objectness_acc"] = ((logit > 0) == occupied).float().mean().item()
    if "center" in out and occupied.any():
        err = (out["center"] - center.flatten(1, 2))[occupied]
        total = total + 10.0 * err.pow(2).mean()
        stats["center_err"] = err.norm(dim=-1).mean().item()
    return total, stats


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="folder written by python/probattn_tools/data/vqa.py")
    p.add_argument("--out", required=True, help="output folder for <name>.pt and detectors.json")
    p.add_argument("--epochs", type=int, default=8, help="training epochs per detector (default 8)")
    p.add_argument("--dim", type=int, default=64, help="region feature size (default 64)")
    p.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--boxes", type=int, default=0,
                   help="object detectors: return the K most object-like label-grid cells per image instead of every region (0: every region)")
    p.add_argument("--grid-stride", type=int, choices=(16, 8), default=16,
                   help="the grid backbone's output stride (default 16; 8 for a label grid finer than H/16, "
                        "e.g. Sort-of-CLEVR written with --grid 7, whose 5 x 5 map would be up-sampled to 7 x 7)")
    p.add_argument("--max-images", type=int, default=0, help="train on at most this many images (0: all)")
    return p.parse_args()


def train_detector(args, index, name, data, labels, context, train, val, tmp):
    """Trains detector `name` on the images in the range `train`, scores it on those in `val` and
    traces it to tmp/<name>.pt; returns its manifest entry."""
    images = data["images"]
    size, grid = images.shape[-1], data["aux_color"].shape[-1]
    colors, shapes = int(data["aux_color"].max()) + 1, int(data["aux_shape"].max()) + 1
    (t0, t1), (v0, v1) = train, val
    torch.manual_seed(args.seed * 100 + index)
    model = Labelled(name, size, grid, args.dim, colors, shapes, context, args.boxes, image_shape=context, grid_stride=args.grid_stride)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    start = time.time()
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(t1 - t0) + t0
        for i in range(0, len(order), args.batch):
            idx = order[i : i + args.batch]
            loss, _ = losses(model(images[idx].float() / 255.0), [l[idx] for l in labels])
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        idx = torch.arange(v0, v1)
        out = model(images[idx].float() / 255.0)
        _, stats = losses(out, [l[idx] for l in labels])
        if args.boxes:  # share of the objects whose cell is among the K boxes
            occupied = labels[0][idx].flatten(1) > 0
            top = out["objectness"].squeeze(2).topk(args.boxes, 1).indices
            stats["object_recall"] = (occupied.gather(1, top).sum() / occupied.sum()).item()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.jit.trace is deprecated": TorchScript is what tch loads
        traced = torch.jit.trace(model.exported(), images[:2].float() / 255.0)
        path = os.path.join(tmp, f"{name}.pt")
        traced.save(path)
    regions, dim = traced(images[:1].float() / 255.0).shape[1:]
    return {"name": name, "file": f"{name}.pt", "regions": regions, "dim": dim, "labels": list(TASKS[name]),
            "val": {k: round(v, 4) for k, v in stats.items()}, "train_seconds": round(time.time() - start, 1),
            "sha256": hashlib.sha256(open(path, "rb").read()).hexdigest()}


def main():
    args = parse_args()
    if args.boxes < 0:
        raise SystemExit(f"error: --boxes must be 0 or more, got {args.boxes}")
    if args.threads:
        torch.set_num_threads(args.threads)
    meta_path = os.path.join(args.data, "meta.json")
    if not os.path.exists(meta_path):
        raise SystemExit(f"error: {meta_path} not found; write the data with python/probattn_tools/data/vqa.py first")
    meta = json.load(open(meta_path))
    data = load_file(os.path.join(args.data, "data.safetensors"))
    images = data["images"]
    size, grid = images.shape[-1], data["aux_color"].shape[-1]
    if args.boxes > grid * grid:
        raise SystemExit(f"error: --boxes {args.boxes} is more than the {grid * grid} cells of the label grid")
    side = -(-size // 16)  # the grid backbone's map at stride 16
    if args.grid_stride == 16 and side < grid:
        print(f"note: the grid backbone's {side}-wide map is up-sampled to the {grid}-wide label grid; --grid-stride 8 avoids that", flush=True)
    (t0, t1), (v0, v1) = meta["image_ranges"]["train"], meta["image_ranges"]["val"]
    if args.max_images:
        t1 = min(t1, t0 + args.max_images)
    labels = (data["aux_color"], data["aux_shape"], data["aux_center"])
    context = meta.get("detector_context") == "global"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".detectors-", dir=os.path.dirname(os.path.abspath(args.out)))
    manifest = {"data": portable(args.data), "data_sha256": meta.get("sha256"), "seed": args.seed, "epochs": args.epochs,
                "torch": torch.__version__, "input": [None, 3, size, size], "global_context": context,
                "boxes": args.boxes or None, "image_shape": context, "grid_stride": args.grid_stride, "detectors": []}
    for index, name in enumerate(TASKS):
        entry = train_detector(args, index, name, data, labels, context, (t0, t1), (v0, v1), tmp)
        manifest["detectors"].append(entry)
        print(json.dumps(entry), flush=True)
    with open(os.path.join(tmp, "detectors.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    os.makedirs(args.out, exist_ok=True)
    for name in os.listdir(tmp):
        os.replace(os.path.join(tmp, name), os.path.join(args.out, name))
    os.rmdir(tmp)


if __name__ == "__main__":
    main()
