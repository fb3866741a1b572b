"""The torch sampler: reproducible, stop at EOS, logprobs of the distribution sampled from."""

import torch

from grpod.engine import Engine
from grpod.engine.rollout.torch_sampler import filter_top_p, sample
from tests.engine.helpers import config


def _eos_biased(engine: Engine, bias: float = 3.0) -> None:
    """Make EOS likely so that some completions stop early."""

    def hook(module, args, output):
        output.logits[..., engine.tokenizer.eos_token_id] += bias
        return output

    engine.model.register_forward_hook(hook)


def _sample(engine: Engine, seed: int, **kw):
    prompts = [[1, 4, 13, 5, 14], [1, 7, 14]] * 8  # ragged: left padding in use
    return sample(
        engine.model,
        prompts,
        max_new_tokens=6,
        temperature=kw.get("temperature", 1.0),
        top_p=kw.get("top_p", 1.0),
        eos_token_id=2,
        pad_token_id=0,
        generator=torch.Generator(engine.device).manual_seed(seed),
    )


def test_seeded_and_reproducible() -> None:
    engine = Engine(config())
    a, b, c = _sample(engine, 1), _sample(engine, 1), _sample(engine, 2)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    assert torch.equal(Engine(config()).rollout().input_ids, Engine(config()).rollout().input_ids)


def test_stops_at_eos_and_masks_the_padding_after_it() -> None:
    engine = Engine(config())
    _eos_biased(engine)
    out = _sample(engine, 0)
    lengths = out.mask.sum(-1)
    assert (lengths < 6).any() and (lengths > 1).any()
    for i, n in enumerate(lengths.tolist()):
        if n < 6:
            assert out.completion_ids[i, n - 1] == 2  # the EOS itself is trained on
            assert (out.completion_ids[i, n:] == 0).all()
            assert (out.logprobs[i, n:] == 0).all()
    assert not out.logprobs.is_inference() and not out.completion_ids.is_inference()


def test_logprobs_match_the_trainer_under_temperature() -> None:
    engine = Engine(config(temperature=0.7))
    report = engine.accumulate(engine.rollout())
    assert report.mismatch_max < 1e-4  # sampled-from distribution == trainer's scoring
    engine.flush()


def test_logprobs_are_of_the_top_p_renormalised_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    kept = filter_top_p(logits, 0.7)
    probs = kept.softmax(-1)
    assert probs[0, 2:].sum() == 0  # 0.63 + 0.23 crosses 0.7 at the second token
    assert torch.allclose(probs[0, :2].sum(), torch.tensor(1.0))
    engine = Engine(config())
    out = _sample(engine, 3, top_p=0.5)
    full = _sample(engine, 3)
    masked = out.logprobs[out.mask]
    assert (masked <= 0).all() and masked.max() > full.logprobs[full.mask].max() - 1e-6
