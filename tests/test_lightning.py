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


def _trainer(root: Path, max_epochs: int = EPOCHS, **kwargs: Any) -> Any:
    return L.Trainer(
        max_epochs=max_epochs,
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


class LossWeighted(L.LightningModule):  # type: ignore[misc]
    """Trains on a re-weighted loader and records the sample ids of every batch."""

    def __init__(self, frame: pl.DataFrame, history: Path) -> None:
        super().__init__()
        self.frame = frame
        self.history = history
        self.layer = torch.nn.Linear(4, 1)
        self.seen: list[list[int]] = []

    def train_dataloader(self) -> Any:
        self.loader = self.frame.drt.loader(batch_size=32, seed=2, history=self.history)
        return self.loader

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, Any]:
        self.seen.append(batch["x"][:, 0].tolist())
        target = batch["label"].float()
        losses = (self.layer(batch["x"].float() / 300).squeeze(1) - target).pow(2)
        return {"loss": losses.mean(), "losses": losses.detach()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


class ReweightByLoss(L.Callback):  # type: ignore[misc]
    """Ties each batch's per-sample losses to its rows with ``loader.seen(batch_idx)`` and,
    at each epoch's end, re-weights the loader by every sample's mean loss so far."""

    def __init__(self) -> None:
        self.losses: list[tuple[str, int, float]] = []

    def on_train_batch_end(
        self, trainer: Any, module: LossWeighted, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        rows = module.loader.seen(batch_idx)
        losses = outputs["losses"].tolist()
        self.losses.extend(zip(rows["cache_id"], rows["sample_id"], losses, strict=True))

    def on_train_epoch_end(self, trainer: Any, module: LossWeighted) -> None:
        per_sample = (
            # The ids as the frame holds them (a categorical with Polars 2), to join on them.
            pl.DataFrame(
                self.losses,
                schema={
                    "cache_id": module.frame.schema["cache_id"],
                    "sample_id": pl.Int64,
                    "loss": pl.Float64,
                },
                orient="row",
            )
            .group_by("cache_id", "sample_id")
            .agg(pl.col("loss").mean())
        )
        weights = module.frame.join(per_sample, on=["cache_id", "sample_id"], how="left")
        module.loader.reweight(
            weights.with_columns(weight=pl.col("weight") * (1 + pl.col("loss").fill_null(0.0)))
        )

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses = [tuple(row) for row in state["losses"]]  # type: ignore[misc]


def test_reweighting_by_loss_each_epoch_resumes_exactly_from_a_mid_epoch_checkpoint(
    frame: pl.DataFrame, tmp_path: Path
) -> None:
    every = 2 * BATCHES_PER_EPOCH + 3  # the fourth batch of epoch 2
    checkpoints, history = tmp_path / "checkpoints", tmp_path / "history"

    def fit(module: LossWeighted, root: Path, **fit_options: Any) -> None:
        saving = L.pytorch.callbacks.ModelCheckpoint(
            dirpath=checkpoints, every_n_train_steps=every, save_top_k=-1
        )
        trainer = _trainer(root, callbacks=[saving, ReweightByLoss()], max_epochs=4)
        trainer.fit(module, **fit_options)

    torch.manual_seed(0)
    full = LossWeighted(frame, history)
    fit(full, tmp_path / "full")
    assert len(full.seen) == 4 * BATCHES_PER_EPOCH
    state = full.loader.state_dict()
    seen = full.loader.seen(epoch=3)
    assert seen["version"].unique().to_list() == [3], "one re-weight per epoch end"
    assert state["history"] and len(repr(state)) < 400

    (saved,) = (p for p in checkpoints.iterdir() if f"step={every}." in p.name)
    checkpoint = saved.rename(tmp_path / "mid-epoch-2.ckpt")
    shutil.rmtree(checkpoints)
    resumed = LossWeighted(frame, history)
    fit(resumed, tmp_path / "resumed", ckpt_path=checkpoint)
    assert resumed.seen == full.seen[every:], "the resumed run sees exactly the same batches"
    assert resumed.loader.state_dict() == state


def _stdlib_corpus() -> tuple[drt.Cache, int]:
    """A token cache of Python standard-library modules, tokenized by a BPE trained on them."""
    import sysconfig

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    paths = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:80]
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in paths]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<eos>"])
    tokenizer.train_from_iterator(texts, trainer)
    cache = drt.cache(
        (np.array(tokenizer.encode(t).ids, dtype=np.uint16) for t in texts),
        "lightning-stdlib-bpe",
        serializer="tokens",
        progress=False,
    )
    return cache, tokenizer.token_to_id("<eos>")


class TinyGPT(L.LightningModule):  # type: ignore[misc]
    """One causal self-attention block over a 512-token vocabulary; records every batch."""

    def __init__(self, frame: pl.DataFrame, eos: int) -> None:
        super().__init__()
        self.frame, self.eos = frame, eos
        self.embed = torch.nn.Embedding(512, 32)
        self.position = torch.nn.Embedding(32, 32)
        self.block = torch.nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(32, 512)
        self.seen: list[list[int]] = []
        self.losses: list[float] = []

    def train_dataloader(self) -> Any:
        return self.frame.drt.loader(
            batch_size=8, seq_len=32, separator=self.eos, num_samples=3, seed=9
        )

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        self.seen.append(ids.reshape(-1).tolist())
        mask = torch.nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        hidden = self.embed(ids) + self.position(torch.arange(ids.shape[1]))
        logits = self.head(self.block(hidden, src_mask=mask, is_causal=True))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def test_a_tiny_gpt_learns_from_packed_tokens_and_resumes_the_exact_tokens(
    tmp_path: Path,
) -> None:
    cache, eos = _stdlib_corpus()
    torch.manual_seed(0)
    uninterrupted = TinyGPT(cache.metadata, eos)
    steps = len(uninterrupted.train_dataloader())
    assert steps > 30
    every = steps + steps // 2  # mid-epoch 2
    checkpoints = tmp_path / "checkpoints"

    def saving() -> Any:
        return L.pytorch.callbacks.ModelCheckpoint(
            dirpath=checkpoints, every_n_train_steps=every, save_top_k=-1
        )

    _trainer(tmp_path / "full", max_epochs=3, callbacks=[saving()]).fit(uninterrupted)
    seen = uninterrupted.seen
    assert len(seen) == 3 * steps
    losses = uninterrupted.losses
    assert np.mean(losses[-20:]) < np.mean(losses[:20]) - 1.0, "the loss falls"

    (saved,) = (p for p in checkpoints.iterdir() if f"step={every}." in p.name)
    checkpoint = saved.rename(tmp_path / "mid-epoch.ckpt")
    shutil.rmtree(checkpoints)
    resumed = TinyGPT(cache.metadata, eos)
    _trainer(tmp_path / "resumed", max_epochs=3, callbacks=[saving()]).fit(
        resumed, ckpt_path=checkpoint
    )
    assert resumed.seen == seen[every:], "the resumed run sees exactly the same tokens"
