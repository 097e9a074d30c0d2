"""PyTorch Lightning trains from a loader as users write it: new draws every epoch, and a
checkpoint taken mid-epoch resumes the exact batch sequence of an uninterrupted run."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch

import dataset_rt as drt

L = pytest.importorskip("lightning")

BATCHES_PER_EPOCH = 10  # 300 rows in batches of 32
EPOCHS = 3


class Recorder(L.LightningModule):  # type: ignore[misc]
    """A tiny model that records the sample ids of every batch it trains on."""

    def __init__(self, frame: pl.DataFrame, num_workers: int) -> None:
        super().__init__()
        self.frame = frame
        self.num_workers = num_workers
        self.layer = torch.nn.Linear(4, 1)
        self.seen: list[list[int]] = []

    def train_dataloader(self) -> Any:
        return self.frame.drt.loader(batch_size=32, seed=5, num_workers=self.num_workers)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append(batch["x"][:, 0].tolist())
        return self.layer(batch["x"].float()).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _trainer(root: Path, **kwargs: Any) -> Any:
    return L.Trainer(
        max_epochs=EPOCHS,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        **kwargs,
    )


@pytest.fixture
def frame() -> pl.DataFrame:
    cache = drt.cache(
        ({"x": np.full(4, i), "label": i % 3} for i in range(300)),
        "lightning-cache",
        metadata=lambda r: {"label": r["label"]},
        progress=False,
    )
    return cache.metadata.with_columns(weight=pl.col("label").drt.balance())


@pytest.mark.parametrize("num_workers", [0, 2])
def test_epochs_differ_and_a_mid_epoch_checkpoint_resumes_exactly(
    frame: pl.DataFrame, num_workers: int, tmp_path: Path
) -> None:
    every = 13  # the third batch of epoch 1
    checkpoints = tmp_path / "checkpoints"

    def saving(directory: Path) -> Any:
        return L.pytorch.callbacks.ModelCheckpoint(
            dirpath=directory, every_n_train_steps=every, save_top_k=-1
        )

    uninterrupted = Recorder(frame, num_workers)
    _trainer(tmp_path / "full", callbacks=[saving(checkpoints)]).fit(uninterrupted)
    seen = uninterrupted.seen
    assert len(seen) == EPOCHS * BATCHES_PER_EPOCH
    epochs = [seen[e * BATCHES_PER_EPOCH : (e + 1) * BATCHES_PER_EPOCH] for e in range(EPOCHS)]
    assert epochs[0] != epochs[1] != epochs[2], "every epoch draws anew"
    expected = [
        [[int(v) for v in batch["x"][:, 0]] for batch in _epoch_loader(frame, epoch)]
        for epoch in range(EPOCHS)
    ]
    assert epochs == expected, "epoch e under Lightning is the loader's epoch e"

    (saved,) = (p for p in checkpoints.iterdir() if f"step={every}." in p.name)
    checkpoint = saved.rename(tmp_path / "mid-epoch.ckpt")
    shutil.rmtree(checkpoints)  # the resumed run saves into the same, now empty, directory
    resumed = Recorder(frame, num_workers)
    _trainer(tmp_path / "resumed", callbacks=[saving(checkpoints)]).fit(
        resumed, ckpt_path=checkpoint
    )
    assert resumed.seen == seen[every:], "the resumed run continues the same sequence"


def _epoch_loader(frame: pl.DataFrame, epoch: int) -> Any:
    loader = frame.drt.loader(batch_size=32, seed=5)
    loader.set_epoch(epoch)
    return loader


class Validator(Recorder):
    """Records the sample ids of every validation batch, per validation pass."""

    def __init__(self, frame: pl.DataFrame, num_workers: int) -> None:
        super().__init__(frame, num_workers)
        self.passes: list[list[int]] = []

    def val_dataloader(self) -> Any:
        return self.frame.drt.loader(batch_size=32, shuffle=False, num_workers=self.num_workers)

    def on_validation_epoch_start(self) -> None:
        self.passes.append([])

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.passes[-1].extend(int(v) for v in batch["x"][:, 0])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_validation_pass_reads_every_row_after_the_sanity_check(
    frame: pl.DataFrame, num_workers: int, tmp_path: Path
) -> None:
    model = Validator(frame, num_workers)
    _trainer(tmp_path, num_sanity_val_steps=2).fit(model)
    sanity, *passes = model.passes
    assert sanity == list(range(64)), "the sanity check takes the first two batches"
    assert len(passes) == EPOCHS
    for seen in passes:
        assert seen == list(range(300)), "each validation scores the whole set, in order"
