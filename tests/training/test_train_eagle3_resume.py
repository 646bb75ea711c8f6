"""train_eagle3.py's feature extraction resumes after a kill: complete shards are kept, a cut one is redone."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "training" / "eagle3"))

from train_eagle3 import resume_point  # noqa: E402


def test_resume_keeps_whole_shards_and_drops_a_cut_one(tmp_path):
    for i in range(3):
        torch.save([dict(input_ids=torch.arange(4) + i)], tmp_path / f"shard{i:04d}.pt")
    data = (tmp_path / "shard0002.pt").read_bytes()
    (tmp_path / "shard0002.pt").write_bytes(data[: len(data) // 2])  # killed while writing shard 2
    torch.save([], tmp_path / "shard0003.pt")  # anything after a cut shard is dropped too
    assert resume_point(tmp_path) == 2
    assert sorted(f.name for f in tmp_path.iterdir()) == ["shard0000.pt", "shard0001.pt"]
    assert resume_point(tmp_path) == 2  # idempotent


def test_resume_from_nothing(tmp_path):
    assert resume_point(tmp_path) == 0
