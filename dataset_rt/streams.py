"""Packed token streams for language models: ``df.drt.loader(batch_size, seq_len=...)``."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import polars as pl

from dataset_rt import _native
from dataset_rt._version_check import CACHE_ID_DTYPE
from dataset_rt.errors import ArgumentError, LoaderStateError
from dataset_rt.options import check_draws, check_int, check_same, resolve_ranks
from dataset_rt.packing import START, Cursor, Steps
from dataset_rt.program import Phase, WeightSource
from dataset_rt.reweights import Weights, row_weights
from dataset_rt.roots import PathLike
from dataset_rt.serialize import TOKEN_RANGES
from dataset_rt.snapshot import take

__all__ = ["TokenLoader"]

STATE_KIND = "tokens"
STATE_FORMAT = 1


def _token_type(serializer: str) -> str:
    """The token type a cache written with ``serializer`` promises (``int64``: per document)."""
    return serializer.partition(":")[2] or "int64"


class TokenLoader:
    """Fixed-shape batches of token ids packed from the documents a frame draws.

    Made by ``df.drt.loader(batch_size, seq_len=...)`` over rows of token caches (written
    with ``serializer="tokens"``). Each epoch draws documents as a shuffled
    :class:`~dataset_rt.Loader` would (by ``weight``, or by a ``schedule``), joins them
    into one stream (each followed by ``separator``, if given) and cuts it into rows of
    ``seq_len`` tokens: row ``j`` of the epoch starts at token ``j * seq_len``, and
    documents run across row boundaries. An epoch takes as many tokens as ``num_samples``
    documents of the frame hold on average (its ``length`` column's sum, scaled), so every
    epoch has the same number of steps. Step ``t`` gives rank ``r`` of ``w`` rows
    ``(t * w + r) * batch_size`` and the ``batch_size - 1`` after it.

    A batch is a dict of tensors (NumPy arrays without PyTorch): ``input_ids``
    (``[batch_size, seq_len]``, int64), ``labels`` (the same rows shifted by one token:
    the next token of each position; with ``targets=True``) and ``document_ids`` (int32,
    each token's document numbered from 0 within its row; with ``documents=True``). The
    native reader writes every row straight into one ``[batch_size, seq_len + 1]`` block,
    of which ``input_ids`` and ``labels`` are views: no Python object per document.

    Parameters
    ----------
    frame
        A metadata frame of token-cache rows with ``cache_id``, ``sample_id``, ``length``
        (each document's token count, as the cache wrote it) and, to shuffle, ``weight``.
    batch_size
        Rows per batch on each rank.
    seq_len
        Tokens per row.
    shuffle
        ``True``: documents are weighted draws with replacement. ``False``: every
        document once, in frame order.
    seed
        With the epoch, fixes the draws.
    num_samples
        Documents per epoch (sets the epoch's tokens, and where a schedule's phases fall);
        default the number of rows.
    separator
        A token id written after every document (an end-of-text id), or None.
    targets
        Add ``labels``, the next token of every position.
    documents
        Add ``document_ids``, to mask attention within documents.
    rank, world_size
        This process's share; default from ``torch.distributed`` when initialised.
    root
        Where to look for caches this process has not opened yet.
    verify
        Check every document against its stored checksum.
    schedule
        Weights that change over the run, as for :class:`~dataset_rt.Loader`.
    num_workers
        PyTorch DataLoader worker processes, each packing every ``num_workers``-th step
        (needs PyTorch). Any count gives the same batches; packing is native, so one
        process is fast already.
    history
        Where :meth:`reweight` keeps its weight versions, as for :class:`~dataset_rt.Loader`.
    """

    def __init__(
        self,
        frame: pl.DataFrame | pl.LazyFrame,
        batch_size: int,
        *,
        seq_len: int,
        shuffle: bool = True,
        seed: int = 0,
        num_samples: int | None = None,
        separator: int | None = None,
        targets: bool = True,
        documents: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        root: PathLike | None = None,
        verify: bool = False,
        schedule: Sequence[Phase] | None = None,
        num_workers: int = 0,
        history: PathLike | None = None,
    ) -> None:

        self._batch_size = check_int("batch_size", batch_size, 1)
        self._seq_len = check_int("seq_len", seq_len, 1)
        self._seed = check_int("seed", seed, 0, 2**64 - 1)
        self._shuffle = bool(shuffle)
        self._targets = bool(targets)
        self._documents = bool(documents)
        self._num_workers = check_int("num_workers", num_workers, 0)
        num_samples, phases = check_draws(self._shuffle, num_samples, schedule, self._num_workers)
        self._rank, self._world_size = resolve_ranks(rank, world_size)
        taken = take(self, frame, root, self._shuffle, phases, bool(verify), lengths=True)
        tokens = cast(int, taken.tokens)  # take(lengths=True) maps or writes a plan with them
        if separator is not None:
            separator = check_int("separator", separator, -(2**63), 2**63 - 1)
            for cache in taken.caches:
                kind = _token_type(cache.serializer)
                low, high = TOKEN_RANGES[kind]
                if not low <= separator <= high:
                    raise ArgumentError(
                        f"separator {separator} is outside the token type {kind} of cache "
                        f"{cache.name!r} (ids from {low} to {high})"
                    )
        self._separator = separator
        self._caches = taken.caches  # held for the loader's life, with their mappings
        self._plan = taken.plan
        self._rows = taken.rows
        self._total = num_samples if num_samples is not None else taken.rows
        # An epoch takes as many tokens as its draws hold on average: the frame's tokens
        # (with a separator per document), scaled to num_samples documents.
        tokens += taken.rows * (separator is not None)
        self._epoch_tokens = tokens * self._total // taken.rows
        if len(self) == 0:
            raise ArgumentError(
                f"an epoch holds {self._epoch_tokens:,} tokens, fewer than one step takes "
                f"({self._world_size} rank(s) x batch_size {self._batch_size} x seq_len "
                f"{self._seq_len}{' + 1 target' if self._targets else ''}): use a smaller "
                "batch_size or seq_len, or a larger num_samples"
            )
        ids_digest = hashlib.sha256("\n".join(c.cache_id for c in taken.caches).encode())
        fingerprint = f"{taken.digest}-{ids_digest.hexdigest()[:16]}-sep{separator}"
        if taken.program is not None:
            fingerprint += f"-{taken.program.fingerprint[:16]}"
        self._fingerprint = fingerprint
        self._weights = Weights(
            taken.program,
            taken.plan,
            taken.digest,
            fingerprint,
            Path(history) if history is not None else taken.caches[0].root / ".weights",
        )
        self._verify = bool(verify)
        self._epoch = 0
        self._head: Cursor = START  # the first token of the epoch no rank has consumed
        self._ended = False
        self._origin = 0  # where step 0 of the current epoch starts, in tokens
        self._plan_samples: pl.DataFrame | None = None
        self._stream: _native.TokenStream | None = None

    # -- the stream -----------------------------------------------------------------------------
    def _steps(self, epoch: int) -> Steps:
        return Steps(
            self._plan,
            tuple(str(c.path) for c in self._caches),
            tuple(c.cache_id for c in self._caches),
            self._weights.native,
            (self._seed, epoch, self._total, self._separator, self._verify),
            (self._rank, self._world_size, self._batch_size, self._seq_len),
            (self._targets, self._documents),
        )

    @property
    def _extra(self) -> int:
        """Tokens a row reads past its ``seq_len``: one, for the last position's target."""
        return int(self._targets)

    @property
    def _step_tokens(self) -> int:
        return self._world_size * self._batch_size * self._seq_len

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch the next iteration reads; the current one keeps its position."""
        epoch = check_int("epoch", epoch, 0, 2**63 - 1)
        if epoch != self._epoch or self._ended:
            self._epoch, self._head, self._ended, self._origin = epoch, START, False, 0

    def __len__(self) -> int:
        """Steps in a whole epoch: the same on every rank, and in every epoch."""
        return max(0, self._epoch_tokens - self._extra) // self._step_tokens

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._ended:
            # A finished epoch moves on to the next one, as the record loader does.
            self._epoch, self._head, self._ended = self._epoch + 1, START, False
            self._origin = 0
        return self._iterate()

    def _iterate(self) -> Iterator[dict[str, Any]]:
        # A re-weight during iteration changes the documents from some draw on: the batches
        # read ahead are dropped, and reading starts again from the token reached.
        while not self._ended:
            program = self._weights.native
            for batch in self._read():
                yield batch
                if self._weights.native is not program:
                    break
            else:
                return

    def _read(self) -> Iterator[dict[str, Any]]:
        steps = self._steps(self._epoch)
        step = self._step_tokens
        last = self._epoch_tokens - self._extra  # a row and its target lie within the epoch
        if self._num_workers == 0:
            # Kept until the next epoch's stream has opened the same plan and caches: it then
            # shares their mappings, with the pages this epoch touched.
            self._stream = steps.stream()
            batches = steps.batches(self._head, last, stream=self._stream)
        else:
            from dataset_rt.workers import run_workers

            produce = functools.partial(steps.batches, self._head, last)
            batches = run_workers(produce, self._num_workers, 2 * self._num_workers)
        try:
            for head, batch in batches:
                self._head = head  # the token after the step, as the packer walked to it
                # Known at the last step, not one call later: a loop that stops after len()
                # steps (Lightning) then starts the next epoch with its next iter().
                self._ended = self._head[2] + step > last
                yield batch
            self._ended = True
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # shuts the workers down when the consumer stops early

    # -- weights from the training loop -----------------------------------------------------------
    def reweight(
        self, weights: WeightSource | pl.DataFrame | pl.LazyFrame, *, step: int | None = None
    ) -> None:
        """Draws documents by new weights from the next epoch on, or from ``step`` on.

        As :meth:`dataset_rt.Loader.reweight`: one weight per row of the loader's frame, or
        a frame of ``cache_id``, ``sample_id`` and ``weight``. With ``step``, the documents
        that start at or after that step's first token (of this epoch, not yet consumed)
        are drawn by the new weights; a document begun earlier is read to its end. The
        history keeps every version, so a state saved at any point resumes the same tokens.

        Raises
        ------
        WeightError, MetadataError
            As for :meth:`dataset_rt.Loader.reweight`.
        ArgumentError
            ``step`` has been consumed already or is past the epoch, or the loader does not
            shuffle.
        """
        if not self._shuffle:
            raise ArgumentError(
                "reweight applies to shuffled loaders; shuffle=False draws no weights"
            )
        start = self._reweight_start(step)
        plan, ids = self._plan, [c.cache_id for c in self._caches]
        self._weights.reweight(start, row_weights(weights, plan, ids, self._rows))

    def _reweight_start(self, step: int | None) -> int:
        """The global draw from which a re-weight at ``step`` takes effect."""
        first = self._epoch * self._total
        if step is None:
            begun = self._ended or self._head != START
            return first + (self._total if begun else 0)
        step = check_int("step", step, 0)
        token = self._origin + step * self._step_tokens
        if token < self._head[2] or self._ended:
            raise ArgumentError(
                f"step {step} of epoch {self._epoch} has been consumed already (the loader "
                f"is at token {self._head[2]}): re-weight at a later step, or at the next epoch"
            )
        if step >= len(self):
            raise ArgumentError(
                f"step {step} is past the end of the epoch ({len(self)} steps); leave step "
                "out to re-weight from the next epoch"
            )
        draw, offset, _ = (
            self._steps(self._epoch).stream().advance(self._head, token - self._head[2])
        )
        draw += offset > 0  # the first document that starts at or after the token
        if draw >= self._total - 1:
            # Draws from the epoch's last on count as its last for the program: they cannot
            # take other weights than the ones before them.
            raise ArgumentError(
                f"step {step} lies in the epoch's last document draw; re-weight at an "
                "earlier step, or at the next epoch"
            )
        return first + draw

    # -- what the model saw ---------------------------------------------------------------------
    def seen(
        self,
        steps: int | range | None = None,
        *,
        epoch: int | None = None,
        all_ranks: bool = False,
    ) -> pl.DataFrame:
        """The documents behind the rows of ``steps``, from the draws alone (no record is read).

        One row per document per batch row: ``epoch``, ``step``, ``rank``, ``row`` (in the
        batch), ``column`` (where in the row the document's tokens start), ``draw``,
        ``cache_id``, ``sample_id``, ``offset`` (the first of its ids in the row) and
        ``tokens`` (how many positions of the row it fills, its separator included).

        Parameters
        ----------
        steps
            A step or a ``range`` of steps of the epoch (default all of it), counted as
            this loader counts them: from the epoch's start, or from where a loaded state
            put it.
        epoch
            Default the current epoch.
        all_ranks
            Every rank's rows, not only this one's.
        """
        epoch = self._epoch if epoch is None else check_int("epoch", epoch, 0, 2**63 - 1)
        if steps is None:
            steps = range(len(self))
        elif not isinstance(steps, range):
            steps = range(check_int("steps", steps, 0), steps + 1)
        if steps.step != 1 or steps.start < 0:
            raise ArgumentError(f"steps must be a step or a range of steps, got {steps!r}")
        stream = self._steps(epoch).stream()
        rows, length, step = self._batch_size, self._seq_len, self._step_tokens
        origin = self._origin if epoch == self._epoch else 0
        ranks = range(self._world_size) if all_ranks else range(self._rank, self._rank + 1)
        found: list[tuple[int, ...]] = []
        cursor = stream.advance(START, origin + steps.start * step)
        for number in steps:
            for rank in ranks:
                first = stream.advance(cursor, rank * rows * length)
                pieces = stream.pieces(first, rows, length, length)
                found.extend((number, rank, *piece) for piece in pieces)
            cursor = stream.advance(cursor, step)
        names = ["step", "rank", "row", "column", "draw", "plan_row", "offset", "tokens"]
        frame = pl.DataFrame(found, schema=names, orient="row").with_columns(
            pl.col("step", "rank", "row", "column", "draw", "offset", "tokens").cast(pl.Int64)
        )
        keys = (
            self._samples()
            .with_row_index("plan_row")
            .with_columns(pl.col("plan_row").cast(pl.Int64))
        )
        codes = pl.Series([c.cache_id for c in self._caches], dtype=CACHE_ID_DTYPE)
        return (
            frame.with_columns(pl.col("plan_row").cast(pl.Int64))
            .join(keys, on="plan_row", how="left", maintain_order="left")
            .select(
                pl.lit(epoch, pl.Int64).alias("epoch"),
                "step",
                "rank",
                "row",
                "column",
                "draw",
                pl.col("cache")
                .replace_strict(range(len(codes)), codes, return_dtype=CACHE_ID_DTYPE)
                .alias("cache_id"),
                pl.col("sample_id").cast(pl.Int64),
                "offset",
                "tokens",
            )
        )

    def _samples(self) -> pl.DataFrame:
        """The plan's rows: cache code and sample id (read once, on first use)."""
        if self._plan_samples is None:
            self._plan_samples = pl.DataFrame(_native.plan_samples(self._plan))
        return self._plan_samples

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The loader's position: the first token of the epoch's stream no rank has consumed.

        It names that token by its document draw and offset, so resuming costs no walk;
        a loader with another ``seq_len``, ``batch_size`` or world size continues the same
        stream from that token.
        """
        draw, offset, token = self._head
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "kind": STATE_KIND,
            "epoch": self._epoch,
            "draw": draw,
            "offset": offset,
            "token": token,
            "ended": self._ended,
            "seed": self._seed,
            "total": self._total,
            "shuffle": self._shuffle,
            "plan": self._fingerprint,
        }
        return self._weights.stamped(state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues from a position saved by :meth:`state_dict`, in O(1).

        Raises
        ------
        LoaderStateError
            The state does not come from a packed loader over the same rows, weights,
            separator, seed and epoch length. The loader is left as it was.
        """
        if (
            not isinstance(state, Mapping)
            or state.get("format") != STATE_FORMAT
            or state.get("kind") != STATE_KIND
        ):
            raise LoaderStateError(f"not a dataset_rt packed loader state: {state!r}")
        check_same(
            state,
            {
                "plan": self._fingerprint,
                "seed": self._seed,
                "total": self._total,
                "shuffle": self._shuffle,
            },
        )
        try:
            epoch = check_int("epoch", state["epoch"], 0, 2**63 - 1)
            head = (
                check_int("draw", state["draw"], 0, 2**63 - 1),
                check_int("offset", state["offset"], 0, 2**63 - 1),
                check_int("token", state["token"], 0, 2**63 - 1),
            )
        except (KeyError, ArgumentError) as exc:
            raise LoaderStateError(f"a damaged packed loader state: {exc}") from None
        self._weights.restore(state.get("history"), self._rows)
        self._epoch, self._head, self._ended = epoch, head, bool(state.get("ended", False))
        # Steps count on from the loaded token, in this loader's step size.
        self._origin = head[2] % self._step_tokens

    def __repr__(self) -> str:
        return (
            f"TokenLoader(rows={self._rows:,}, batch_size={self._batch_size}, "
            f"seq_len={self._seq_len}, epoch={self._epoch}, token={self._head[2]}, "
            f"rank={self._rank}/{self._world_size})"
        )
