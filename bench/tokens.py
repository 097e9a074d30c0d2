"""Packed token streams: tokens/s of the packed loader beside a memmap baseline.

A corpus of ``--docs`` documents of 200 to 2,000 random uint16 ids (a GPT-2-sized
vocabulary) is cached with ``serializer="tokens"`` and written as one flat token file.
Side by side, in this process, over the same tokens:

- baseline: the flat file as a NumPy ``memmap``, read at random ``seq_len + 1`` windows into
  a preallocated int64 batch (what nanoGPT-style loaders do: no weights, no documents);
- the packed loader: ``df.drt.loader(batch_size, seq_len=...)``, weighted draws of whole
  documents joined and cut in native code;
- today's record loader with a Python collate that packs the same documents;
- the peers' token paths, where installed (``pip install litdata mosaicml-streaming``):
  LitData's ``optimize`` of the documents with ``TokensLoader`` and a shuffled
  ``StreamingDataset`` of ``seq_len + 1`` blocks through its ``StreamingDataLoader``;
  MosaicML Streaming's ``MDSWriter`` of ``seq_len + 1`` blocks concatenated beforehand (as
  LLM Foundry's text conversion does) and a shuffled ``StreamingDataset``.

Each figure is the median of ``--rounds`` timed passes of ``--batches`` batches, with its
ratio to the baseline's tokens/s.

    python bench/tokens.py              # 100k documents (~110M tokens), seq_len 2048
    python bench/tokens.py --smoke      # tiny sizes: checks that it runs
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

import dataset_rt as drt

VOCAB = 50_257


def document(i: int) -> np.ndarray:
    """Document ``i``: 200 to 2,000 random ids."""
    rng = np.random.default_rng([0, i])
    return rng.integers(0, VOCAB, size=int(rng.integers(200, 2001)), dtype=np.uint16)


def corpus(docs: int) -> Iterator[np.ndarray]:
    return (document(i) for i in range(docs))


def _lit_document(i: int) -> Any:
    """Document ``i`` as LitData's ``optimize`` takes tokens: a 1-D tensor."""
    import torch

    return torch.from_numpy(document(i).astype(np.int32))


def litdata_batches(docs: int, root: Path, rows: int, length: int) -> Iterator[Any] | None:
    """LitData's token path over the same documents, or None if it is not installed."""
    try:
        import litdata
    except ImportError:
        return None
    out = root / "litdata"
    litdata.optimize(
        fn=_lit_document,
        inputs=list(range(docs)),
        output_dir=str(out),
        chunk_size=(length + 1) * 2048,
        item_loader=litdata.TokensLoader(),
        num_workers=1,
        verbose=False,
    )
    dataset = litdata.StreamingDataset(
        str(out), item_loader=litdata.TokensLoader(block_size=length + 1), shuffle=True
    )
    return forever(lambda: litdata.StreamingDataLoader(dataset, batch_size=rows))


def mosaic_batches(stream: np.ndarray, root: Path, rows: int, length: int) -> Iterator[Any] | None:
    """MosaicML Streaming over the same tokens in blocks, or None if it is not installed."""
    try:
        from streaming import MDSWriter, StreamingDataset
    except ImportError:
        return None
    import torch

    out = root / "mosaic"
    blocks = len(stream) // (length + 1)
    with MDSWriter(out=str(out), columns={"tokens": f"ndarray:uint16:{length + 1}"}) as writer:
        for block in stream[: blocks * (length + 1)].reshape(blocks, length + 1):
            writer.write({"tokens": block})
    dataset = StreamingDataset(local=str(out), shuffle=True, batch_size=rows)

    def collate(samples: list[dict[str, np.ndarray]]) -> Any:
        return torch.from_numpy(np.stack([s["tokens"] for s in samples]).astype(np.int64))

    def stop() -> None:
        # Its shard-preparing thread runs on after the loop; its stop flag (no public way)
        # ends it before the temporary directory goes.
        event = getattr(dataset, "_event", None)
        if event is not None:
            event.set()
            time.sleep(0.5)

    return forever(
        lambda: torch.utils.data.DataLoader(dataset, batch_size=rows, collate_fn=collate), stop
    )


def forever(make: Callable[[], Any], stop: Callable[[], None] | None = None) -> Iterator[Any]:
    """Batches of ``make()``'s loader, epoch after epoch; ``stop()`` when closed."""
    try:
        while True:
            yield from make()
    finally:
        if stop is not None:
            stop()


def rate(pass_: Callable[[], int], rounds: int) -> list[float]:
    """Tokens per second of ``rounds`` calls of ``pass_`` (which returns its token count)."""
    pass_()  # warm-up: page cache, allocator
    rates = []
    for _ in range(rounds):
        start = time.perf_counter()
        tokens = pass_()
        rates.append(tokens / (time.perf_counter() - start))
    return rates


def cell(rates: list[float], base: list[float] | None = None) -> str:
    median = statistics.median(rates)
    text = f"{median / 1e6:8.1f} M tokens/s ±{(max(rates) - min(rates)) / 1e6:5.1f}"
    if base is not None:
        text += f"   {median / statistics.median(base):5.2f}x the baseline"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batches", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.docs, args.seq_len, args.batches, args.rounds = 300, 256, 10, 2
    import torch

    with tempfile.TemporaryDirectory(prefix="bench-tokens-") as tmp:
        root = Path(tmp)
        start = time.perf_counter()
        cache = drt.cache(
            corpus(args.docs), "tokens", root=root, serializer="tokens", progress=False
        )
        built = time.perf_counter() - start
        flat = root / "flat.u16"
        with flat.open("wb") as out:
            for doc in corpus(args.docs):
                out.write(doc.tobytes())
        tokens = int(cache.metadata["length"].sum())
        print(f"{args.docs:,} documents, {tokens:,} tokens; cached in {built:.1f} s")
        rows, length = args.batch_size, args.seq_len
        per_batch = rows * length
        print(f"batches of {rows} x {length} tokens (+1 for the targets), {args.batches} per pass")

        data = np.memmap(flat, dtype=np.uint16, mode="r")
        rng = np.random.default_rng(0)

        def baseline() -> int:
            for _ in range(args.batches):
                batch = np.empty((rows, length + 1), dtype=np.int64)
                for i, s in enumerate(rng.integers(0, len(data) - length - 1, size=rows)):
                    batch[i] = data[s : s + length + 1]
                x = torch.from_numpy(batch)
                _ = (x[:, :-1], x[:, 1:])
            return args.batches * per_batch

        frame = cache.metadata
        packed_loader = frame.drt.loader(rows, seq_len=length, seed=0)

        def packed() -> int:
            n = sum(1 for _ in zip(range(args.batches), packed_loader, strict=False))
            return n * per_batch

        mean_len = tokens / args.docs
        docs_per_batch = max(1, round(per_batch / mean_len))

        def pack(docs: list[Any]) -> Any:
            stream = np.concatenate(docs).astype(np.int64)
            count = (len(stream) - 1) // length
            windows = np.lib.stride_tricks.sliding_window_view(stream, length + 1)[::length]
            x = torch.from_numpy(np.ascontiguousarray(windows[:count]))
            return x[:, :-1], x[:, 1:]

        record_loader = frame.drt.loader(docs_per_batch, seed=0, collate=pack)

        def collated() -> int:
            n = 0
            for _, (x, _) in zip(range(args.batches), record_loader, strict=False):
                n += x.numel()
            return n

        base = rate(baseline, args.rounds)
        print(f"  {'memmap windows (baseline)':34} {cell(base)}")
        print(f"  {'packed loader':34} {cell(rate(packed, args.rounds), base)}   (target ≥ 1.0x)")
        collate_rates = rate(collated, args.rounds)
        print(f"  {'record loader + Python packing':34} {cell(collate_rates, base)}")
        stream = np.fromfile(flat, dtype=np.uint16)
        peers = {
            "LitData TokensLoader": lambda: litdata_batches(args.docs, root, rows, length),
            "MosaicML Streaming": lambda: mosaic_batches(stream, root, rows, length),
        }
        for label, make in peers.items():
            batches = make()
            if batches is None:
                print(f"  {label:34} not installed (pip install litdata mosaicml-streaming)")
                continue

            def peer(batches: Iterator[Any] = batches) -> int:
                return sum(next(batches).numel() for _ in range(args.batches))

            print(f"  {label:34} {cell(rate(peer, args.rounds), base)}")
            batches.close()  # stops the peer's reading threads before its files go
        ratio = statistics.median(rate(packed, args.rounds)) / statistics.median(collate_rates)
        print(f"  packed over Python packing: {ratio:.2f}x   (target ≥ 3x)")


if __name__ == "__main__":
    main()
