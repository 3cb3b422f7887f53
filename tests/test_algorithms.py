"""Role-level GRPO advantages, row building per variant/layout, logprobs and the PPO loss, shared-prefix packing and TIS.

Expected numbers are worked out by hand in the comments (and in docs/algorithms.md).
"""

import contextlib
import math
import types
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from envace.algorithms import ADVANTAGES, Row, build_rows, collate, group_metrics, ppo_loss, ppo_token_loss, sequence_logprobs
from envace.algorithms.losses import (PREFIX_GROUPED_ATTENTION, PackedLayout, PackedRows, forwarded_tokens, pack_shared_prefixes,
                                      prefix_grouped_attention, lockstep_micro_batches, rows_with_signal, shared_prefix_len, unit_rows)
from envace.backends.models import tiny_model as hf_tiny_model
from envace.training.setup import backward_micro_batches, micro_batches
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
    loss, _ = ppo_loss(logprobs, batch.sampler_logprobs, batch.advantages, batch.loss_mask)
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


def test_rows_with_signal_keeps_rows_with_a_nonzero_advantage_on_a_trained_token():
    signal = plain_row([1, 2, 3], 2, adv=0.5)  # A = 0.5 on its one trained token
    zero = plain_row([1, 2, 3], 1, adv=0.0)
    untrained_only = Row([1, 2, 3], [int(P)] * 3, [0.0, 1.0, 1.0], [0.7, 0.0, 0.0], [0.0, -1.0, -1.0])  # A only where nothing trains
    assert rows_with_signal([zero, signal, untrained_only]) == [signal]


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
        loss, _ = ppo_token_loss(logprobs, batch.sampler_logprobs, batch.advantages)
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
    assert batch.sampler_logprobs.tolist() == [[0, 0, -1, -1, -1], [0, 0, -1, 0, 0]]


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


def test_sequence_logprobs_at_a_temperature_are_those_of_the_scaled_logits():
    """At T = 0.5 the logprob of token t is log softmax(logits / 0.5), the distribution a
    tempered rollout drew from, and the entropy is that distribution's."""
    model = tiny_model()
    batch = random_batch([9, 6], seed=1)
    tempered, entropy = sequence_logprobs(model, batch, chunk_size=3, temperature=0.5)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float() / 0.5, dim=-1)
    valid = batch.attention_mask[:, 1:].bool()
    expected = logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(tempered[:, 1:][valid], expected[valid])
    torch.testing.assert_close(entropy[:, 1:][valid], -(logp.exp() * logp).sum(-1)[valid])
    plain, _ = sequence_logprobs(model, batch)
    assert (tempered[:, 1:][valid] - plain[:, 1:][valid]).abs().max() > 1e-3  # far above the 1e-5 tolerance: T is applied


def test_sequence_logprobs_of_a_softcapping_model_are_those_of_its_own_logits():
    """Gemma-style final logit softcapping is applied once: the scores softcap the real logits,
    and the model's own softcap of its head's output is off for the call, then back on."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, final_logit_softcapping=0.5, attn_logit_softcapping=None, sliding_window=64)
    model = Gemma2ForCausalLM(config).eval()
    batch = random_batch([9, 6], seed=1)
    logprobs, _ = sequence_logprobs(model, batch, chunk_size=3)
    expected, _ = reference_logprobs(model, batch)  # the model's forward softcaps its logits itself
    valid = batch.attention_mask[:, 1:].bool()
    torch.testing.assert_close(logprobs[:, 1:][valid], expected[valid])
    assert model.config.final_logit_softcapping == 0.5 and type(model.lm_head) is torch.nn.Linear  # restored


def test_sequence_logprobs_and_gradients_under_fsdp2_sharding_equal_one_unsharded_process(tmp_path):
    """FSDP2 (torch's fully_shard, 2 CPU processes over gloo, each layer and the root sharded and
    resharded after the forward, as accelerate's FSDP2 plugin does) reshards the LM head with the
    root once the forward returns: the head must run inside the forward. Logprobs and full
    gradients, plain and packed rows, tied and untied heads, equal one unsharded process's."""
    import os
    import subprocess
    import sys

    from tests.fsdp_worker import CASES, loss_and_grads

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "fsdp.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", os.path.join(root, "tests", "fsdp_worker.py"), str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    sharded = torch.load(out)
    for name, overrides in CASES.items():
        model = tiny_model(**overrides)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        for packed in (False, True):
            logprobs, grads = loss_and_grads(model, packed)
            got_logprobs, got_grads = sharded[f"{name}/{'packed' if packed else 'plain'}"]
            torch.testing.assert_close(got_logprobs, logprobs)
            assert set(got_grads) == set(grads)
            for key in grads:
                torch.testing.assert_close(got_grads[key], grads[key], msg=f"{name} packed={packed}: {key}")


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


# ---- shared-prefix packing (Prefix Grouper) -------------------------------------------------


def plain_row(ids, trained_from, group=None, adv=1.0, old=-1.0) -> Row:
    n = len(ids)
    mask = [0.0] * trained_from + [1.0] * (n - trained_from)
    return Row(list(ids), [int(P)] * n, mask, [adv * m for m in mask], [old * m for m in mask], prefix_group=group)


def test_build_rows_marks_task_groups():
    one = [traj([(P, [1, 2]), (A, [3])], 1.0), traj([(P, [1, 2]), (A, [4])], 0.0, group=1)]
    two = [traj([(P, [1, 5]), (A, [6])], 1.0), traj([(P, [1, 5]), (A, [7])], 0.0, group=1)]
    for t in two:
        t.task_id = "u"
    trajs = one + two
    advs = [a for g in ADVANTAGES.get("role_grpo")([one, two]) for a in g.trajectories]
    assert [r.prefix_group for r in build_rows(trajs, advs, (A,), group_sizes=[2, 2])] == [0, 0, 1, 1]
    assert [r.prefix_group for r in build_rows(trajs, advs, (A,))] == [0, 0, 1, 1]  # default: runs of equal task_id
    assert [r.prefix_group for r in build_rows(trajs, advs, (A,), group_sizes=[1, 3])] == [0, 1, 1, 1]
    with pytest.raises(ValueError, match="group_sizes"):
        build_rows(trajs, advs, (A,), group_sizes=[2, 1])
    # isolated layout: main rows carry their group, side rows stay unpacked (None)
    group = layouts()["isolated"]
    (adv,) = ADVANTAGES.get("role_grpo")([group])
    rows = build_rows(group, adv.trajectories, (A, R), layout="isolated", group_sizes=[2])
    assert [(r.prefix_group, r.roles.count(int(R)) > 0) for r in rows] == [(0, False), (None, True), (0, False), (None, True)]
    units = pack_shared_prefixes(rows)
    assert isinstance(units[0], PackedRows) and units[0].rows == [rows[0], rows[2]] and units[1:] == [rows[1], rows[3]]


def test_pack_shared_prefixes_cuts_before_trained_tokens():
    a = plain_row([1, 2, 3, 4, 5, 6], 3, group=0)
    b = plain_row([1, 2, 3, 4, 9], 2, group=0)  # common prefix 1 2 3 4, but b trains from index 2
    c = plain_row([1, 2, 3, 4, 7, 7, 7], 4, group=0)
    assert shared_prefix_len([a, b, c]) == 2  # cut before b's first trained token
    assert shared_prefix_len([a, c]) == 3  # cut before a's first trained token
    lone = plain_row([8, 8, 8], 1, group=1)  # a group of one row
    short = [plain_row([5, 1, 1], 1, group=2), plain_row([5, 2, 2], 1, group=2)]  # 1 shared token < min_prefix
    free = plain_row([1, 2, 3, 4], 3)  # no group (SFT rows, side rows)
    rows = [a, free, b, lone, short[0], c, short[1]]
    units = pack_shared_prefixes(rows)
    # the pack takes its group's first place; everything else keeps its order
    assert [type(u).__name__ for u in units] == ["PackedRows", "Row", "Row", "Row", "Row"]
    assert units[0].rows == [a, b, c] and units[0].prefix_len == 2 and units[1:] == [free, lone, *short]
    assert unit_rows(units) == [a, b, c, free, lone, *short]
    assert units[0].length == 2 + 4 + 3 + 5
    # forwarded tokens: 6 + 5 + 7 = 18 as plain rows, 14 packed (the prefix of 2 once, not 3 times)
    assert forwarded_tokens([a, b, c]) == 18 and forwarded_tokens(units[:1]) == 14
    assert pack_shared_prefixes(rows, min_prefix=1)[3] == PackedRows(short, 1)
    assert pack_shared_prefixes(units) == units  # packing twice changes nothing
    with pytest.raises(ValueError, match="trained"):
        PackedRows([a, c], 4)
    with pytest.raises(ValueError, match="prefix"):
        PackedRows([a, plain_row([1, 9, 9, 9], 3)], 2)


def test_prefix_grouped_attention_matches_the_masked_attention_of_each_row():
    """Two packed rows of width 6: [prefix 2 | cont 2 | cont 1 | pad] and a plain row [4 | pad 2];
    GQA with 2 query heads per key/value head. Each token's output and the gradients of q, k and v
    equal dense attention under "key j <= i, in the prefix or in i's own part", and padding outputs 0."""
    layout = PackedLayout(6, ((2, (2, 1)), (0, (4,))))
    assert layout.tokens == 9 and layout.longest_row == 4
    segments = torch.tensor([[0, 0, 1, 1, 2, -1], [1, 1, 1, 1, -1, -1]])  # 0 prefix, k continuation k, -1 padding
    torch.manual_seed(0)
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 6, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out, weights = prefix_grouped_attention(types.SimpleNamespace(num_key_value_groups=2), q, k, v, None, scaling=0.3, packed_layout=layout)
    assert weights is None and out.shape == (2, 6, 4, 8)  # [rows, length, heads, head_dim], as transformers' attention functions
    idx = torch.arange(6)
    query, key = segments[:, :, None], segments[:, None, :]
    allowed = (idx[:, None] >= idx[None, :]) & (key >= 0) & ((key == 0) | (key == query)) & (query >= 0)
    scores = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.3).masked_fill(~allowed[:, None], -torch.inf)
    expected = torch.nan_to_num(scores.softmax(-1)) @ v.repeat_interleave(2, dim=1)  # padding rows: 0
    torch.testing.assert_close(out, expected.transpose(1, 2))
    assert out[0, 5].eq(0).all() and out[1, 4:].eq(0).all()
    grads = torch.autograd.grad(out.sin().sum(), (q, k, v))
    for got, want in zip(grads, torch.autograd.grad(expected.transpose(1, 2).sin().sum(), (q, k, v))):
        torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="packed_layout"):
        prefix_grouped_attention(None, q, k, v, None)
    with pytest.raises(ValueError, match="attention mask"):
        prefix_grouped_attention(None, q, k, v, torch.ones(2, 1, 6, 6, dtype=torch.bool), packed_layout=layout)
    with pytest.raises(ValueError, match="sliding window"):
        prefix_grouped_attention(None, q, k, v, None, packed_layout=layout, sliding_window=3)
    prefix_grouped_attention(types.SimpleNamespace(num_key_value_groups=2), q, k, v, None, packed_layout=layout, sliding_window=4)  # no row is longer
    with pytest.raises(ValueError, match="softcap"):
        prefix_grouped_attention(None, q, k, v, None, packed_layout=layout, softcap=30.0)
    with pytest.raises(ValueError, match="rows of 6"):
        prefix_grouped_attention(None, q[:1], k[:1], v[:1], None, packed_layout=layout)


def test_prefix_grouped_attention_computes_in_fp32_under_cpu_bf16_autocast():
    """Under CPU bf16 autocast the packed attention runs in fp32 (autocast would hand SDPA bf16
    inputs, whose CPU backward is no faster): with q and k in fp32 and v in bf16, as they arrive
    from the rotary embedding and v_proj, its output is fp32 and equals the fp32 attention of the
    same values to fp32 rounding (bf16 inputs would be off by ~1e-2), and each input's gradient
    comes back in that input's dtype."""
    layout = PackedLayout(6, ((2, (2, 1)), (0, (4,))))
    module = types.SimpleNamespace(num_key_value_groups=2)
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 6, 8, requires_grad=True), torch.randn(2, 2, 6, 8, requires_grad=True)
    v = torch.randn(2, 2, 6, 8).bfloat16().requires_grad_()
    reference, _ = prefix_grouped_attention(module, q, k, v.float(), None, packed_layout=layout)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = prefix_grouped_attention(module, q, k, v, None, packed_layout=layout)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference, atol=1e-6, rtol=1e-6)
    out.sum().backward()
    assert (q.grad.dtype, k.grad.dtype, v.grad.dtype) == (torch.float32, torch.float32, torch.bfloat16)


def prompt_groups(tokenizer, k=4):
    """Two tasks with K rollouts each: one prompt per task (PROMPT), then per rollout ACT / ENV /
    ACT spans of different lengths, so the packed rows and their continuations differ in length."""
    groups = []
    for task, request in enumerate(["add 2 to the counter", "read the counter and tell me its value, please"]):
        prompt = tokenizer.encode(f"<|im_start|>system\nYou are a tool agent. Tools: add(x: int), get().<|im_end|>\n<|im_start|>user\n{request}<|im_end|>\n")
        group = []
        for i in range(k):
            spans = [(P, prompt), (A, tokenizer.encode(f"<tool_call>add({i})</tool_call>" + " ok" * i)), (E, tokenizer.encode(f'{{"value": {i}}}')),
                     (A, tokenizer.encode(f"The counter is {i}." + "!" * (2 * i)))]
            t = traj(spans, reward=float(i % 2), group=i)
            t.task_id = f"task-{task}"
            group.append(t)
        groups.append(group)
    return groups


def grouped_rows(tokenizer, k=4, extra_plain=True):
    groups = prompt_groups(tokenizer, k)
    advs = [a for g in ADVANTAGES.get("role_grpo")(groups) for a in g.trajectories]
    rows = build_rows([t for g in groups for t in g], advs, (A,), group_sizes=[len(g) for g in groups])
    uniform = -math.log(len(tokenizer))  # ~ a random tiny model's logprob, so that ratios stay near 1
    for r in rows:
        r.sampler_logprobs = [uniform + 0.01 * (i % 3) if m else 0.0 for i, m in enumerate(r.loss_mask)]
    if extra_plain:  # a row of no group: plain, next to the packs in one batch
        ids = tokenizer.encode("A row of its own, trained from its third token on.")
        rows.append(plain_row(ids, 2, adv=-0.5, old=uniform))
    return rows


def logprobs_and_grads(model, units, pad_id, chunk_size=512):
    model.zero_grad(set_to_none=True)
    batch = collate(units, pad_id)
    logprobs, entropy = sequence_logprobs(model, batch, chunk_size=chunk_size)
    loss, _ = ppo_loss(logprobs, batch.sampler_logprobs, batch.advantages, batch.loss_mask, dual_clip=3.0)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return batch, logprobs.detach(), entropy.detach(), loss.item(), grads


def assert_same_logprobs_and_grads(model, rows, pad_id, chunk_size=512, atol=1e-5, grad_rtol=1e-4):
    units = pack_shared_prefixes(rows)
    assert any(isinstance(u, PackedRows) for u in units)
    plain_batch, plain_lp, plain_ent, plain_loss, plain_grads = logprobs_and_grads(model, rows, pad_id, chunk_size)
    packed_batch, packed_lp, packed_ent, packed_loss, packed_grads = logprobs_and_grads(model, units, pad_id, chunk_size)
    # the same rows in the same [B, T] layout: the loss needs no change
    assert torch.equal(packed_batch.loss_mask, plain_batch.loss_mask) and torch.equal(packed_batch.input_ids, plain_batch.input_ids)
    assert packed_batch.forwarded_tokens < plain_batch.forwarded_tokens
    valid = plain_batch.attention_mask.bool()
    valid[:, 0] = False  # position 0 has no logprob (0 in both)
    assert packed_lp[:, 0].eq(0).all() and packed_lp[~plain_batch.attention_mask.bool()].eq(0).all()
    torch.testing.assert_close(packed_lp[valid], plain_lp[valid], rtol=0, atol=atol)
    torch.testing.assert_close(packed_ent[valid], plain_ent[valid], rtol=0, atol=10 * atol)
    assert packed_loss == pytest.approx(plain_loss, rel=1e-5)
    assert packed_grads.keys() == plain_grads.keys() and plain_grads
    for name, grad in plain_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=grad_rtol, atol=grad_rtol * grad.abs().max().item() + 1e-12, msg=name)
    assert sum(g.abs().sum() for g in plain_grads.values()) > 0  # a nonzero gradient was compared


@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"), ("qwen2", "eager")])
def test_packed_logprobs_and_gradients_match_separate_rows(tokenizer, arch, attn):
    model = hf_tiny_model(tokenizer, arch=arch, attn_implementation=attn)
    assert model.config._attn_implementation == attn
    rows = grouped_rows(tokenizer)
    assert len(rows) == 9 and len(pack_shared_prefixes(rows)) == 3  # two packs of 4 + one plain row, padded to one width
    # chunk_size 7: the packed pairs run over several checkpointed LM-head chunks too
    assert_same_logprobs_and_grads(model, rows, tokenizer.pad_token_id, chunk_size=7)


def test_packed_logprobs_through_peft(tokenizer):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(hf_tiny_model(tokenizer), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    rows = grouped_rows(tokenizer, k=3)
    assert_same_logprobs_and_grads(model, rows, tokenizer.pad_token_id)
    with torch.no_grad(), model.disable_adapter():
        base, _ = sequence_logprobs(model, collate(pack_shared_prefixes(rows), tokenizer.pad_token_id))
    with torch.no_grad():
        adapted, _ = sequence_logprobs(model, collate(pack_shared_prefixes(rows), tokenizer.pad_token_id))
    assert not torch.allclose(adapted, base)  # the adapter is on the packed path


@pytest.mark.parametrize("lora", [False, True])
def test_packed_forward_under_activation_checkpointing(tokenizer, monkeypatch, lora):
    """The trainer's activation_checkpointing (non-reentrant, also under LoRA, as load_trainable
    sets it up): the backward recomputes each layer with the prefix-grouped attention too (2
    layers: 2 calls in the forward, 2 in the backward), so the gradients are those of separate
    rows; the model's attention implementation and checkpoint functions are its own again after."""
    from envace.algorithms import losses

    calls = []
    original = losses.prefix_grouped_attention
    monkeypatch.setattr(losses, "prefix_grouped_attention", lambda *a, **kw: calls.append(torch.is_grad_enabled()) or original(*a, **kw))
    model = hf_tiny_model(tokenizer)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    checkpoint_fns = [m._gradient_checkpointing_func for m in layers]
    assert_same_logprobs_and_grads(model, grouped_rows(tokenizer, k=3), tokenizer.pad_token_id)
    assert len(calls) == 4
    assert model.config._attn_implementation == "sdpa" and [m._gradient_checkpointing_func for m in layers] == checkpoint_fns


def test_packed_forward_restores_the_attention_implementation(tokenizer):
    model = hf_tiny_model(tokenizer, attn_implementation="eager")
    batch = collate(pack_shared_prefixes(grouped_rows(tokenizer, k=2)), tokenizer.pad_token_id)
    during = []
    model.model.layers[0].register_forward_pre_hook(lambda *_: during.append(model.config._attn_implementation))
    with torch.no_grad():
        sequence_logprobs(model, batch)
        sequence_logprobs(model, replace(batch, packed=None))  # plain rows: the model's own attention
    assert during == [PREFIX_GROUPED_ATTENTION, "eager"] and model.config._attn_implementation == "eager"
    bad = replace(batch, packed=replace(batch.packed, layout=PackedLayout(batch.packed.layout.width + 1, batch.packed.layout.rows)))
    with pytest.raises(ValueError, match="packed_layout is for"), torch.no_grad():
        sequence_logprobs(model, bad)
    assert model.config._attn_implementation == "eager"  # also after an error in the forward


class CPUAccelerator:
    """What backward_micro_batches needs of an accelerate.Accelerator, on one CPU process."""

    device = torch.device("cpu")

    def no_sync(self, model):
        return contextlib.nullcontext()

    def autocast(self):
        return contextlib.nullcontext()

    def backward(self, loss):
        loss.backward()


def test_micro_batches_count_packed_length_and_split_long_groups(tokenizer):
    rows = grouped_rows(tokenizer)
    one, two, lone = pack_shared_prefixes(rows)
    p, conts = one.prefix_len, [len(r.input_ids) - one.prefix_len for r in one.rows]
    assert (p, conts, one.length) == (32, [26, 28, 29, 31], 146)  # prefix once + 4 continuations
    assert (two.length, len(lone.input_ids)) == (150, 13)
    # micro-batches count a pack as one row of its packed length: padded tokens = 2 x 150 here
    assert [[id(u) for u in mb] for mb in micro_batches([one, two, lone], 300)] == [[id(two), id(one)], [id(lone)]]
    assert [len(mb) for mb in micro_batches([one, two, lone], 299)] == [1, 2]  # (two), then (one, lone): 2 x 146
    # a pack longer than the budget: sub-packs of consecutive continuations, each with the prefix.
    # Budget 32 + 26 + 28 = 86: rows 0-1 (86) | row 2 (61; + row 3 would be 92) | row 3 (63),
    # and a sub-pack of one row is that plain row.
    budget = p + conts[0] + conts[1]
    assert one.split(budget) == [PackedRows(one.rows[:2], p), one.rows[2], one.rows[3]]
    parts = [u for mb in micro_batches([one], budget) for u in mb]
    assert sorted(len(unit_rows([u])) for u in parts) == [1, 1, 2]
    assert all((u.length if isinstance(u, PackedRows) else len(u.input_ids)) <= budget for u in parts)
    assert one.split(one.length) == [one]  # whole when it fits
    # a continuation longer than the budget on its own still gets its own micro-batch
    assert [len(mb) for mb in micro_batches([one], 40)] == [1, 1, 1, 1]


def test_backward_micro_batches_with_shared_prefixes_gives_the_same_gradient(tokenizer):
    """The trainer's path: same step gradient with and without packing, also when a small budget
    splits the packs into sub-packs and the rows into several micro-batches."""
    model = hf_tiny_model(tokenizer)
    rows = grouped_rows(tokenizer)
    total = sum(sum(r.loss_mask) for r in rows)
    longest = max(u.length for u in pack_shared_prefixes(rows) if isinstance(u, PackedRows))

    def loss_fn(batch):
        logprobs, entropy = sequence_logprobs(model, batch)
        loss, m = ppo_loss(logprobs, batch.sampler_logprobs, batch.advantages, batch.loss_mask, roles=batch.roles, entropy=entropy, num_tokens=total)
        return loss, m | {"forwarded": batch.forwarded_tokens}

    results = {}
    for share, budget in [(False, 10_000), (True, 10_000), (True, longest - 1)]:
        model.zero_grad(set_to_none=True)
        metrics = backward_micro_batches(CPUAccelerator(), model, rows, budget, tokenizer.pad_token_id, loss_fn, share_prefix=share)
        results[share, budget] = ({n: p.grad.clone() for n, p in model.named_parameters()}, metrics)
    plain_grads, plain_metrics = results[False, 10_000]
    assert len(plain_metrics) == 1
    for key in [(True, 10_000), (True, longest - 1)]:
        grads, metrics = results[key]
        assert sum(m["tokens"] for m in metrics) == total == sum(m["tokens"] for m in plain_metrics)
        assert sum(m["loss"] for m in metrics) == pytest.approx(plain_metrics[0]["loss"], rel=1e-5)
        for name, grad in plain_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-4 * grad.abs().max().item(), msg=name)
    assert len(results[True, longest - 1][1]) > 1  # the small budget did split
    assert sum(m["forwarded"] for m in results[True, 10_000][1]) == forwarded_tokens(pack_shared_prefixes(rows)) < plain_metrics[0]["forwarded"]


def test_sft_rows_are_never_packed(tokenizer):
    from envace.training.sft import sft_rows

    groups = prompt_groups(tokenizer, k=2)
    rows = sft_rows([t for g in groups for t in g], (A,))
    assert all(r.prefix_group is None for r in rows) and pack_shared_prefixes(rows) == rows


# ---- truncated importance sampling (TIS) ----------------------------------------------------


def tis_inputs():
    # One row of 3 trained tokens. The sampler (behaviour) differs from the trainer's old logprobs by
    # old - behaviour = ln 0.5, ln 1.5, ln 4  ->  exp: 0.5, 1.5, 4  ->  w = min(., cap=2) = 0.5, 1.5, 2 (the third truncated).
    # The current policy moved token 1 only: logprobs - old = ln 1.1, 0, 0 -> ratio 1.1, 1, 1 (the ratio uses old, not behaviour).
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    behaviour = old - torch.tensor([[0.5, 1.5, 4.0]]).log()
    logprobs = (old + torch.tensor([[1.1, 1.0, 1.0]]).log()).requires_grad_()
    adv = torch.tensor([[1.0, -2.0, 1.0]])
    return logprobs, old, behaviour, adv, torch.ones(1, 3)


def test_ppo_loss_tis_hand_computed():
    logprobs, old, behaviour, adv, mask = tis_inputs()
    loss, metrics = ppo_loss(logprobs, old, adv, mask, behaviour_logprobs=behaviour, tis_cap=2.0)
    # PPO per token, -min(r A, clip(r) A): 1.1,+1 -> -1.1 (1.1 < 1.2, unclipped) | 1,-2 -> 2 | 1,+1 -> -1
    # times w: -1.1*0.5 = -0.55 | 2*1.5 = 3 | -1*2 = -2  ->  token mean (-0.55 + 3 - 2) / 3 = 0.15
    assert loss.item() == pytest.approx(0.15)
    assert metrics["pg_loss"] == pytest.approx(0.15)
    assert metrics["logprob_mismatch"] == pytest.approx((math.log(2) + math.log(1.5) + math.log(4)) / 3)  # 0.8283
    assert metrics["tis_weight"] == pytest.approx((0.5 + 1.5 + 2.0) / 3)
    assert metrics["tis_truncated_frac"] == pytest.approx(1 / 3)
    loss.backward()
    # d/dlogp of w * (-r A) / 3 = w * (-r A) / 3 (w is detached): 0.5*(-1.1)/3, 1.5*2/3, 2*(-1)/3
    assert logprobs.grad[0].tolist() == pytest.approx([-0.55 / 3, 1.0, -2 / 3])
    # uncapped correction is off without a cap: plain PPO, (-1.1 + 2 - 1) / 3, mismatch still reported
    plain, metrics = ppo_loss(logprobs, old, adv, mask, behaviour_logprobs=behaviour)
    assert plain.item() == pytest.approx(-0.1 / 3)
    assert "tis_weight" not in metrics and metrics["logprob_mismatch"] == pytest.approx(0.8283, abs=1e-4)
    # a masked-out token counts in neither the loss nor the metrics: drop token 3 -> (-0.55 + 3) / 2
    loss, metrics = ppo_loss(logprobs, old, adv, torch.tensor([[1.0, 1.0, 0.0]]), behaviour_logprobs=behaviour, tis_cap=2.0)
    assert loss.item() == pytest.approx(1.225) and metrics["tis_truncated_frac"] == 0.0 and metrics["tis_weight"] == pytest.approx(1.0)


def test_tis_without_a_mismatch_is_plain_ppo():
    logprobs, old, _, adv, mask = tis_inputs()
    plain, plain_metrics = ppo_loss(logprobs, old, adv, mask)
    # no behaviour logprobs = same numerics: the cap changes nothing and adds no metric
    same, metrics = ppo_loss(logprobs, old, adv, mask, tis_cap=2.0)
    assert same.item() == plain.item() and metrics.keys() == plain_metrics.keys()
    # behaviour == old: w = 1 everywhere
    same, metrics = ppo_loss(logprobs, old, adv, mask, behaviour_logprobs=old.clone(), tis_cap=2.0)
    assert same.item() == pytest.approx(plain.item()) and metrics["tis_weight"] == 1.0 and metrics["logprob_mismatch"] == 0.0
    with pytest.raises(ValueError, match="tis_cap"):
        ppo_loss(logprobs, old, adv, mask, tis_cap=0.0)


def test_the_updates_own_detached_logprobs_as_old_give_the_policy_gradient_by_hand():
    """The trainer's one optimizer step per batch passes its forward's logprobs, detached, as the
    old ones: ratio 1 on every token, nothing clipped, approx_kl 0, and the gradient is the plain
    policy gradient -A / N per token (here N = 2 trained tokens: d/dlogp = 0, -1/2, +1)."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv, mask = torch.tensor([[5.0, 1.0, -2.0]]), torch.tensor([[0.0, 1.0, 1.0]])
    loss, metrics = ppo_loss(logprobs, logprobs.detach(), adv, mask, dual_clip=3.0)
    assert loss.item() == pytest.approx((-1.0 + 2.0) / 2)  # -(r A) per token, r = 1: -1 | +2
    assert metrics["clip_frac"] == 0.0 and metrics["approx_kl"] == 0.0
    loss.backward()
    assert logprobs.grad[0].tolist() == pytest.approx([0.0, -0.5, 1.0])


@pytest.mark.slow
def test_packed_rows_match_separate_rows_on_the_default_model():
    """The real SmolLM2-135M (fp32, sdpa): packed K=3 groups give the separate rows' logprobs
    and every parameter's PPO gradient."""
    from envace.backends.models import load_model

    model, tokenizer = load_model("default", device="cpu", dtype=torch.float32)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    rows = grouped_rows(tokenizer, k=3)
    with torch.no_grad():  # the rows as if this model had sampled them: ratios 1, as in the trainer's update
        own, _ = sequence_logprobs(model, collate(rows, tokenizer.pad_token_id))
    for r, values in zip(rows, own.tolist()):
        r.sampler_logprobs = values[: len(r.input_ids)]
    assert_same_logprobs_and_grads(model.train(), rows, tokenizer.pad_token_id, atol=1e-4, grad_rtol=1e-3)


# ---- scoring only what the loss reads ------------------------------------------------------

def test_selected_logprob_its_gradient_and_the_entropy_by_hand():
    """logits (0, ln 3): p = (1/4, 3/4). log p[1] = ln 3/4; d/dlogits = onehot - p = (-1/4, 1/4);
    H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.5623."""
    from envace.algorithms import losses

    logits = torch.tensor([[0.0, math.log(3.0)]], requires_grad=True)
    logp, entropy = losses._token_logprobs(torch.nn.Identity(), None, logits, torch.tensor([1]))
    assert logp.item() == pytest.approx(math.log(0.75))
    assert entropy.item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), abs=1e-6)
    assert not entropy.requires_grad  # a metric
    (2 * logp).sum().backward()  # upstream gradient 2
    torch.testing.assert_close(logits.grad, torch.tensor([[-0.5, 0.5]]))


@pytest.mark.parametrize("packed", [False, True])
def test_trained_only_scores_the_loss_tokens_with_the_same_values_and_gradients(tokenizer, packed):
    """The update scores only loss_mask > 0 tokens (the prompts' are never read by a loss): those
    equal the all-positions values, every other position is 0, and the loss's gradients are the same."""
    model = hf_tiny_model(tokenizer)
    rows = grouped_rows(tokenizer, k=3)
    units = pack_shared_prefixes(rows) if packed else rows
    results = {}
    for trained_only in (False, True):
        model.zero_grad(set_to_none=True)
        batch = collate(units, tokenizer.pad_token_id)
        logprobs, entropy = sequence_logprobs(model, batch, chunk_size=5, trained_only=trained_only)
        loss, _ = ppo_loss(logprobs, batch.sampler_logprobs, batch.advantages, batch.loss_mask, dual_clip=3.0)
        loss.backward()
        results[trained_only] = (batch, logprobs.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    batch, all_lp, all_ent, all_grads = results[False]
    _, lp, ent, grads = results[True]
    trained = batch.loss_mask > 0
    assert trained.any() and (~trained & batch.attention_mask.bool()).any()  # both kinds of position exist
    torch.testing.assert_close(lp[trained], all_lp[trained], rtol=0, atol=1e-5)
    torch.testing.assert_close(ent[trained], all_ent[trained], rtol=0, atol=1e-4)
    assert lp[~trained].eq(0).all() and ent[~trained].eq(0).all()
    for name, grad in all_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6 + 1e-4 * grad.abs().max().item(), msg=name)


@pytest.mark.parametrize("packed", [False, True])
def test_a_padding_micro_batch_reaches_every_parameter_with_a_zero_gradient(tokenizer, packed):
    """A process with nothing to train (no rows, or only rows of advantage 0, left out of the
    update) backpropagates `lockstep_micro_batches`' padding row so it joins the gradient
    all-reduce (DDP) or the collectives (FSDP2, ZeRO-3): with `trained_only` it has no token to
    score, yet its loss must reach every parameter, and only with a zero gradient."""
    model = hf_tiny_model(tokenizer)
    (padding,) = lockstep_micro_batches([], 10, pad_id=tokenizer.pad_token_id)
    batch = collate(pack_shared_prefixes(padding) if packed else padding, tokenizer.pad_token_id)
    logprobs, _ = sequence_logprobs(model, batch, trained_only=True)
    loss, _ = ppo_loss(logprobs, batch.sampler_logprobs, batch.advantages, batch.loss_mask, num_tokens=1.0)
    loss.backward()  # failed before: "element 0 of tensors does not require grad"
    assert loss.item() == 0.0
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.eq(0).all(), name
    # Without autograd too (a no-grad forward such as the KL reference's) the LM head runs: ZeRO-3 all-gathers its
    # weights when it is called, and the other processes' heads wait for that.
    calls = []
    model.get_output_embeddings().register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        sequence_logprobs(model, batch, trained_only=True)
    assert calls
