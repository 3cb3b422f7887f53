"""Role-level GRPO advantages, row building per variant/layout, logprobs and the PPO loss.

Expected numbers are worked out by hand in the comments (and in docs/algorithms.md).
"""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from envace.algorithms import ADVANTAGES, Row, build_rows, collate, group_metrics, ppo_loss, ppo_token_loss, sequence_logprobs
from envace.training.variants import VARIANTS
from envace.types import Role, Trajectory, Turn

P, A, R, E, U = Role.PROMPT, Role.ACT, Role.REHEARSE, Role.ENV, Role.USER


def traj(spans, reward, side_rows=(), group=0) -> Trajectory:
    """spans: (role, token ids); sampled spans get logprob -1.0 per token."""
    turns = [Turn(role, list(ids), [-1.0] * len(ids) if role in (A, R) else None) for role, ids in spans]
    return Trajectory("t", "rehearse", turns, reward=reward, side_rows=list(side_rows), group=group)


def worked_example(malformed_act_of_one: int | None = None):
    """K=2. Rollout 1 (R=1): 3 ACT + 2 REHEARSE outputs. Rollout 2 (R=0): 1 ACT, no REHEARSE."""
    one = traj([(P, [1, 2]), (A, [3, 4]), (R, [5]), (A, [6]), (R, [7, 8]), (A, [9])], 1.0)
    two = traj([(P, [1, 2]), (A, [10, 11])], 0.0, group=1)
    if malformed_act_of_one is not None:
        one.outputs(A)[malformed_act_of_one].malformed = True
    return [one, two]


def tiny_model(seed=0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    return LlamaForCausalLM(LlamaConfig(**(cfg | overrides))).eval()


# ---- advantages ---------------------------------------------------------------------------


def test_role_grpo_worked_example():
    (group,) = ADVANTAGES.get("role_grpo")([worked_example()])
    one, two = group.trajectories
    # mu_act = (3*1 + 1*0) / 4 = 0.75 -> rollout 1: 1 - 0.75 = +0.25, rollout 2: 0 - 0.75 = -0.75
    assert one.outputs[A] == [0.25, 0.25, 0.25]
    assert two.outputs[A] == [-0.75]
    # mu_rehearse = (1 + 1) / 2 = 1 -> 0 for both outputs; rollout 2 has none
    assert one.outputs[R] == [0.0, 0.0]
    assert two.outputs[R] == []
    assert group.baseline == {A: 0.75, R: 1.0}
    assert group.num_outputs == {A: 4, R: 2}
    # per token, aligned with token_ids: PROMPT 0, each span its output's advantage
    assert one.tokens == [0, 0, 0.25, 0.25, 0, 0.25, 0, 0, 0.25]
    assert two.tokens == [0, 0, -0.75, -0.75]


def test_role_grpo_std_normalisation():
    (group,) = ADVANTAGES.get("role_grpo")([worked_example()], normalize_std=True)
    one, two = group.trajectories
    # ACT rewards [1, 1, 1, 0]: std = sqrt((3 * 0.25^2 + 0.75^2) / 4) = sqrt(3) / 4
    assert group.std[A] == pytest.approx(math.sqrt(3) / 4)
    assert one.outputs[A] == pytest.approx([1 / math.sqrt(3)] * 3, rel=1e-5)  # 0.25 / (sqrt(3)/4)
    assert two.outputs[A] == pytest.approx([-math.sqrt(3)], rel=1e-5)  # -0.75 / (sqrt(3)/4)
    assert one.outputs[R] == [0.0, 0.0]  # std 0 -> 0 / eps stays 0


def test_plain_grpo_uses_trajectory_mean():
    (group,) = ADVANTAGES.get("grpo")([worked_example()])
    one, two = group.trajectories
    # mu = (1 + 0) / 2 = 0.5 for every role
    assert one.outputs[A] == [0.5, 0.5, 0.5] and one.outputs[R] == [0.5, 0.5]
    assert two.outputs[A] == [-0.5]


def test_penalty_hits_the_flagged_outputs():
    # a malformed middle output (on_malformed="continue")
    (adv,) = ADVANTAGES.get("role_grpo")([worked_example(malformed_act_of_one=1)], penalty=-0.1)
    one, two = adv.trajectories
    # ACT rewards [1, 0.9 (malformed), 1, 0]: mu = 2.9 / 4 = 0.725
    assert one.outputs[A] == pytest.approx([0.275, 0.175, 0.275])
    assert two.outputs[A] == pytest.approx([-0.725])
    assert one.outputs[R] == [0.0, 0.0]  # REHEARSE unaffected
    assert one.tokens == pytest.approx([0, 0, 0.275, 0.275, 0, 0.175, 0, 0, 0.275])


def test_penalty_hits_a_flagged_side_row_output():
    """Isolated layout: the malformed rehearsal is a side row's output."""
    side = traj([(P, [20, 21]), (R, [22])], 1.0)
    side.turns[-1].malformed = True
    one = traj([(P, [1, 2]), (A, [3])], 1.0, side_rows=[side])
    two = traj([(P, [1, 2]), (A, [4])], 1.0, side_rows=[traj([(P, [20, 21]), (R, [23])], 1.0)], group=1)
    (adv,) = ADVANTAGES.get("role_grpo")([[one, two]], penalty=-0.5)
    # REHEARSE rewards [0.5 (malformed), 1]: mu = 0.75
    assert adv.trajectories[0].outputs[R] == pytest.approx([-0.25]) and adv.trajectories[1].outputs[R] == pytest.approx([0.25])


def test_missing_reward_is_an_error():
    group = worked_example()
    group[1].reward = None
    with pytest.raises(ValueError, match="no reward"):
        ADVANTAGES.get("role_grpo")([group])


def test_equal_rewards_give_zero_advantage_and_zero_gradient():
    group = worked_example()
    for t in group:
        t.reward = 0.3  # 0.3 is inexact in binary: the baseline must still cancel exactly
    (adv,) = ADVANTAGES.get("role_grpo")([group], normalize_std=True)
    assert adv.degenerate
    assert all(a == 0.0 for t in adv.trajectories for a in t.tokens)
    assert group_metrics([adv])["groups/degenerate_frac"] == 1.0

    model = tiny_model()
    batch = collate(build_rows(group, adv.trajectories, VARIANTS.get("envace").trained_roles["policy"]), pad_id=0)
    logprobs, _ = sequence_logprobs(model, batch)
    loss, _ = ppo_loss(logprobs, batch.old_logprobs, batch.advantages, batch.loss_mask)
    loss.backward()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_group_metrics():
    groups = ADVANTAGES.get("role_grpo")([worked_example(malformed_act_of_one=2)], penalty=-0.1)
    metrics = group_metrics(groups)
    assert metrics["reward/act"] == pytest.approx(0.725)
    assert metrics["reward/rehearse"] == 1.0
    assert metrics["outputs/act"] == 4 and metrics["outputs/rehearse"] == 2
    assert metrics["groups/degenerate_frac"] == 0.0


# ---- PPO loss -----------------------------------------------------------------------------

# (ratio, advantage) -> per-token loss = -min(ratio*A, clip(ratio, 0.8, 1.2)*A)
RATIOS = [1.5, 0.5, 1.1, 0.5, 5.0]
ADVS = [1.0, 1.0, -2.0, -1.0, -1.0]
# 1.5,+1 -> -1.2 (clipped) | 0.5,+1 -> -0.5 | 1.1,-2 -> 2.2 | 0.5,-1 -> 0.8 (clipped) | 5,-1 -> 5.0
EXPECTED = [-1.2, -0.5, 2.2, 0.8, 5.0]


def ppo_inputs():
    logprobs = torch.tensor([RATIOS]).log().requires_grad_()
    return logprobs, torch.zeros(1, 5), torch.tensor([ADVS]), torch.ones(1, 5)


def test_ppo_token_loss_hand_computed():
    logprobs, old, adv, _ = ppo_inputs()
    loss, clipped = ppo_token_loss(logprobs, old, adv)
    assert loss[0].tolist() == pytest.approx(EXPECTED)
    assert clipped[0].tolist() == [True, False, False, True, False]
    loss, clipped = ppo_token_loss(logprobs, old, adv, dual_clip=3.0)
    # dual clip caps the A<0 loss at -c*A = 3: 5.0 -> 3.0; the others are unchanged
    assert loss[0].tolist() == pytest.approx([-1.2, -0.5, 2.2, 0.8, 3.0])
    assert clipped[0].tolist() == [True, False, False, True, True]


def test_ppo_loss_token_mean_and_gradient():
    logprobs, old, adv, mask = ppo_inputs()
    loss, metrics = ppo_loss(logprobs, old, adv, mask)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 2.2 + 0.8 + 5.0) / 5)  # 1.26
    assert metrics["clip_frac"] == pytest.approx(0.4)
    loss.backward()
    # d/dlogp of -ratio*A/5 = -ratio*A/5 where unclipped, 0 where clipped
    assert logprobs.grad[0].tolist() == pytest.approx([0.0, -0.1, 0.44, 0.0, 1.0])

    logprobs.grad = None
    loss, metrics = ppo_loss(logprobs, old, adv, mask, dual_clip=3.0)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 2.2 + 0.8 + 3.0) / 5)  # 0.86
    assert metrics["clip_frac"] == pytest.approx(0.6)
    loss.backward()
    assert logprobs.grad[0].tolist() == pytest.approx([0.0, -0.1, 0.44, 0.0, 0.0])


def test_ppo_loss_token_mean_over_mixed_roles():
    # Row 1: three ACT tokens with A=+1; row 2: one REHEARSE token with A=-3; ratio 1 -> loss -A.
    roles = torch.tensor([[P, A, A, A], [P, R, 0, 0]])
    mask = torch.tensor([[0.0, 1, 1, 1], [0, 1, 0, 0]])
    adv = torch.tensor([[0.0, 1, 1, 1], [0, -3, 0, 0]])
    lp = torch.full((2, 4), -1.0)
    loss, metrics = ppo_loss(lp, lp, adv, mask, roles=roles, entropy=torch.full((2, 4), 2.0))
    # token mean: (-1 - 1 - 1 + 3) / 4 = 0 (a mean of role means would give (-1 + 3) / 2 = 1)
    assert loss.item() == pytest.approx(0.0)
    assert metrics["tokens"] == 4 and metrics["tokens/act"] == 3 and metrics["tokens/rehearse"] == 1
    assert metrics["adv/act"] == 1.0 and metrics["adv/rehearse"] == -3.0 and metrics["adv"] == 0.0
    assert metrics["entropy/act"] == 2.0 and metrics["approx_kl"] == 0.0 and metrics["clip_frac/rehearse"] == 0.0
    # micro-batches of one step: divide by the step's token count instead of this batch's. The
    # three ACT tokens sum to -3: over the step's 8 tokens -3/8 (this batch's 3 would give -1).
    act_share, _ = ppo_loss(lp, lp, adv, mask * (roles == A), num_tokens=8)
    assert act_share.item() == pytest.approx(-0.375)
    only_act, metrics = ppo_loss(lp, lp, adv, mask * (roles == A), roles=roles)
    assert only_act.item() == pytest.approx(-1.0)
    assert metrics["tokens/rehearse"] == 0 and "adv/rehearse" not in metrics


def test_ppo_loss_reference_kl():
    lp = torch.tensor([[0.0, math.log(0.5)]])
    ref = torch.tensor([[0.0, math.log(0.25)]])
    mask = torch.tensor([[0.0, 1.0]])
    zero = torch.zeros(1, 2)
    # k3 with log_ratio = log(0.25/0.5): 0.5 - 1 - log(0.5) = 0.193147
    loss, metrics = ppo_loss(lp, lp, zero, mask, ref_logprobs=ref, kl_coef=0.1)
    assert loss.item() == pytest.approx(0.1 * (0.5 - 1 - math.log(0.5)))
    assert metrics["ref_kl"] == pytest.approx(0.5 - 1 - math.log(0.5))
    with pytest.raises(ValueError, match="ref_logprobs"):
        ppo_loss(lp, lp, zero, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_loss(lp, lp, zero, mask, dual_clip=0.5)


# ---- rows: variants and layouts -------------------------------------------------------------

# One span of every role: PROMPT, ACT, REHEARSE, ACT, ENV, USER, ACT
ALL_ROLES = [(P, [1, 2]), (A, [3]), (R, [4]), (A, [5]), (E, [6]), (U, [7]), (A, [8])]
#                              P  P  A  R  A  E  U  A
EXPECTED_MASKS = {
    "envace": {"policy": [0, 0, 1, 1, 1, 0, 0, 1]},
    "act-only": {"policy": [0, 0, 1, 0, 1, 0, 0, 1]},
    "real-grpo": {"policy": [0, 0, 1, 0, 1, 0, 0, 1]},
    "simulator": {"policy": [0, 0, 1, 0, 1, 0, 0, 1]},
    "no-share": {"policy": [0, 0, 1, 0, 1, 0, 0, 1], "rehearser": [0, 0, 0, 1, 0, 0, 0, 0]},
}


@pytest.mark.parametrize("variant", sorted(EXPECTED_MASKS))
def test_variant_masks(variant):
    group = [traj(ALL_ROLES, 1.0), traj([(P, [1, 2]), (A, [9]), (R, [9])], 0.0, group=1)]
    (adv,) = ADVANTAGES.get("role_grpo")([group])
    assert VARIANTS.get(variant).trained_roles.keys() == EXPECTED_MASKS[variant].keys()
    for model, roles in VARIANTS.get(variant).trained_roles.items():
        row = build_rows(group[:1], adv.trajectories[:1], roles)[0]
        assert row.loss_mask == EXPECTED_MASKS[variant][model]
        assert row.roles == [int(r) for r, ids in ALL_ROLES for _ in ids]


def test_rows_without_trained_tokens_are_dropped():
    group = [traj([(P, [1, 2]), (A, [3])], 1.0), traj([(P, [1, 2]), (A, [4])], 0.0, group=1)]
    (adv,) = ADVANTAGES.get("role_grpo")([group])
    assert build_rows(group, adv.trajectories, (Role.REHEARSE,)) == []


def rollout(layout, reward, act, reh, act2, group):
    """One rollout in either layout. Transcript: the REHEARSE span sits in the agent's sequence.
    Isolated: the agent's sequence holds it as ENV and a side row (context = the same prefix,
    tagged PROMPT) holds the sampled REHEARSE span."""
    prefix = [1, 2, 3]
    if layout == "transcript":
        return traj([(P, prefix), (A, act), (R, reh), (A, act2)], reward, group=group)
    side = traj([(P, prefix + act), (R, reh)], reward)
    return traj([(P, prefix), (A, act), (E, reh), (A, act2)], reward, side_rows=[side], group=group)


def layouts():
    return {
        layout: [rollout(layout, 1.0, [4, 5], [6, 7, 8], [9], 0), rollout(layout, 0.0, [10], [11, 12], [13], 1)]
        for layout in ("transcript", "isolated")
    }


def test_layouts_give_identical_per_token_loss():
    roles = VARIANTS.get("envace").trained_roles["policy"]
    model = tiny_model()
    per_layout = {}
    for layout, group in layouts().items():
        (adv,) = ADVANTAGES.get("role_grpo")([group])
        batch = collate(build_rows(group, adv.trajectories, roles, layout=layout), pad_id=0)
        with torch.no_grad():
            logprobs, _ = sequence_logprobs(model, batch)
        loss, _ = ppo_token_loss(logprobs, batch.old_logprobs, batch.advantages)
        trained = batch.loss_mask > 0
        per_layout[layout] = {
            role: (loss[trained & (batch.roles == role)], batch.advantages[trained & (batch.roles == role)]) for role in (A, R)
        }
    transcript, isolated = per_layout["transcript"], per_layout["isolated"]
    # one REHEARSE output per rollout (baselines count outputs, not tokens): mu = (1 + 0) / 2 = 0.5
    # -> +0.5 on each of rollout 1's 3 tokens, -0.5 on each of rollout 2's 2 tokens
    assert isolated[R][1].tolist() == transcript[R][1].tolist() == [0.5] * 3 + [-0.5] * 2
    assert len(isolated[A][0]) == 5
    for role in (A, R):
        torch.testing.assert_close(transcript[role][0], isolated[role][0])
    assert isolated[R][0].abs().min() > 0  # a nonzero loss was compared


def test_layout_mismatch_is_an_error():
    for layout, group in layouts().items():
        (adv,) = ADVANTAGES.get("role_grpo")([group])
        wrong = "isolated" if layout == "transcript" else "transcript"
        with pytest.raises(ValueError, match="layout"):
            build_rows(group, adv.trajectories, (A, R), layout=wrong)


def test_collate_right_pads():
    group = [traj([(P, [1, 2]), (A, [3, 4, 5])], 1.0), traj([(P, [1, 2]), (A, [6])], 0.0, group=1)]
    (adv,) = ADVANTAGES.get("role_grpo")([group])
    batch = collate(build_rows(group, adv.trajectories, (A,)), pad_id=99)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5], [1, 2, 6, 99, 99]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0]]
    assert batch.advantages.tolist() == [[0, 0, 0.5, 0.5, 0.5], [0, 0, -0.5, 0, 0]]
    assert batch.roles.tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0]]
    assert batch.old_logprobs.tolist() == [[0, 0, -1, -1, -1], [0, 0, -1, 0, 0]]


# ---- sequence_logprobs ----------------------------------------------------------------------


def reference_logprobs(model, batch):
    """Straightforward: full logits, log-softmax, pick token t from position t-1."""
    logp = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float().log_softmax(-1)
    picked = logp[:, :-1].gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)[:, :-1]
    return picked, entropy


def random_batch(lengths, seed):
    """Random token rows of the given lengths, right-padded by `collate`."""
    g = torch.Generator().manual_seed(seed)
    rows = [Row(torch.randint(1, 128, (n,), generator=g).tolist(), [0] * n, [0.0] * n, [0.0] * n, [0.0] * n) for n in lengths]
    return collate(rows, pad_id=0)


@pytest.mark.parametrize("tied", [False, True])
def test_sequence_logprobs_matches_per_token_computation(tied):
    model = tiny_model(tie_word_embeddings=tied)
    batch = random_batch([9, 6], seed=1)
    chunked, entropy = sequence_logprobs(model, batch, chunk_size=3)  # 8 predicted positions: chunks 3+3+2
    expected, expected_entropy = reference_logprobs(model, batch)
    valid = batch.attention_mask[:, 1:].bool()
    assert chunked[:, 0].eq(0).all()
    torch.testing.assert_close(chunked[:, 1:][valid], expected[valid])
    torch.testing.assert_close(entropy[:, 1:][valid], expected_entropy[valid])
    # gradients through the checkpointed chunks equal those of the plain computation
    grads = []
    for lp in (chunked[:, 1:], expected):
        model.zero_grad()
        lp[valid].sum().backward(retain_graph=True)
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_sequence_logprobs_through_peft():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    batch = random_batch([6], seed=2)
    with torch.no_grad():
        chunked, _ = sequence_logprobs(model, batch, chunk_size=2)
        expected, _ = reference_logprobs(model, batch)
        with model.disable_adapter():
            base, _ = sequence_logprobs(model, batch, chunk_size=2)
    torch.testing.assert_close(chunked[:, 1:], expected)
    assert not torch.allclose(chunked, base)  # the adapter is on the path that was compared
