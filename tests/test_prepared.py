"""Prepared indexes (datamodules/prepared.py): built once, mapped by later starts and other ranks,
rebuilt when the data changes, and equal to a direct read of the data."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from torchvision.datasets import ImageFolder

from datamodules.imagefolder import ImageFolderDataModule, index_split, scan_split
from datamodules.prepared import StringTable, prepare

ROOT = Path(__file__).resolve().parents[1]


def write_tree(root: Path, counts: dict[str, int]) -> Path:
    for name, n in counts.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.new("RGB", (4, 4), (i * 40 % 256, 0, 0)).save(root / name / f"img_{i:02d}.png")
    return root


def test_string_table_round_trips_unicode():
    strings = ["n01/a.JPEG", "", "ü/ß é.png", "x" * 300]
    assert [StringTable(*StringTable.encode(strings))[i] for i in range(4)] == strings


def test_index_is_built_once_and_rebuilt_when_its_fingerprint_changes(tmp_path, caplog):
    calls = []

    def build():
        calls.append(1)
        return {"values": np.arange(len(calls) + 2)}, {"built": len(calls)}

    caplog.set_level(logging.INFO, "datamodules.prepared")
    first = prepare("test", tmp_path / "src", {"size": 1}, build, tmp_path / "cache")
    again = prepare("test", tmp_path / "src", {"size": 1}, build, tmp_path / "cache")
    assert len(calls) == 1 and again.meta == {"built": 1} and not again["values"].flags.writeable
    changed = prepare("test", tmp_path / "src", {"size": 2}, build, tmp_path / "cache")
    assert len(calls) == 2 and changed["values"].tolist() == [0, 1, 2, 3]
    assert "changed since its test index was prepared (size: 1 -> 2)" in caplog.text
    assert not first.folder.exists()  # the stale index is removed once the new one is in place


def test_prepared_listing_equals_torchvision_imagefolder_and_counts_what_it_leaves_out(tmp_path):
    split = write_tree(tmp_path / "train", {"cat": 3, "dog": 2, "emu": 4})
    (split / "dog" / "clip.gif").write_bytes(b"GIF89a")
    (split / "dog" / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    (split / "emu" / ".hidden.png").write_bytes(b"")
    with pytest.warns(UserWarning) as warned:
        index, classes = index_split(split, prepared_dir=tmp_path / "cache")
    reference = ImageFolder(str(split), is_valid_file=lambda p: p.endswith(".png") and "/." not in p)
    assert classes == reference.classes
    assert [(str(index.path(i)), int(index.labels[i])) for i in range(len(index))] == reference.samples
    assert [(str(p), t) for p, t in scan_split(split)[0]] == reference.samples
    message = str(warned[0].message)
    assert "left out 2 entries" in message and "1 file of another type (dog/clip.gif)" in message, message
    assert "1 broken link (dog/gone.jpg)" in message
    with pytest.warns(UserWarning, match="left out 2 entries"):  # told again on a start that maps the listing
        index_split(split, prepared_dir=tmp_path / "cache")


def test_a_file_added_to_a_class_folder_rebuilds_the_listing(tmp_path, caplog):
    split = write_tree(tmp_path / "train", {"a": 2, "b": 2})
    first, _ = index_split(split, prepared_dir=tmp_path / "cache")
    write_tree(split, {"b": 3})
    caplog.set_level(logging.WARNING, "datamodules.prepared")
    second, _ = index_split(split, prepared_dir=tmp_path / "cache")
    assert (len(first), len(second)) == (4, 5) and "b/img_02.png" in [second.paths[i] for i in range(5)]
    assert "changed since its imagefolder index was prepared (folders: b)" in caplog.text


def test_a_read_only_dataset_is_listed_into_the_cache(tmp_path):
    root = tmp_path / "data"
    write_tree(root / "train", {"a": 2, "b": 1})
    write_tree(root / "val", {"a": 1, "b": 1})
    for folder in [root, *root.rglob("*")]:
        if folder.is_dir():
            folder.chmod(0o555)
    try:
        dm = ImageFolderDataModule(root=str(root), image_size=8, eval_resize=8, num_workers=0,
                                   prepared_dir=str(tmp_path / "cache"))
        dm.setup("fit")
        assert len(dm.train_set) == 3 and dm.train_set[2]["path"] == "train/b/img_00.png"
        assert dm.val_set[1]["target"] == 1 and list((tmp_path / "cache" / "imagefolder").iterdir())
    finally:
        for folder in [root, *root.rglob("*")]:
            if folder.is_dir():
                folder.chmod(0o755)


RANK = textwrap.dedent("""
    import logging, sys, time
    import numpy as np
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    from datamodules.prepared import prepare

    def build():
        time.sleep(1)  # long enough for the other rank to arrive while this one builds
        return {"ids": np.arange(1000) * 3}, {"rank": sys.argv[3]}

    index = prepare("test", sys.argv[1], {"size": 1000}, build, sys.argv[2])
    print(index.meta["rank"], int(index["ids"].sum()))
""")


def test_ranks_started_together_build_once_and_a_later_start_maps_it(tmp_path):
    """Numpy-only subprocesses (the suite's imports would cost seconds): the lock and the mapping."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def rank(name):
        command = [sys.executable, "-c", RANK, str(tmp_path / "data"), str(tmp_path / "cache"), name]
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    outputs = [r.communicate(timeout=60) for r in [rank("0"), rank("1")]]
    outputs.append(rank("later").communicate(timeout=60))
    logs = [err for _, err in outputs]
    assert sum("preparing the test index" in log for log in logs) == 1, logs
    builders = {out.split()[0] for out, _ in outputs}
    assert len(builders) == 1 and builders < {"0", "1"}  # all three map the index one of the ranks wrote
    assert {out.split()[1] for out, _ in outputs} == {str(3 * 999 * 1000 // 2)}
