"""Setup cost of the COCO -> VOC-classes segmentation source at scale: CocoVocSegmentation opens a synthetic
COCO-layout annotation file (5,000 images of 640x480, 7 polygon instances each, categories drawn from all 80)
and filters images by VOC-class pixel count; prints the cost of the first open (which prepares the index) per
annotation, extrapolated to COCO train2017 (860,001 annotations), of a later open (which maps it), and of
painting one mask.

    python benchmarks/bench_coco_voc.py
"""
import json
import tempfile
import time

import numpy as np
from pathlib import Path
from datamodules.coco_voc import CocoVocSegmentation, COCO_CATEGORY_NAMES
rng = np.random.default_rng(0)
names = sorted(COCO_CATEGORY_NAMES)
cats = [{"id": i + 1, "name": n} for i, n in enumerate(names)]
n_img, per = 5000, 7
images = [{"id": i, "file_name": f"{i:012d}.jpg", "height": 480, "width": 640} for i in range(n_img)]
anns = []
for i in range(n_img):
    for k in range(per):
        cx, cy, r = rng.uniform(100, 540), rng.uniform(100, 380), rng.uniform(10, 90)
        t = np.linspace(0, 2 * np.pi, 20, endpoint=False)
        poly = np.stack([cx + r * np.cos(t), cy + r * np.sin(t)], 1).ravel().round(2).tolist()
        anns.append({"id": len(anns) + 1, "image_id": i, "category_id": int(rng.integers(1, 81)), "iscrowd": 0,
                     "segmentation": [poly], "area": 3.0 * r * r, "bbox": [cx - r, cy - r, 2 * r, 2 * r]})
root = Path(tempfile.mkdtemp()); (root / "annotations").mkdir()
(root / "annotations" / "instances_train2017.json").write_text(json.dumps({"images": images, "annotations": anns, "categories": cats}))
prepared = root / "prepared"  # the first open parses and prepares the index, later opens map it
t = time.perf_counter(); ds = CocoVocSegmentation(root, "train2017", None, prepared_dir=prepared)
dt = time.perf_counter() - t
print(f"{len(anns)} annotations, {n_img} images: first open {dt:.2f} s -> {dt / len(anns) * 1e6:.1f} us/annotation; "
      f"COCO train2017 (860,001 annotations) ~ {dt / len(anns) * 860001:.0f} s; kept {len(ds)}")
t = time.perf_counter(); CocoVocSegmentation(root, "train2017", None, prepared_dir=prepared); dt = time.perf_counter() - t
print(f"later open (prepared index mapped): {dt * 1e3:.1f} ms")
t = time.perf_counter()
for i in range(200): ds.voc_mask(ds.image_ids[i])
print(f"voc_mask: {(time.perf_counter() - t) / 200 * 1e3:.2f} ms/image")
