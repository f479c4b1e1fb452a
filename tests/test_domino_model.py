"""`method: domino`: the network equals SpecForge's Domino math, and its decode is the trained one.

The reference below is SpecForge's `DominoDraftModel.apply_logits_head` and the inputs its
`OnlineDominoModel` gives it, restated here from its source (a GRU over the whole block of
previous-token embeddings, sliced at `suffix_start`, for both label layouts): our training
forward + `domino_logits` must give the same logits. The left-to-right decode (`domino_walk`)
must be the argmax of those logits teacher-forced on its own drafts.
"""

from __future__ import annotations

import pytest
import torch

from dspine_train.modeling import DSpineConfig
from dspine_train.modeling.exponential_race import exponential_noise
from tests._model_helpers import context_features, tiny_draft, tiny_target

IDS = torch.tensor([[3, 17, 200, 45, 9, 88, 120, 7, 61, 30, 11, 5]])


def _domino(shift: bool, prefix: int, block: int = 5):
    target = tiny_target(seed=3)
    draft = tiny_draft(target, method="domino", block_size=block, domino_emb_dim=12,
                       domino_gru_hidden_dim=20, domino_shift_label=shift,
                       domino_prefix_len=prefix)
    torch.manual_seed(7)
    with torch.no_grad():  # a delta strong enough to move the argmax
        draft.embed_proj[2].weight.normal_(std=2.0)
        draft.embed_proj[0].weight.normal_(std=0.5)
    return target, draft.eval()


def _reference_logits(draft, hidden4d, input_ids, anchors, shift, prefix):
    """SpecForge's Domino logits (B, A, Bk, V) from the normed final states (B, A, Bk, H), with
    torch's `nn.GRU` holding our GRU's weights."""
    bk = draft.config.block_size
    seq = input_ids.shape[1]
    base = torch.nn.functional.linear(hidden4d, draft._target_head)
    start = 1 if shift else 0  # its label_start
    idx = (anchors[..., None] + torch.arange(start, start + bk)).clamp(max=seq - 1)
    target_ids = torch.gather(input_ids[:, None].expand(-1, anchors.shape[1], -1), 2, idx)
    if shift:
        pidx = (anchors[..., None] + torch.arange(bk)).clamp(max=seq - 1)
        prev = torch.gather(input_ids[:, None].expand(-1, anchors.shape[1], -1), 2, pidx)
    else:
        prev = target_ids
    emb = draft.embed_tokens(prev)  # (B, A, Bk, H)
    b, a = anchors.shape
    suffix_start = prefix if shift else 1 + prefix
    gru = torch.nn.GRU(emb.shape[-1], draft.prefix_gru.hidden_size, batch_first=True, bias=False)
    gru.load_state_dict(draft.prefix_gru.state_dict())  # torch's own GRU, our weights
    if shift:
        out, _ = gru(emb.reshape(b * a, bk, -1))
        states = out.reshape(b, a, bk, -1)[:, :, suffix_start:]
    else:
        out, _ = gru(emb[:, :, : bk - 1].reshape(b * a, bk - 1, -1))
        states = out.reshape(b, a, bk - 1, -1)[:, :, suffix_start - 1:]
    z = hidden4d[:, :, suffix_start:]
    delta = draft.embed_proj(torch.cat([z, states], dim=-1))
    return torch.cat([base[:, :, :suffix_start], base[:, :, suffix_start:] + delta], dim=2), target_ids


@pytest.mark.parametrize("shift,prefix", [(False, 0), (False, 1), (True, 1), (True, 0)])
def test_training_logits_equal_specforge_domino(shift, prefix):
    target, draft = _domino(shift, prefix)
    feats, _ = context_features(target, draft, IDS)
    anchors = torch.tensor([[0, 3, 5]])
    with torch.no_grad():
        out = draft(IDS, feats, anchors)
        ref, ref_targets = _reference_logits(draft, draft.norm(out.hidden), IDS, anchors, shift,
                                             prefix)
        first = 0 if shift else 1
        p = draft.config.num_predictions
        assert out.labels.shape[-1] == p and out.prev_ids.shape[-1] == p
        states = draft.domino_prev_states(out.prev_ids)
        corrected = torch.arange(1, p + 1) > prefix
        ours, base = draft.domino_logits(out.hidden[:, :, first:], states,
                                         corrected.expand(*anchors.shape, p))
    torch.testing.assert_close(ours, ref[:, :, first:], rtol=1e-5, atol=1e-5)
    # the labels are SpecForge's targets (inside the sequence)
    inside = out.labels >= 0
    assert out.labels[inside].equal(ref_targets[:, :, first:][inside])
    assert not torch.equal(ours, base)  # the correction is there


def _block(shift, prefix):
    target, draft = _domino(shift, prefix)
    feats, _ = context_features(target, draft, IDS)
    cache = draft.new_context_cache(1, IDS.shape[1] + 8)
    draft.append_context(cache, feats, torch.tensor([IDS.shape[1]]))
    anchor = torch.tensor([11])
    base, pre, _ = draft.draft_forward(cache, anchor)
    first = 0 if shift else 1
    return draft, base, pre[:, first:], anchor, cache


def _teacher_forced(draft, hidden, anchor, tokens):
    prev = torch.cat([anchor[:, None], tokens[:, :-1]], dim=1)
    p = tokens.shape[1]
    with torch.no_grad():
        states = draft.domino_prev_states(prev)
        corrected = (torch.arange(1, p + 1) > draft.config.domino_prefix_len)[None]
        return draft.domino_logits(hidden, states, corrected)[0][0]


@pytest.mark.parametrize("shift,prefix", [(False, 0), (True, 1)])
def test_greedy_walk_is_the_argmax_of_the_teacher_forced_logits(shift, prefix):
    draft, base, hidden, anchor, cache = _block(shift, prefix)
    tokens = draft.domino_walk(base, hidden, anchor).tokens
    assert tokens.shape == (1, draft.config.num_predictions)
    forced = _teacher_forced(draft, hidden, anchor, tokens)
    assert forced.argmax(-1).tolist() == tokens[0].tolist()
    assert base[0].argmax(-1).tolist() != tokens[0].tolist()  # the GRU term matters here
    # `propose` is this walk
    assert draft.propose(cache, anchor).tokens.equal(tokens)


def test_sampled_walk_reports_the_distribution_it_drew_from():
    draft, base, hidden, anchor, cache = _block(True, 1)
    k, p = draft.num_candidates, draft.config.num_predictions
    noise = exponential_noise((1, p, k), torch.Generator().manual_seed(0))
    result = draft.domino_walk(base, hidden, anchor, temperature=0.7, noise=noise)
    forced = _teacher_forced(draft, hidden, anchor, result.tokens)
    top = torch.topk(forced, k, dim=-1)
    assert result.candidates[0].tolist() == top.indices.tolist()
    torch.testing.assert_close(result.q[0], torch.softmax(top.values / 0.7, dim=-1),
                               rtol=1e-5, atol=1e-6)
    again = draft.propose(cache, anchor, torch.tensor([0.7]), noise=noise)
    assert again.tokens.equal(result.tokens)


def test_config_defaults_round_trip_and_refusals(tmp_path):
    target, draft = _domino(True, 1)
    cfg = draft.config
    assert (cfg.injection, cfg.block_attention, cfg.transition_cache) == (False, "bidirectional",
                                                                          False)
    assert cfg.anchor_predicts and cfg.num_predictions == cfg.block_size
    draft.save_pretrained(tmp_path / "d")
    again = type(draft).from_pretrained(tmp_path / "d")
    for k, v in draft.state_dict().items():
        assert again.state_dict()[k].equal(v), k
    assert again.config.domino_shift_label is True and again.config.domino_prefix_len == 1
    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, num_layers=2, target_num_layers=4,
                  mask_token_id=63, transfer_dim=16, message_size=16, candidate_k=4)
    with pytest.raises(ValueError, match="domino_prefix_len"):
        DSpineConfig(method="domino", block_size=4, domino_prefix_len=3, **fields)
    with pytest.raises(ValueError, match="injection"):
        DSpineConfig(method="domino", injection=True, **fields)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        DSpineConfig(method="domino", draft_vocab_size=32, **fields)
    with pytest.raises(ValueError, match="domino_lambda_decay_ratio"):
        DSpineConfig(method="domino", domino_lambda_decay_ratio=0.0, **fields)
    # the other methods carry no Domino modules
    plain = DSpineConfig(method="dflash", **fields)
    assert plain.domino_gru_hidden_dim == 0 and not plain.anchor_predicts
