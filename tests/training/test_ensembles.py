"""Ensembles: one seed rule, member checkpoints, averaged predictions."""

from __future__ import annotations

import pytest
import torch

from gpattn.data import make_pointer_task
from gpattn.models import Transformer
from gpattn.training import (
    Callback,
    CheckpointError,
    ensemble_probabilities,
    evaluate,
    member_seed,
    train_ensemble,
    train_model,
)


# -- the seed rule ---------------------------------------------------------------------------------------------------
def test_member_seeds_are_seed_times_size_plus_member():
    assert [member_seed(3, k, 4) for k in range(4)] == [12, 13, 14, 15]
    assert member_seed(7, 0, 1) == 7  # a single model keeps its seed


def test_member_seeds_of_different_ensembles_never_coincide():
    for size in (1, 2, 3, 5):
        seeds = [member_seed(seed, k, size) for seed in range(50) for k in range(size)]
        assert len(set(seeds)) == len(seeds) and sorted(seeds) == list(range(50 * size))


def test_member_outside_the_ensemble_is_refused():
    with pytest.raises(ValueError, match="member"):
        member_seed(0, 2, 2)
    with pytest.raises(ValueError, match="size"):
        member_seed(0, 0, 0)


def test_member_seeds_outside_torchs_range_are_refused_with_the_range_of_seeds():
    # torch.manual_seed takes [-2**63, 2**64 - 1]; the largest and smallest seeds an ensemble of 3 can take
    largest, smallest = (2**64 - 1 - 2) // 3, -(2**63 // 3)
    assert 2**64 - 4 <= member_seed(largest, 2, 3) <= 2**64 - 1
    assert member_seed(smallest, 0, 3) >= -(2**63)
    torch.Generator().manual_seed(member_seed(largest, 2, 3))
    torch.Generator().manual_seed(member_seed(smallest, 0, 3))
    for seed in (largest + 1, smallest - 1):
        with pytest.raises(ValueError, match=f"from {smallest} to {largest}"):
            member_seed(seed, 2 if seed > 0 else 0, 3)
        with pytest.raises((RuntimeError, ValueError)):  # what torch says without the check
            torch.Generator().manual_seed(seed * 3 + (2 if seed > 0 else 0))


def test_members_are_built_and_trained_under_their_seeds(data, small_model, small_config):
    built = {}

    def make_model(k: int) -> Transformer:
        model = small_model("softmax", seed=None)  # under the seed train_ensemble set
        built[k] = {name: value.clone() for name, value in model.state_dict().items()}
        return model

    members = train_ensemble(make_model, data.train, data.val, small_config(seed=4), 3)
    for k, (model, result) in enumerate(members):
        seed = member_seed(4, k, 3)
        reference = small_model("softmax", seed=seed)  # built right after torch.manual_seed(seed)
        assert all(torch.equal(built[k][name], value) for name, value in reference.state_dict().items())
        expected = train_model(reference, data.train, data.val, small_config(seed=seed))  # and trained with that seed
        assert result.history[0]["val_nll"] == expected.history[0]["val_nll"]
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))


def test_a_factory_that_returns_no_model_names_the_member(data, small_config):
    # was a raw AttributeError from inside the loop
    with pytest.raises(
        TypeError, match=r"^train_ensemble: expected make_model\(0\) to return a torch\.nn\.Module \(memb"
    ):
        train_ensemble(lambda k: None, data.train, data.val, small_config(), 2)


def test_a_factory_that_returns_an_earlier_member_or_its_parameters_is_refused(data, small_model, small_config):
    # make_model=lambda k: model trained one model K times in a row and returned it K times (an "ensemble" of
    # identical members, each history that of a further run of the same model), without a word
    model = small_model("softmax")
    with pytest.raises(ValueError, match=r"make_model\(1\) returned a model sharing parameters with member 0"):
        train_ensemble(lambda k: model, data.train, data.val, small_config(epochs=1), 2)
    members = {}

    def make_model(k):  # members 0 and 1 independent, member 2 built around member 0's layers
        members[k] = small_model("softmax", seed=k) if k < 2 else torch.nn.Sequential(members[0])
        return members[k]

    with pytest.raises(ValueError, match=r"make_model\(2\) returned a model sharing parameters with member 0"):
        train_ensemble(make_model, data.train, data.val, small_config(epochs=1), 3)


def test_a_single_callback_not_in_a_list_is_refused(data, small_model, small_config):
    with pytest.raises(TypeError, match=r"^train_ensemble: expected callbacks to be a list of Callbacks, got a single"):
        train_ensemble(lambda k: small_model(), data.train, data.val, small_config(), 2, callbacks=Callback())


# -- checkpoints -----------------------------------------------------------------------------------------------------
def test_members_write_their_own_checkpoints(data, tmp_path, small_model, small_config):
    train_ensemble(
        lambda k: small_model("softmax"), data.train, data.val, small_config(checkpoint_dir=tmp_path / "two"), 2
    )
    assert sorted(path.name for path in (tmp_path / "two").iterdir()) == ["member_0", "member_1"]
    assert all((tmp_path / "two" / f"member_{k}" / "last.pt").is_file() for k in range(2))
    train_ensemble(
        lambda k: small_model("softmax"), data.train, data.val, small_config(checkpoint_dir=tmp_path / "one"), 1
    )
    assert sorted(path.name for path in (tmp_path / "one").iterdir()) == ["best.pt", "checkpoints.json", "last.pt"]


def test_resuming_an_ensemble_of_another_size_names_the_sizes(data, tmp_path, small_model, small_config):
    # the seeds s K + k of another size differ: the error named only the seed
    def make_model(k: int):
        return small_model("softmax", seed=None)

    config = small_config(epochs=1, seed=1, checkpoint_dir=tmp_path / "three")
    train_ensemble(make_model, data.train, data.val, config, 3)
    match = r"seed \(3 in the checkpoint, 2 now\).*written by an ensemble of at least 3 members, but size=2 now"
    with pytest.raises(CheckpointError, match=match):
        train_ensemble(make_model, data.train, data.val, config, 2, resume=True)
    with pytest.raises(FileNotFoundError, match=r"an ensemble of at least 3 members, but size=1 now"):
        train_ensemble(make_model, data.train, data.val, config, 1, resume=True)
    assert len(train_ensemble(make_model, data.train, data.val, config, 3, resume=True)) == 3  # the same size resumes
    single = small_config(epochs=1, seed=1, checkpoint_dir=tmp_path / "one")
    train_ensemble(make_model, data.train, data.val, single, 1)
    with pytest.raises(
        FileNotFoundError, match=r"holds the checkpoints of a single model, .*but size=2 now: resume wi"
    ):
        train_ensemble(make_model, data.train, data.val, single, 2, resume=True)


def test_an_ensemble_interrupted_before_a_member_finished_an_epoch_resumes(tmp_path, small_model, small_config):
    # Ctrl-C in member 1's first epoch leaves member_1/ without a checkpoint: resume=True raised FileNotFoundError
    # ("train once with resume=False"), which would train member 0 again
    class Interrupt(Callback):
        steps = 0

        def on_step_end(self, context, epoch, step, values):
            self.steps += 1
            if self.steps == context.steps_per_epoch + 1:  # member 1's first step
                raise KeyboardInterrupt

    def make_model(k: int):
        return small_model("softmax", seed=None)

    data = make_pointer_task(64, 16, 16, length=6, seed=0, vocab_size=6)  # 2 steps an epoch (the models of small_model)
    config = small_config(epochs=1, batch_size=32, checkpoint_dir=tmp_path / "run")
    with pytest.raises(KeyboardInterrupt):
        train_ensemble(make_model, data.train, data.val, config, 2, callbacks=[Interrupt()])
    assert not (tmp_path / "run" / "member_1" / "last.pt").exists()
    [_, (model, result)] = train_ensemble(make_model, data.train, data.val, config, 2, resume=True)
    torch.manual_seed(member_seed(0, 1, 2))  # member 1 of the uninterrupted run
    reference = make_model(1)
    expected = train_model(reference, data.train, data.val, small_config(epochs=1, batch_size=32, seed=1))
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values(), strict=True)
    )
    assert [r["val_nll"] for r in result.history] == [r["val_nll"] for r in expected.history]
    with pytest.raises(FileNotFoundError, match=r"member_0/last\.pt"):  # nothing at all to resume: still an error
        train_ensemble(make_model, data.train, data.val, small_config(checkpoint_dir=tmp_path / "none"), 2, resume=True)


# -- predictions -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["softmax", "kep_svgp"])
def test_ensemble_averages_member_probabilities(data, attention, small_model, small_config):
    members = train_ensemble(
        lambda k: small_model(attention, seed=100 + k), data.train, data.val, small_config(epochs=1), 2
    )
    models = [model for model, _ in members]
    assert len(members) == 2
    assert not all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True))
    torch.manual_seed(5)
    probabilities = ensemble_probabilities(models, data.test, num_samples=3)
    torch.manual_seed(5)
    expected = torch.stack([evaluate(model, data.test, num_samples=3) for model in models]).mean(dim=0)
    assert probabilities.shape == (len(data.test), 2)
    torch.testing.assert_close(probabilities.sum(dim=-1), torch.ones(len(data.test)))
    assert torch.equal(probabilities, expected)
