"""PPO's critic in the torch backend: GAE, whitening and the value loss by hand, a critic rank's step, its
checkpoint, the hand-over of advantages to the actor, and the parse-time refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_torch_backend import hf_dir, make_args, make_batch, sequence_log_probs, start  # noqa: F401  (a fixture)

from slime.data.checkpoint import critic_arguments
from slime.plugins import torch_critic
from slime.plugins.torch_backend import TorchTrainRayActor
from slime.utils.arguments import parse_args

VALUES = torch.tensor([0.5, 0.2, 0.8])


@pytest.mark.parametrize(
    ("mask", "gamma", "lambd", "advantages", "returns"),
    [
        # lambda 1, no discount: the reward minus each token's value; every return is the reward.
        ((1, 1, 1), 1.0, 1.0, (0.5, 0.8, 0.2), (1.0, 1.0, 1.0)),
        # lambda 0: the one-step TD error V_{t+1} - V_t, the reward on the last token.
        ((1, 1, 1), 1.0, 0.0, (-0.3, 0.6, 0.2), (0.2, 0.8, 1.0)),
        # A discount of 0.5: the Monte-Carlo return 0.5^(2 - t) minus the value.
        ((1, 1, 1), 0.5, 1.0, (-0.25, 0.3, 0.2), (0.25, 0.5, 1.0)),
        # The middle token is tool output: skipped, and 0.
        ((1, 0, 1), 1.0, 0.0, (0.3, 0.0, 0.2), (0.8, 0.0, 1.0)),
    ],
)
def test_gae_by_hand(mask, gamma, lambd, advantages, returns) -> None:
    got_advantages, got_returns = torch_critic.gae(1.0, VALUES, torch.tensor(mask, dtype=torch.float32), gamma, lambd)
    assert torch.allclose(got_advantages, torch.tensor(advantages), atol=1e-6)
    assert torch.allclose(got_returns, torch.tensor(returns), atol=1e-6)


def test_whitening_spans_every_rank_and_leaves_masked_tokens_at_zero() -> None:
    advantages = [torch.tensor([1.0, 3.0]), torch.tensor([5.0, 100.0])]
    masks = [torch.ones(2), torch.tensor([1.0, 0.0])]
    # Another rank holds one counted token of advantage 7: the mean over 1, 3, 5, 7 is 4, the std sqrt(5).
    other_rank = torch.tensor([7.0, 49.0, 1.0], dtype=torch.float64)
    whitened = torch_critic.whiten(advantages, masks, lambda totals: totals + other_rank)
    scale = 5.0**0.5
    assert torch.allclose(whitened[0], torch.tensor([-3.0, -1.0]) / scale)
    assert torch.allclose(whitened[1], torch.tensor([1.0 / scale, 0.0]))
    equal = torch_critic.whiten([torch.ones(3)], [torch.ones(3)], lambda totals: totals)
    assert torch.equal(equal[0], torch.zeros(3))


def test_the_value_loss_clips_a_value_that_moved_too_far() -> None:
    values = torch.tensor([[1.0, 0.5, 2.0]])
    old = torch.tensor([[0.0, 0.4, 0.0]])
    returns = torch.tensor([[0.0, 1.0, 3.0]])
    loss, clipped = torch_critic.value_loss(values, old, returns, torch.tensor([[1.0, 1.0, 0.0]]), value_clip=0.2)
    # Token 0 moved 1.0 from its old value away from the return: the unclipped error (1.0) is the larger.
    # Token 1 moved 0.1, inside the range: both branches equal. Token 2 is masked out.
    assert torch.allclose(loss, torch.tensor([[0.5, 0.125, 0.0]]))
    assert clipped.tolist() == [[0.0, 0.0, 0.0]]
    # Moving towards the return but past the range: the clipped branch (still far from it) is the larger.
    loss, clipped = torch_critic.value_loss(values[:, 2:], old[:, 2:], returns[:, 2:], torch.ones(1, 1), 0.2)
    assert loss.item() == pytest.approx(0.5 * 2.8**2) and clipped.item() == 1.0


def test_an_actor_rank_refuses_advantages_of_other_samples() -> None:
    result = {"partition": [0, 1], "advantages": [[0.1], [0.2]], "critic/value_loss": 0.5}
    advantages, metrics = torch_critic.critic_advantages(result, [0, 1], rank=0)
    assert [a.tolist() for a in advantages] == [[pytest.approx(0.1)], [pytest.approx(0.2)]]
    assert metrics == {"critic/value_loss": 0.5}
    with pytest.raises(RuntimeError, match="critic rank 1 trained on samples"):
        torch_critic.critic_advantages(result, [2, 3], rank=1)
    with pytest.raises(ValueError, match="critic rank 0 returned no advantages"):
        torch_critic.critic_advantages({"critic/value_loss": 0.5}, [0, 1], rank=0)


def _critic(model_dir: Path, tmp_path: Path, **overrides) -> tuple[TorchTrainRayActor, int]:
    """A critic rank with the args its group gets (`critic_arguments`: save and load under critic/)."""
    actor = TorchTrainRayActor(world_size=1, rank=0)
    first = actor.init(critic_arguments(make_args(model_dir, tmp_path, use_critic=True, **overrides)), "critic")
    return actor, first


def _batch() -> dict:
    data = make_batch()
    data["partition"] = [0, 1, 2, 3]
    return data


def test_a_critic_rank_fits_its_values_to_the_returns_and_hands_over_advantages(hf_dir, tmp_path):  # noqa: F811
    critic, first = _critic(hf_dir, tmp_path, lr=3e-3)
    assert first == 0 and critic.ref_model is None
    assert critic.model.config.num_labels == 1  # a value head, not the LM head
    results = [critic.train_from_data(step, _batch()) for step in range(15)]
    assert results[-1]["critic/value_loss"] < 0.5 * results[0]["critic/value_loss"]
    assert results[0]["partition"] == [0, 1, 2, 3] and len(results[0]["advantages"]) == 4
    flat = torch.tensor([value for sample in results[0]["advantages"] for value in sample])
    assert abs(flat.mean().item()) < 1e-5 and flat.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-4)
    # Rewarded answers (1, 0, 1, 0) get higher advantages once the values have learned the mean reward.
    last = [sum(sample) for sample in results[-1]["advantages"]]
    assert last[0] > last[1] and last[2] > last[3]

    # The actor trains on them: its policy's rewarded answers become more likely.
    actor, _ = start(make_args(hf_dir, tmp_path / "actor"))
    data = _batch()
    advantages, metrics = torch_critic.critic_advantages(results[-1], data["partition"], rank=0)
    data["advantages"] = advantages
    before = sequence_log_probs(actor, data)
    assert actor.train_from_data(0, data)["train/steps"] == 1.0
    after = sequence_log_probs(actor, data)
    assert (after[[0, 2]] - before[[0, 2]]).min() > (after[[1, 3]] - before[[1, 3]]).max()
    assert set(metrics) >= {"critic/value_loss", "critic/value_clipfrac", "critic/values", "critic/grad_norm"}


def test_the_critic_checkpoint_lives_under_critic_and_resumes_where_it_left_off(hf_dir, tmp_path):  # noqa: F811
    save = tmp_path / "save"
    critic, _ = _critic(hf_dir, tmp_path, save=str(save))
    for step in range(2):
        critic.train_from_data(step, _batch())
    critic.save_model(1)
    assert (save / "critic" / "iter_0000001" / "config.json").is_file()
    assert not (save / "iter_0000001").exists()  # the policy's part is the actor's to write
    following = critic.train_from_data(2, _batch())

    resumed, first = _critic(hf_dir, tmp_path, save=str(save), load=str(save))
    assert first == 2
    again = resumed.train_from_data(2, _batch())
    # The same weights, optimizer moments and schedule: the next step as if never interrupted (to float rounding:
    # CPU kernels need not sum in the same order in a new process layout).
    assert again["critic/value_loss"] == pytest.approx(following["critic/value_loss"], rel=1e-6)
    for got, want in zip(again["advantages"], following["advantages"], strict=True):
        assert got == pytest.approx(want, abs=1e-5)


def test_the_critic_group_saves_and_loads_under_critic_of_the_runs_directories(tmp_path: Path) -> None:
    args = make_args(tmp_path / "model", tmp_path, load=str(tmp_path / "parent"))
    critic_args = critic_arguments(args)
    assert (critic_args.save, critic_args.load) == (
        str(tmp_path / "save" / "critic"),
        str(tmp_path / "parent" / "critic"),
    )
    assert (args.save, args.load) == (str(tmp_path / "save"), str(tmp_path / "parent"))  # the run's own, unchanged
    assert critic_arguments(make_args(tmp_path, tmp_path, load=None)).load is None


def test_parse_time_refusals_name_the_flags(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    base = ["--plugin", "straw", "--save", str(tmp_path / "r"), "--advantage-estimator", "ppo", "--use-critic"]
    args = parse_args([*base, "--gamma", "0.99", "--lambd", "0.95", "--critic-lr", "1e-4"])
    settings = torch_critic.CriticSettings.from_args(args)
    assert (settings.gamma, settings.lambd, settings.value_clip, settings.critic_lr) == (0.99, 0.95, 0.2, 1e-4)
    for flags, message in [
        (("--critic-num-gpus-per-node", "2"), "--use-critic with 2 critic ranks"),
        (("--lambd", "1.5"), "--lambd (1.5) must be in [0, 1]"),
        (("--value-clip", "0"), "--value-clip must be > 0.0, got 0.0"),
        (("--train-backend", "megatron"), "--use-critic: the megatron backend trains the policy only"),
    ]:
        with pytest.raises(SystemExit):
            parse_args([*base, *flags])
        assert message in capsys.readouterr().err, flags
