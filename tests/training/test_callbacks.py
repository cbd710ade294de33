"""Callbacks of the training loop: every hook in order with the right epochs, steps and values, no effect on the run,
a hook that raises stops training cleanly (the checkpoints of the last completed epoch, then a bitwise resume), and
the progress callbacks (the tqdm bar, the per-epoch lines of ``gpattn train``)."""

from __future__ import annotations

import io
import sys

import pytest
import torch

from gpattn.training import (
    Callback,
    CallbackList,
    EpochLog,
    ProgressBar,
    TrainingStrategy,
    load_checkpoint,
    train_model,
)

PARTS = ("loss", "nll", "kl", "ksvd", "prior", "grad_norm")


class Recorder(Callback):
    """Records every hook as a tuple (and raises ``error`` at hook ``raise_at``, e.g. ``("step", 2, 1)``)."""

    def __init__(self, raise_at: tuple | None = None, error: BaseException | None = None) -> None:
        self.events: list[tuple] = []
        self.values: list[dict[str, float]] = []
        self.records: list[dict[str, float]] = []
        self.raise_at, self.error = raise_at, error

    def _seen(self, event: tuple) -> None:
        self.events.append(event)
        if event == self.raise_at:
            raise self.error

    def on_train_begin(self, context):
        self._seen(("begin", context.start_epoch, len(context.result.history)))

    def on_epoch_begin(self, context, epoch):
        self._seen(("epoch", epoch))

    def on_step_end(self, context, epoch, step, values):
        self.values.append(dict(values))
        self._seen(("step", epoch, step))

    def on_epoch_end(self, context, epoch, record):
        assert record is context.result.history[-1] and record["epoch"] == epoch
        self.records.append(dict(record))
        self._seen(("epoch_end", epoch))

    def on_train_end(self, context):
        assert not context.model.training  # the best state, in eval mode
        self._seen(("end", context.result.best_epoch))

    def on_exception(self, context, error):
        self.events.append(("exception", type(error).__name__))


class Stop(Exception):
    """Raised by a callback."""


def _run_events(start: int, epochs: int, steps: int) -> list[tuple]:
    events = []
    for epoch in range(start + 1, epochs + 1):
        events += [("epoch", epoch), *[("step", epoch, step) for step in range(1, steps + 1)], ("epoch_end", epoch)]
    return events


def _same_parameters(first: torch.nn.Module, second: torch.nn.Module) -> bool:
    return all(
        torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True)
    )


def test_hooks_come_in_order_with_their_epochs_steps_and_values(data, small_model, small_config):
    recorder = Recorder()
    reference, watched = small_model(), small_model()
    expected = train_model(reference, data.train, data.val, small_config())
    result = train_model(watched, data.train, data.val, small_config(), callbacks=[recorder])
    # 256 sequences in batches of 64: 4 steps an epoch, 2 epochs
    assert recorder.events == [("begin", 0, 0), *_run_events(0, 2, 4), ("end", result.best_epoch)]
    # watching changes nothing: the same history (but the wall time) and parameters as without the callback
    assert [{**r, "seconds": 0} for r in result.history] == [{**r, "seconds": 0} for r in expected.history]
    assert _same_parameters(watched, reference)
    # the step values are the batch's loss parts: 4 equal batches, so the epoch's averages are their means
    assert recorder.records == result.history
    for epoch, record in enumerate(result.history, start=1):
        steps = recorder.values[4 * (epoch - 1) : 4 * epoch]
        for name in PARTS:
            assert record[name] == pytest.approx(sum(values[name] for values in steps) / 4, rel=1e-12)
        assert record["lr"] == steps[-1]["lr"]  # the rate the epoch's last step used


def test_a_raising_callback_stops_cleanly_and_the_run_resumes_bitwise(data, tmp_path, small_model, small_config):
    config = small_config(epochs=3, checkpoint_dir=tmp_path / "cut")
    reference = small_model()
    expected = train_model(reference, data.train, data.val, small_config(epochs=3, checkpoint_dir=tmp_path / "full"))

    stopper, other = Recorder(raise_at=("step", 2, 1), error=Stop("stop here")), Recorder()
    model = small_model()
    with pytest.raises(Stop, match="stop here"):
        train_model(model, data.train, data.val, config, callbacks=[stopper, other])
    # no hook after the error but on_exception, of every callback (the one that raised too)
    assert stopper.events == [("begin", 0, 0), *_run_events(0, 1, 4), ("epoch", 2), ("step", 2, 1)] + [
        ("exception", "Stop")
    ]
    assert other.events == stopper.events[:-2] + [("exception", "Stop")]  # the step hook of the raising one came first
    assert load_checkpoint(tmp_path / "cut" / "last.pt")["epoch"] == 1  # the last completed epoch

    resumed_watch = Recorder()
    resumed = train_model(model, data.train, data.val, config, resume=True, callbacks=[resumed_watch])
    assert resumed_watch.events == [("begin", 1, 1), *_run_events(1, 3, 4), ("end", resumed.best_epoch)]
    assert [{**r, "seconds": 0} for r in resumed.history] == [{**r, "seconds": 0} for r in expected.history]
    assert _same_parameters(model, reference)


def test_a_callback_raising_at_the_end_of_an_epoch_leaves_that_epoch_on_disk(data, tmp_path, small_model, small_config):
    stopper = Recorder(raise_at=("epoch_end", 1), error=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        train_model(small_model(), data.train, data.val, small_config(checkpoint_dir=tmp_path), callbacks=[stopper])
    assert stopper.events[-2:] == [("epoch_end", 1), ("exception", "KeyboardInterrupt")]
    assert load_checkpoint(tmp_path / "last.pt")["epoch"] == 1


def test_a_failing_on_exception_does_not_replace_the_run_s_error(data, small_model, small_config):
    # was: the cleanup's RuntimeError raised in place of the run's Stop, and the callbacks after it never told
    class FailingCleanup(Recorder):
        def on_exception(self, context, error):
            super().on_exception(context, error)
            raise RuntimeError("cleanup failed")

    stopper, cleanup, last = Recorder(raise_at=("step", 1, 2), error=Stop("stop here")), FailingCleanup(), Recorder()
    with pytest.warns(UserWarning, match=r"FailingCleanup.on_exception raised RuntimeError: cleanup failed \(while"):
        with pytest.raises(Stop, match="stop here") as caught:
            train_model(small_model(), data.train, data.val, small_config(), callbacks=[stopper, cleanup, last])
    assert last.events[-1] == ("exception", "Stop")  # told after the failing one
    if sys.version_info >= (3, 11):
        assert caught.value.__notes__ == ["FailingCleanup.on_exception raised RuntimeError: cleanup failed"]


def test_only_the_main_process_calls_the_hooks(data, small_model, small_config):
    class SecondRank(TrainingStrategy):
        rank, world_size = 1, 2

    recorder = Recorder()
    train_model(small_model(), data.train, data.val, small_config(), strategy=SecondRank(), callbacks=[recorder])
    assert recorder.events == []


def test_callbacks_must_be_callbacks():
    with pytest.raises(TypeError, match="expected every callback to be a Callback, got int"):
        CallbackList([3])


def test_a_single_callback_not_in_a_list_is_a_clear_error(data, small_model, small_config):
    # was "'Recorder' object is not iterable", raised from inside the loop
    model = small_model()
    match = r"^train_model: expected callbacks to be a list of Callbacks, got a single Recorder; pass callbacks=\[cal"
    with pytest.raises(TypeError, match=match):
        train_model(model, data.train, data.val, small_config(), callbacks=Recorder())
    # a function, not print: another test may leave print wrapped (its type then differs by test order)
    with pytest.raises(TypeError, match=r"^train_model: expected callbacks\[1\] to be a Callback .*got function"):
        train_model(model, data.train, data.val, small_config(), callbacks=[Recorder(), lambda *args: None])
    with pytest.raises(TypeError, match=r"^train_model: expected callbacks to be a list of Callbacks, got int"):
        train_model(model, data.train, data.val, small_config(), callbacks=3)


# -- the progress callbacks ------------------------------------------------------------------------------------------
def test_the_progress_bar_closes_after_each_epoch_and_on_an_error(data, small_model, small_config):
    bar = ProgressBar()

    class Check(Callback):
        def on_step_end(self, context, epoch, step, values):
            # the bar (called first) is the epoch's, closed after its last step
            assert (bar.bar is None) if step == context.steps_per_epoch else (bar.bar.total == context.steps_per_epoch)
            if (epoch, step) == (2, 2):
                raise Stop

    with pytest.raises(Stop):
        train_model(small_model(), data.train, data.val, small_config(), callbacks=[bar, Check()])
    assert bar.bar is None  # closed by on_exception in the middle of epoch 2


def test_epoch_log_prints_one_line_per_epoch_and_the_restored_ones_on_resume(data, tmp_path, small_model, small_config):
    stream = io.StringIO()
    model = small_model()
    config = small_config(schedule_epochs=3, checkpoint_dir=tmp_path)  # the first 2 epochs of a 3-epoch schedule
    first = train_model(model, data.train, data.val, config, callbacks=[EpochLog(stream)])

    def line(record, epochs):
        return (
            f"epoch {record['epoch']}/{epochs}: loss {record['loss']:.4f}, val accuracy {record['val_accuracy']:.4f}, "
            f"val nll {record['val_nll']:.4f} ({record['seconds']:.1f} s)"
        )

    assert stream.getvalue().splitlines() == [line(record, 2) for record in first.history]
    stream = io.StringIO()
    config = small_config(epochs=3, checkpoint_dir=tmp_path)
    resumed = train_model(model, data.train, data.val, config, resume=True, callbacks=[EpochLog(stream)])
    assert stream.getvalue().splitlines() == [line(record, 3) for record in resumed.history]  # 2 restored, 1 new
