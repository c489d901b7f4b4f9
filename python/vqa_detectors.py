"""Three small region-feature "detectors" for `probattn vqa`, trained here and saved as TorchScript.

  python python/vqa_detectors.py --data DATA_DIR --out DETECTOR_DIR [--epochs 4] [--seed 0]

The DNAS paper's multi-view model (Ding et al. 2020, Appendix B) fuses the box features of three
object detectors. We cannot ship VQA-v2's detectors, so each view here is a different small CNN
backbone trained, in PyTorch, on auxiliary labels of the *training* images only (never the
answers; python/vqa_data.py writes the labels):

  grid    four 3x3 stride-2 convolutions: a (H/16)^2 grid of regions    labels: colour, centre
  wide    5x5 stride 3, then two 3x3 stride 2: a coarser, wider grid     labels: shape, centre
  patch   non-overlapping patches (one per label cell), then 1x1 convs  labels: colour, shape, centre

Every backbone sees the image in [0, 1] with two coordinate channels appended (CoordConv), so its
region features can carry position. When the data's meta.json asks for `"detector_context":
"global"` (easy-VQA: its questions ask about the one shape's form, which no cell of a 64 x 64 image
shows on its own), each backbone mixes every region with the mean over all regions before its
output. The label heads read the regions pooled to the label grid
and are not exported. Each backbone is traced with `torch.jit.trace` on the CPU and saved as
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

    def __init__(self, layers, dim, context=False):
        super().__init__()
        self.body = nn.Sequential(*layers)
        self.context = context
        if context:
            self.mix = nn.Conv2d(2 * dim, dim, 1)

    def forward(self, images):
        b, _, h, w = images.shape
        ys = torch.linspace(-1.0, 1.0, h, device=images.device).view(1, 1, h, 1).expand(b, 1, h, w)
        xs = torch.linspace(-1.0, 1.0, w, device=images.device).view(1, 1, 1, w).expand(b, 1, h, w)
        x = self.body(torch.cat([images, xs, ys], 1))  # (B, dim, h', w')
        if self.context:
            x = F.relu(self.mix(torch.cat([x, x.mean((2, 3), keepdim=True).expand_as(x)], 1)))
        return x.flatten(2).transpose(1, 2)  # (B, regions, dim)


def conv(cin, cout, k, s, p):
    return [nn.Conv2d(cin, cout, k, s, p), nn.BatchNorm2d(cout), nn.ReLU()]


def backbone(name, size, grid, dim, context=False):
    if name == "grid":
        return Backbone(conv(5, 32, 3, 2, 1) + conv(32, 64, 3, 2, 1) + conv(64, 64, 3, 2, 1) + conv(64, dim, 3, 2, 1), dim, context)
    if name == "wide":
        return Backbone(conv(5, 48, 5, 3, 2) + conv(48, 64, 3, 2, 1) + [nn.Conv2d(64, dim, 3, 2, 1), nn.ReLU()], dim, context)
    if name == "patch":
        patch = size // grid
        return Backbone(conv(5, 64, patch, patch, 0) + conv(64, 64, 1, 1, 0) + [nn.Conv2d(64, dim, 1), nn.ReLU()], dim, context)
    raise ValueError(name)


TASKS = {"grid": ("color", "center"), "wide": ("shape", "center"), "patch": ("color", "shape", "center")}


class Labelled(nn.Module):
    """A backbone with its label heads on the regions pooled to the label grid."""

    def __init__(self, name, size, grid, dim, colors, shapes, context=False):
        super().__init__()
        self.backbone, self.grid, self.tasks = backbone(name, size, grid, dim, context), grid, TASKS[name]
        self.heads = nn.ModuleDict({"color": nn.Linear(dim, colors), "shape": nn.Linear(dim, shapes), "center": nn.Linear(dim, 2)})

    def forward(self, images):
        r = self.backbone(images)  # (B, N, dim)
        side = int(round(r.shape[1] ** 0.5))
        fmap = r.transpose(1, 2).reshape(r.shape[0], r.shape[2], side, side)
        pooled = F.adaptive_avg_pool2d(fmap, self.grid).flatten(2).transpose(1, 2)  # (B, G*G, dim)
        return {t: self.heads[t](pooled) for t in self.tasks}


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
    if "center" in out and occupied.any():
        err = (out["center"] - center.flatten(1, 2))[occupied]
        total = total + 10.0 * err.pow(2).mean()
        stats["center_err"] = err.norm(dim=-1).mean().item()
    return total, stats


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="folder written by python/vqa_data.py")
    p.add_argument("--out", required=True, help="output folder for <name>.pt and detectors.json")
    p.add_argument("--epochs", type=int, default=8, help="training epochs per detector (default 8)")
    p.add_argument("--dim", type=int, default=64, help="region feature size (default 64)")
    p.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--max-images", type=int, default=0, help="train on at most this many images (0: all)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    meta_path = os.path.join(args.data, "meta.json")
    if not os.path.exists(meta_path):
        raise SystemExit(f"error: {meta_path} not found; write the data with python/vqa_data.py first")
    meta = json.load(open(meta_path))
    data = load_file(os.path.join(args.data, "data.safetensors"))
    images = data["images"]
    size, grid = images.shape[-1], data["aux_color"].shape[-1]
    colors, shapes = int(data["aux_color"].max()) + 1, int(data["aux_shape"].max()) + 1
    (t0, t1), (v0, v1) = meta["image_ranges"]["train"], meta["image_ranges"]["val"]
    if args.max_images:
        t1 = min(t1, t0 + args.max_images)
    labels = (data["aux_color"], data["aux_shape"], data["aux_center"])
    context = meta.get("detector_context") == "global"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".detectors-", dir=os.path.dirname(os.path.abspath(args.out)))
    manifest = {"data": os.path.abspath(args.data), "data_sha256": meta.get("sha256"), "seed": args.seed, "epochs": args.epochs,
                "torch": torch.__version__, "input": [None, 3, size, size], "global_context": context, "detectors": []}
    for index, name in enumerate(TASKS):
        torch.manual_seed(args.seed * 100 + index)
        model = Labelled(name, size, grid, args.dim, colors, shapes, context)
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
            _, stats = losses(model(images[idx].float() / 255.0), [l[idx] for l in labels])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.jit.trace is deprecated": TorchScript is what tch loads
            traced = torch.jit.trace(model.backbone, images[:2].float() / 255.0)
            path = os.path.join(tmp, f"{name}.pt")
            traced.save(path)
        regions, dim = traced(images[:1].float() / 255.0).shape[1:]
        entry = {"name": name, "file": f"{name}.pt", "regions": regions, "dim": dim, "labels": list(TASKS[name]),
                 "val": {k: round(v, 4) for k, v in stats.items()}, "train_seconds": round(time.time() - start, 1),
                 "sha256": hashlib.sha256(open(path, "rb").read()).hexdigest()}
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
